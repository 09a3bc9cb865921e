"""Triton paged-attention kernel for a flattened varlen batch (prefill chunks and decode together).

Grid: (sequence, query head, query tile of BLOCK_M rows). Each program loads its query tile once,
then walks the sequence's keys in tiles of BLOCK_N positions, looking each position's physical block
up in the block table, with a flash-attention online softmax in fp32. Causality is by absolute
position (query row i of a sequence sits at ``context_len - query_len + i``), so a prefill chunk that
continues a cached context and a one-token decode are the same code. GQA maps query head h to kv
head ``h // (Hq // Hkv)``. The cache is read in place through its strides
(``[num_blocks, L, 2, block_size, Hkv, D]``), so no copy of the layer is made.

Only the key tiles that cross the diagonal build a causal mask; the query tiles that attend to the
most keys are launched first, so they do not make the tail; scores are scaled by log2(e) and go
through exp2. Decode rows of a mixed step take ``triton_decode.py``'s split-K kernel instead; the
tile per shape is :func:`prefill_tile`'s (``benchmarks/prefill_attention.py`` sweeps it).

Importing this file never fails: without Triton (CPU builds) ``HAS_TRITON`` is False, the kernel is
left as an unused plain function, and callers take the gather path.
"""

from __future__ import annotations

import torch

from tandem.shared.infra.triton_runtime import HAS_TRITON, tl, triton

LOG2_E = 1.4426950408889634  # scores scaled by it go through exp2, the hardware's own exponential


@triton.jit
def _attend_key_tile(acc, l_i, m_i, q, kv_start, K_cache, V_cache, table_row, kv_head, query_pos, kv_end,
                     qk_scale, stride_cache_block, stride_cache_slot, stride_cache_head,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
                     BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, MASKED: tl.constexpr):
    """One key tile's step of the online softmax (scores in the log2 domain). Unmasked tiles lie wholly
    at or below the query tile's first position, so every row sees every key and no mask is built."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = offs_d < HEAD_DIM
    key_pos = kv_start + offs_n
    key_mask = key_pos < kv_end
    if MASKED:
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    else:
        block_ids = tl.load(table_row + key_pos // BLOCK_SIZE).to(tl.int64)
    slot_offsets = (
        block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
    )
    # K is loaded transposed, [D, BLOCK_N]; masked loads keep stale slots out entirely.
    k_ptrs = K_cache + slot_offsets[None, :] + offs_d[:, None]
    v_ptrs = V_cache + slot_offsets[:, None] + offs_d[None, :]
    if MASKED or HEAD_DIM != HEAD_DIM_PADDED:
        k = tl.load(k_ptrs, mask=key_mask[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if FP32_DOT:
        scores = tl.dot(q, k, input_precision="ieee") * qk_scale
    else:
        scores = tl.dot(q, k) * qk_scale
    if MASKED:
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    # Key 0 is visible to every row (real rows have position >= 0; padding rows sit past the
    # context), and the first tile holds it, so m_new is finite from the first tile on.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _paged_attention_kernel(
    Q, K_cache, V_cache, Out, BlockTables, QueryStartLoc, ContextLens,
    qk_scale, num_query_tiles,
    stride_q_token, stride_q_head,
    stride_o_token, stride_o_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    # A tile's BLOCK_M rows are HEADS_PER_TILE query heads of one GQA group times ROWS positions
    # (BLOCK_M = HEADS_PER_TILE x ROWS), so each K/V tile loaded serves all of them.
    seq = tl.program_id(0)
    first_head = tl.program_id(1) * HEADS_PER_TILE
    # The last query tiles attend to the most keys: launched first, they do not make the tail.
    tile = num_query_tiles - 1 - tl.program_id(2)

    query_start = tl.load(QueryStartLoc + seq)
    query_len = tl.load(QueryStartLoc + seq + 1) - query_start
    tile_start = tile * ROWS
    if tile_start >= query_len:  # the grid is sized for the longest query; shorter ones stop here
        return
    context_len = tl.load(ContextLens + seq)
    kv_head = first_head // QUERIES_PER_KV

    rows = tl.arange(0, BLOCK_M)
    row_token = tile_start + rows % ROWS
    row_head = first_head + rows // ROWS
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    row_mask = row_token < query_len
    dim_mask = offs_d < HEAD_DIM
    first_pos = context_len - query_len + tile_start
    query_pos = first_pos + rows % ROWS  # absolute position of each query row

    q_ptrs = (
        Q + (query_start + row_token).to(tl.int64)[:, None] * stride_q_token
        + row_head[:, None] * stride_q_head + offs_d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # Keys past the tile's last query position are never visible: stop there. Keys up to its first
    # position are visible to every row: tiles wholly among them need no mask.
    kv_end = context_len - query_len + tl.minimum(tile_start + ROWS, query_len)
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    table_row = BlockTables + seq.to(tl.int64) * stride_table_seq
    for kv_start in range(0, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, q, kv_start, K_cache, V_cache, table_row, kv_head, query_pos, kv_end, qk_scale,
            stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_N, FP32_DOT, False)
    for kv_start in range(unmasked_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_key_tile(
            acc, l_i, m_i, q, kv_start, K_cache, V_cache, table_row, kv_head, query_pos, kv_end, qk_scale,
            stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, BLOCK_N, FP32_DOT, True)

    acc = acc / l_i[:, None]
    out_ptrs = (
        Out + (query_start + row_token).to(tl.int64)[:, None] * stride_o_token
        + row_head[:, None] * stride_o_head + offs_d[None, :]
    )
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def heads_per_tile(queries_per_kv: int, block_m: int, pack_heads: bool) -> int:
    """How many of a GQA group's query heads share one tile: the largest power of two dividing the
    group that leaves at least 16 positions a tile (1 without packing)."""
    heads = 1
    while pack_heads and queries_per_kv % (heads * 2) == 0 and block_m // (heads * 2) >= 16:
        heads *= 2
    return heads


def prefill_tile(max_query_len: int, head_dim_padded: int, fp32: bool) -> dict[str, int | bool]:
    """The kernel's tile for a step: small query tiles for decode-heavy steps (query length <= 16),
    larger ones for prefill chunks; fp32 (tests) and wide heads halve the key tile to fit shared memory.

    The bf16 prefill tile is the one ``benchmarks/prefill_attention.py``'s sweep picks over its
    cases (fresh batched prompts, one long prompt, chunks after a cached prefix): the fastest in most
    and close to the best in the rest; 8 warps pay off only with 128 x 128 tiles, which lose overall."""
    if max_query_len <= 16:
        return {"block_m": 16, "block_n": 64 if head_dim_padded <= 128 and not fp32 else 32,
                "num_warps": 4, "num_stages": 3, "pack_heads": False}
    if fp32 or head_dim_padded > 128:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3, "pack_heads": True}
    return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3, "pack_heads": True}


def triton_paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta, scale: float,  # noqa: ANN001
    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, pack_heads: bool | None = None,
) -> torch.Tensor:
    """Attend ``q`` ``[T, Hq, D]`` over the cached context of each sequence -> ``[T, Hq, D]``.

    The cache must already hold this step's K/V (``paged_attention`` writes them first).
    ``meta`` is an ``AttentionMetadata`` (untyped here to avoid an import cycle). The tile arguments
    override :func:`prefill_tile`'s choice (``benchmarks/prefill_attention.py`` sweeps them).
    """
    if not HAS_TRITON:
        raise RuntimeError("Triton is not available")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[4]
    if q.stride(-1) != 1:
        q = q.contiguous()
    key_cache = kv_cache[:, layer, 0]  # [num_blocks, bs, Hkv, D] views; strides shared by K and V
    value_cache = kv_cache[:, layer, 1]
    if kv_cache.stride(-1) != 1 or key_cache.stride(2) != head_dim:
        raise ValueError("kv_cache must be contiguous in its last two dims")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"query dtype {q.dtype} differs from cache dtype {kv_cache.dtype}")
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    block_tables = meta.block_tables.contiguous()
    query_start_loc = meta.query_start_loc.contiguous()
    context_lens = meta.context_lens.contiguous()

    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    tile = prefill_tile(meta.max_query_len, head_dim_padded, q.dtype == torch.float32)
    overrides = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
                 "pack_heads": pack_heads}
    tile.update({name: value for name, value in overrides.items() if value is not None})
    queries_per_kv = num_q_heads // num_kv_heads
    heads = heads_per_tile(queries_per_kv, tile["block_m"], tile["pack_heads"])
    num_seqs = context_lens.shape[0]
    num_query_tiles = triton.cdiv(meta.max_query_len, tile["block_m"] // heads)
    _paged_attention_kernel[(num_seqs, num_q_heads // heads, num_query_tiles)](
        q, key_cache, value_cache, out, block_tables, query_start_loc, context_lens,
        float(scale) * LOG2_E, num_query_tiles,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=meta.block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_M=tile["block_m"],
        HEADS_PER_TILE=heads,
        ROWS=tile["block_m"] // heads,
        BLOCK_N=tile["block_n"],
        FP32_DOT=q.dtype == torch.float32,
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )
    return out
