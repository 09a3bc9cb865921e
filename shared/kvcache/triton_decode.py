"""Triton split-K paged attention for decode (one query token per sequence), GQA-packed.

Decode reads every cached key and value once per step, so it is bound by memory bandwidth, and the
work must be spread over the whole GPU even at batch 1. Two kernels (flash-decoding):

1. ``_decode_partial_kernel``, grid ``(sequence, kv head, split)``: the query heads that share a KV
   head are packed into the rows of one tile (so K/V are read once per KV head, not once per query
   head), and split ``s`` covers keys ``[s * partition, (s + 1) * partition)`` of the context. It
   writes the split's normalised output and its log-sum-exp.
2. ``_decode_reduce_kernel``, grid ``(sequence, query head)``: merges the splits by their
   log-sum-exp weights.

Splits past a sequence's context exit at once, so the grid can be sized for the longest context a
batch may have (``max_context_len``): a CUDA graph captured with that bound replays correctly for
any shorter context, since lengths and block tables are read from device tensors.

Tested against the gather path on a GPU (``tests/gpu/test_fast_decode.py``); the tile rules are
plain Python, tested in ``tests/unit/kvcache/test_decode_tiles.py``.
"""

from __future__ import annotations

import torch

from tandem.shared.infra.triton_runtime import HAS_TRITON, tl, triton


@triton.jit
def _decode_partial_kernel(
    Q, K_cache, V_cache, MidOut, MidLse, BlockTables, ContextLens,
    scale,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    stride_mid_seq, stride_mid_head, stride_mid_split,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + seq)
    start = split * PARTITION
    if start >= context_len:
        return
    end = tl.minimum(start + PARTITION, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    group_mask = offs_g < GROUP
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        Q + seq.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=group_mask[:, None] & dim_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = BlockTables + seq.to(tl.int64) * stride_table_seq
    for kv_start in range(start, end, BLOCK_N):
        key_pos = kv_start + offs_n
        key_mask = key_pos < end
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        slots = (block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
                 + kv_head * stride_cache_head)
        k = tl.load(K_cache + slots[None, :] + offs_d[:, None], mask=key_mask[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(V_cache + slots[:, None] + offs_d[None, :], mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
        if FP32_DOT:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = tl.where(key_mask[None, :], scores * scale, float("-inf"))
        # Every split holds at least one visible key, so m_new is finite after the first tile.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    mid = seq.to(tl.int64) * stride_mid_seq + heads * stride_mid_head + split * stride_mid_split
    tl.store(MidOut + mid[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc / l_i[:, None],
             mask=group_mask[:, None])
    tl.store(MidLse + mid, m_i + tl.log(l_i), mask=group_mask)


@triton.jit
def _decode_reduce_kernel(
    MidOut, MidLse, Out, ContextLens,
    stride_mid_seq, stride_mid_head, stride_mid_split,
    stride_o_token, stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(ContextLens + seq)
    num_splits = (context_len + PARTITION - 1) // PARTITION
    offs_s = tl.arange(0, SPLITS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    split_mask = offs_s < num_splits
    mid = seq.to(tl.int64) * stride_mid_seq + head * stride_mid_head + offs_s * stride_mid_split
    lse = tl.load(MidLse + mid, mask=split_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(MidOut + mid[:, None] * HEAD_DIM_PADDED + offs_d[None, :], mask=split_mask[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(Out + seq.to(tl.int64) * stride_o_token + head * stride_o_head + offs_d, out.to(Out.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_partition(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int = 132) -> int:
    """Keys per split: small enough that ``sequences x kv heads x splits`` fills every SM a few
    times over, large enough that a split's fixed cost (loading Q, writing a partial, the merge)
    stays small. At large batches 1,024 keys read K/V closer to the HBM rate than 512 do
    (``benchmarks/decode_attention.py`` measures it), so the split halves only while SMs go idle."""
    partition = 1024
    while partition > 64 and num_seqs * num_kv_heads * triton_cdiv(max_context_len, partition) < 4 * num_sms:
        partition //= 2
    return partition


def choose_warps(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> tuple[int, int | None]:
    """``(num_warps, num_stages)`` of the partial kernel. A grid of at least one (sequence, kv head)
    pair per SM keeps every SM busy with small programs: two warps and three stages there, which
    beat four warps with Triton's stages both at large batches and at a grid of about two pairs per
    SM (``benchmarks/decode_attention.py`` compares them); four warps and Triton's own stages below
    that, where two warps showed no gain."""
    if num_seqs * num_kv_heads >= num_sms:
        return 2, 3
    return 4, None


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
    max_context_len: int, scale: float, partition: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """Attend one query token per sequence, ``q [B, Hq, D]``, over its cached context -> ``[B, Hq, D]``.

    ``max_context_len`` bounds every ``context_lens`` entry (and sizes the grid); the cache must
    already hold this step's K/V. ``partition``, ``block_n`` (keys per tile), ``num_warps`` and
    ``num_stages`` (Triton's default when None) override the tile choice, for
    ``benchmarks/decode_attention.py``'s sweep (:func:`choose_partition` and :func:`choose_warps` otherwise).
    """
    if not HAS_TRITON:
        raise RuntimeError("Triton is not available")
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[4]
    group = num_q_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    key_cache, value_cache = kv_cache[:, layer, 0], kv_cache[:, layer, 1]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132
    if partition is None:
        partition = choose_partition(num_seqs, num_kv_heads, max_context_len, sms)
    if num_warps is None:
        num_warps, default_stages = choose_warps(num_seqs, num_kv_heads, sms)
        num_stages = default_stages if num_stages is None else num_stages
    num_splits = triton_cdiv(max(1, max_context_len), partition)
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    mid_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim_padded), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    fp32 = q.dtype == torch.float32
    if block_n is None:
        block_n = 64 if not fp32 else 32
    tuning = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, mid_out, mid_lse, block_tables, context_lens,
        float(scale),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=kv_cache.shape[3],
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_N=min(block_n, partition),
        PARTITION=partition,
        FP32_DOT=fp32,
        **tuning,
    )
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        mid_out, mid_lse, out, context_lens,
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        PARTITION=partition,
        SPLITS_PADDED=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4,
    )
    return out
