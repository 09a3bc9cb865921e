"""Tests for tandem.shared.kvcache paged attention, metadata and cache helpers.

CPU tests check the gather path against plain per-sequence causal SDPA over contiguous K/V.
GPU tests (``-m gpu``) check the Triton kernel against the gather path on the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from tandem.shared.kvcache.attention import (
    AttentionMetadata,
    build_attention_metadata,
    gather_paged_attention,
    paged_attention,
)
from tandem.shared.kvcache.cache import (
    allocate_kv_cache,
    gather_blocks,
    kv_cache_bytes_per_block,
    num_blocks_for_memory,
    scatter_blocks,
)
from tandem.shared.kvcache.triton_attention import HAS_TRITON, heads_per_tile

NUM_LAYERS, LAYER = 2, 1

# Each sequence is (tokens already cached, tokens queried this step); block size 16 unless noted.
BATCHES = {
    "decode": [(5, 1), (16, 1), (0, 1), (31, 1), (47, 1)],
    "prefill": [(0, 7), (0, 16), (0, 17), (0, 3)],
    "chunked": [(8, 8), (13, 5), (16, 16), (3, 1), (0, 20)],
    "boundary": [(0, 16), (15, 1), (16, 1), (31, 2), (0, 32), (0, 33), (32, 1)],
    # Decodes first, then chunks: the scheduler's order, attended as two unpadded parts.
    "decodes_then_chunks": [(5, 1), (16, 1), (31, 1), (8, 8), (0, 20), (15, 2)],
}
GQA = [(4, 4), (4, 2), (8, 2)]  # (query heads, kv heads): ratios 1, 2, 4


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, the whole context [ctx, Hkv, D]
    values: list[torch.Tensor]
    seqs: list[tuple[int, int]]
    block_tables: list[list[int]]
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(
    seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int = 32,
    block_size: int = 16, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
) -> Case:
    """Random batch whose prior context is already in a cache with shuffled, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(prior + query) // block_size) + 1 for prior, query in seqs]  # +1 spare
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables, start = [], 0
    for count in blocks_per_seq:
        block_tables.append(order[start : start + count])
        start += count
    kv_cache = allocate_kv_cache(num_blocks, NUM_LAYERS, block_size, num_kv_heads, head_dim, dtype, device)
    keys, values, queries, k_new, v_new = [], [], [], [], []
    for (prior, query), table in zip(seqs, block_tables):
        context = prior + query
        seq_keys = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
        seq_values = torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(prior):  # test-side write of the cached prefix, independent of the code
            kv_cache[table[pos // block_size], LAYER, 0, pos % block_size] = seq_keys[pos]
            kv_cache[table[pos // block_size], LAYER, 1, pos % block_size] = seq_values[pos]
        keys.append(seq_keys.to(device))
        values.append(seq_values.to(device))
        queries.append(torch.randn(query, num_q_heads, head_dim, generator=gen).to(dtype))
        k_new.append(seq_keys[prior:])
        v_new.append(seq_values[prior:])
    meta = build_attention_metadata(
        [query for _, query in seqs], [p + q for p, q in seqs], block_tables, block_size, device
    )
    return Case(
        q=torch.cat(queries).to(device), k_new=torch.cat(k_new).to(device), v_new=torch.cat(v_new).to(device),
        keys=keys, values=values, seqs=seqs, block_tables=block_tables, kv_cache=kv_cache, meta=meta,
        scale=head_dim**-0.5,
    )


def reference_attention(case: Case) -> torch.Tensor:
    """Plain causal SDPA per sequence over contiguous float64 K/V, concatenated -> [T, Hq, D]."""
    outputs, token = [], 0
    for (prior, query), keys, values in zip(case.seqs, case.keys, case.values):
        q = case.q[token : token + query].double().transpose(0, 1)  # [Hq, query, D]
        group = q.shape[0] // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        query_pos = prior + torch.arange(query, device=q.device)
        mask = torch.arange(prior + query, device=q.device)[None, :] <= query_pos[:, None]
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale).transpose(0, 1))
        token += query
    return torch.cat(outputs)


def expected_slots(case: Case, block_size: int) -> list[tuple[int, int]]:
    return [
        (case.block_tables[b][pos // block_size], pos % block_size)
        for b, (prior, query) in enumerate(case.seqs)
        for pos in range(prior, prior + query)
    ]


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("batch", BATCHES)
def test_gather_path_matches_reference(batch: str, num_q_heads: int, num_kv_heads: int) -> None:
    case = make_case(BATCHES[batch], num_q_heads, num_kv_heads)
    out = paged_attention(case.q, case.k_new, case.v_new, case.kv_cache, LAYER, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), "padding rows must not leak NaN"
    torch.testing.assert_close(out.double(), reference_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_gather_path_other_block_sizes(block_size: int) -> None:
    case = make_case(BATCHES["chunked"] + BATCHES["decode"], 4, 2, block_size=block_size, seed=3)
    out = paged_attention(case.q, case.k_new, case.v_new, case.kv_cache, LAYER, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=1e-5, rtol=1e-5)


def test_gather_path_bf16() -> None:
    case = make_case(BATCHES["chunked"], 8, 2, dtype=torch.bfloat16, seed=1)
    out = paged_attention(case.q, case.k_new, case.v_new, case.kv_cache, LAYER, case.meta, case.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference_attention(case), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("batch", BATCHES)
def test_cache_writes_land_in_expected_slots(batch: str) -> None:
    case = make_case(BATCHES[batch], 4, 2, seed=2)
    before = case.kv_cache.clone()
    paged_attention(case.q, case.k_new, case.v_new, case.kv_cache, LAYER, case.meta, case.scale)
    slots = expected_slots(case, 16)
    assert case.meta.slot_mapping.tolist() == [block * 16 + offset for block, offset in slots]
    for token, (block, offset) in enumerate(slots):
        assert torch.equal(case.kv_cache[block, LAYER, 0, offset], case.k_new[token]), f"K of token {token}"
        assert torch.equal(case.kv_cache[block, LAYER, 1, offset], case.v_new[token]), f"V of token {token}"
    touched = torch.zeros_like(case.kv_cache, dtype=torch.bool)
    for block, offset in slots:
        touched[block, LAYER, :, offset] = True
    assert torch.equal(case.kv_cache[~touched], before[~touched]), "nothing else in the cache changes"


def test_build_attention_metadata_fields() -> None:
    meta = build_attention_metadata([3, 1, 0], [3, 10, 4], [[7, 2], [4], [5]], 10, "cpu")
    assert meta.query_start_loc.tolist() == [0, 3, 4, 4] and meta.query_start_loc.dtype == torch.int32
    assert meta.context_lens.tolist() == [3, 10, 4] and meta.context_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2], [4, 0], [5, 0]], "padded with 0"
    assert meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [70, 71, 72, 49] and meta.slot_mapping.dtype == torch.long
    assert (meta.max_query_len, meta.max_context_len, meta.block_size) == (3, 10, 10)
    assert meta.num_decode_seqs == 0, "the first sequence queries 3 tokens: no leading decodes"


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "tables"),
    [([2], [1], [[0]]), ([1], [17], [[0]]), ([1, 1], [1], [[0], [1]])],
)
def test_build_attention_metadata_rejects_bad_input(query_lens, context_lens, tables) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        build_attention_metadata(query_lens, context_lens, tables, 16, "cpu")


def test_cache_sizing_helpers() -> None:
    cache = allocate_kv_cache(3, 2, 16, 4, 8, torch.bfloat16, "cpu")
    assert cache.shape == (3, 2, 2, 16, 4, 8) and cache.dtype == torch.bfloat16
    assert not cache.any(), "the cache starts zeroed"
    per_block = kv_cache_bytes_per_block(2, 16, 4, 8, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 4 * 8 * 2 == cache[0].numel() * cache.element_size()
    assert num_blocks_for_memory(per_block * 5 + per_block - 1, 2, 16, 4, 8, torch.bfloat16) == 5
    assert num_blocks_for_memory(per_block - 1, 2, 16, 4, 8, torch.bfloat16) == 0


def test_gather_and_scatter_blocks_round_trip() -> None:
    source = torch.randn(6, 2, 2, 4, 2, 8)
    exported = gather_blocks(source, [4, 1, 3])
    assert exported.shape == (3, 2, 2, 4, 2, 8) and exported.is_contiguous()
    assert torch.equal(exported[0], source[4]) and torch.equal(exported[2], source[3])
    target = allocate_kv_cache(5, 2, 4, 2, 8, torch.float32, "cpu")
    scatter_blocks(target, torch.tensor([0, 2, 4]), exported.to(torch.float64))
    assert torch.equal(target[[0, 2, 4]], source[[4, 1, 3]])
    assert not target[[1, 3]].any(), "other blocks untouched"
    with pytest.raises(ValueError):
        scatter_blocks(target, [0, 1], exported)


@pytest.mark.parametrize(
    ("queries_per_kv", "block_m", "pack", "expected"),
    [
        (4, 128, True, 4),  # the 8B's groups: 4 heads x 32 positions
        (8, 128, True, 8),  # 8 heads x 16 positions
        (16, 128, True, 8),  # never fewer than 16 positions a tile
        (6, 128, True, 2),  # powers of two dividing the group
        (1, 128, True, 1),  # no GQA: nothing to share
        (4, 16, True, 1),  # decode tiles are 16 rows: no room
        (4, 128, False, 1),
    ],
)
def test_heads_sharing_a_prefill_tile(queries_per_kv: int, block_m: int, pack: bool, expected: int) -> None:
    heads = heads_per_tile(queries_per_kv, block_m, pack)
    assert heads == expected, f"{queries_per_kv} queries per KV head, {block_m} rows: {heads} heads a tile"
    assert queries_per_kv % heads == 0 and block_m // heads >= 16 or heads == 1


# --------------------------------------------------------------------------------- GPU (Triton)
requires_triton_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"
)
GPU_BATCHES = {
    **BATCHES,
    "mixed": BATCHES["decode"] + BATCHES["chunked"] + [(100, 130), (0, 70)],  # several query tiles
}


def run_triton_against_gather(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on a ``dtype`` copy of the cache vs the gather path in fp32 on the same values."""
    out = paged_attention(
        case.q.to(dtype), case.k_new.to(dtype), case.v_new.to(dtype), case.kv_cache, LAYER, case.meta, case.scale
    )
    reference = gather_paged_attention(case.q.to(dtype).float(), case.kv_cache.float(), LAYER, case.meta, case.scale)
    return out, reference


@pytest.mark.gpu
@requires_triton_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("batch", GPU_BATCHES)
def test_triton_matches_gather(batch: str, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype) -> None:  # noqa: ANN001
    case = make_case(GPU_BATCHES[batch], num_q_heads, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    out, reference = run_triton_against_gather(case, dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), reference_attention(case), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@requires_triton_gpu
@pytest.mark.parametrize("block_size", [1, 8, 32, 5])
@pytest.mark.parametrize("head_dim", [16, 96])
def test_triton_other_block_sizes_and_head_dims(block_size: int, head_dim: int) -> None:
    case = make_case(GPU_BATCHES["mixed"], 8, 2, head_dim, block_size=block_size, dtype=torch.float16, device="cuda")
    out, reference = run_triton_against_gather(case, torch.float16)
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@requires_triton_gpu
def test_triton_cache_writes_and_strided_query() -> None:
    case = make_case(BATCHES["chunked"], 8, 2, 64, device="cuda")
    # A query that is a strided view of a fused qkv projection, as a model would pass it.
    fused = torch.randn(case.q.shape[0], 12, 64, device="cuda")
    fused[:, :8] = case.q
    out = paged_attention(fused[:, :8], case.k_new, case.v_new, case.kv_cache, LAYER, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference_attention(case), atol=1e-4, rtol=1e-4)
    for token, (block, offset) in enumerate(expected_slots(case, 16)):
        assert torch.equal(case.kv_cache[block, LAYER, 0, offset], case.k_new[token])
