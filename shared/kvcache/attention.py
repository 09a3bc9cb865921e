"""Paged attention over the block-major KV cache, for a flattened varlen batch (vLLM style).

A step's batch is ``T`` query tokens from ``B`` sequences laid end to end (prefill chunks and
decode tokens mixed). ``AttentionMetadata`` says where each sequence's queries start, how long each
context is after this step's writes, which physical blocks hold it, and which cache slot each new
token's K/V goes to. ``paged_attention`` writes this step's K/V and attends: on CUDA through Triton
(the split-K decode kernel for one-token rows, the tiled kernel for prefill chunks), otherwise
through a batched gather of whole blocks plus masked SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import triton_attention, triton_decode


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (all tensors on the model's device)."""

    slot_mapping: torch.Tensor  # long[T]: block_id * block_size + offset for each new token's K/V
    query_start_loc: torch.Tensor  # int32[B+1]: cumulative query lengths, starting at 0
    context_lens: torch.Tensor  # int32[B]: tokens in the cache after this step's writes
    block_tables: torch.Tensor  # int32[B, max_blocks]: physical block ids, padded with 0
    max_query_len: int
    max_context_len: int
    block_size: int
    num_decode_seqs: int = 0  # leading sequences with exactly one query token (the scheduler puts decodes first)

    def split_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """(decode part, prefill part) of a mixed batch, so neither pads its queries to the other's
        length: padded attention over B decodes plus one 512-token chunk would otherwise cost B x 512
        query rows instead of B + 512."""
        nd = self.num_decode_seqs
        starts = self.query_start_loc
        decode = AttentionMetadata(self.slot_mapping[:nd], starts[: nd + 1], self.context_lens[:nd],
                                   self.block_tables[:nd], 1, self.max_context_len, self.block_size, nd)
        prefill = AttentionMetadata(self.slot_mapping[nd:], starts[nd:] - nd, self.context_lens[nd:],
                                    self.block_tables[nd:], self.max_query_len, self.max_context_len,
                                    self.block_size, 0)
        return decode, prefill


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Build metadata on the CPU with tensor ops, then one host->device copy per tensor.

    Query token ``i`` of sequence ``b`` sits at position ``context_lens[b] - query_lens[b] + i``;
    its slot is ``block_tables[b][pos // block_size] * block_size + pos % block_size``.
    """
    num_seqs = len(query_lens)
    if not num_seqs or len(context_lens) != num_seqs or len(block_tables) != num_seqs:
        raise ValueError("need one query length, context length and block table per sequence (B > 0)")
    max_blocks = max(1, max(len(table) for table in block_tables))
    flat_tables: list[int] = []
    for table in block_tables:  # one pass over block ids; no per-token work
        flat_tables.extend(table)
        flat_tables.extend([0] * (max_blocks - len(table)))
    tables = torch.tensor(flat_tables, dtype=torch.int32).view(num_seqs, max_blocks)
    query_lens_t = torch.tensor(query_lens, dtype=torch.long)
    context_lens_t = torch.tensor(context_lens, dtype=torch.long)
    table_lens = torch.tensor([len(table) for table in block_tables], dtype=torch.long)
    if bool((query_lens_t < 0).any() | (query_lens_t > context_lens_t).any()):
        raise ValueError(f"need 0 <= query_len <= context_len, got {query_lens} / {context_lens}")
    if bool((context_lens_t > table_lens * block_size).any()):
        raise ValueError("a block table is too short for its context length")

    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long)
    torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
    positions = (
        torch.arange(num_tokens)
        - query_start_loc[seq_of_token]
        + (context_lens_t - query_lens_t)[seq_of_token]
    )
    block_ids = tables[seq_of_token, positions // block_size].long()
    slot_mapping = block_ids * block_size + positions % block_size

    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        context_lens=context_lens_t.to(device=device, dtype=torch.int32),
        block_tables=tables.to(device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_size=block_size,
        num_decode_seqs=next((i for i, n in enumerate(query_lens) if n != 1), num_seqs),
    )


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's ``k``/``v`` ``[T, Hkv, D]`` into ``kv_cache[:, layer]`` at the slots.

    The layer's slots are not one flat view (blocks are strided by all layers), so the flat slot
    is split into (block, offset) and written with one advanced-index put per tensor.
    """
    block_size = kv_cache.shape[3]
    block_index = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offset = slot_mapping - block_index * block_size
    kv_cache[:, layer, 0][block_index, offset] = k.to(kv_cache.dtype)
    kv_cache[:, layer, 1][block_index, offset] = v.to(kv_cache.dtype)


def gather_paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference path: pad queries per sequence, gather whole blocks, masked SDPA, unpad.

    Fully batched over sequences (no Python loop over sequences or tokens, no device sync).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[4]
    block_size = meta.block_size
    device = q.device
    query_start = meta.query_start_loc.long()
    context_lens = meta.context_lens.long()
    query_lens = query_start[1:] - query_start[:-1]
    num_seqs = context_lens.shape[0]
    max_q, num_keys = meta.max_query_len, meta.max_context_len

    # Padded queries [B, max_q, Hq, D]: row i of sequence b is token query_start[b] + i.
    rows = torch.arange(max_q, device=device)
    token_of_row = (query_start[:-1, None] + rows[None, :]).clamp(max=num_tokens - 1)
    q_padded = q[token_of_row]

    # Keys/values [B, num_keys, Hkv, D] gathered block by block through the block tables: one
    # advanced-index gather each, whose result is contiguous, so the reshape is a free view.
    num_table_blocks = -(-num_keys // block_size)
    tables = meta.block_tables[:, :num_table_blocks].long()
    keys = kv_cache[tables, layer, 0].view(num_seqs, -1, num_kv_heads, head_dim)[:, :num_keys]
    values = kv_cache[tables, layer, 1].view(num_seqs, -1, num_kv_heads, head_dim)[:, :num_keys]

    key_pos = torch.arange(num_keys, device=device)
    query_pos = (context_lens - query_lens)[:, None] + rows[None, :]  # [B, max_q]
    mask = (key_pos[None, None, :] < context_lens[:, None, None]) & (
        key_pos[None, None, :] <= query_pos[:, :, None]
    )
    # Padding rows (and a degenerate empty context) always see key 0, so no row is all -inf:
    # their softmax stays finite and nothing NaN can leak through later ops.
    mask |= key_pos == 0

    # GQA without copying K/V per query head: query heads h = kv_head * group + g are stacked along
    # the query axis of their kv head, [B, Hkv, group * max_q, D], and the mask repeats to match.
    group = num_q_heads // num_kv_heads
    q_heads = q_padded.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q_heads = q_heads.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    k_heads = keys.transpose(1, 2).to(q.dtype)
    v_heads = values.transpose(1, 2).to(q.dtype)
    group_mask = mask.repeat(1, group, 1)[:, None]  # [B, 1, group * max_q, K]
    out = F.scaled_dot_product_attention(q_heads, k_heads, v_heads, attn_mask=group_mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_q_heads, head_dim)

    # Unpad: token t of sequence s is padded row s * max_q + (t - query_start[s]).
    tokens = torch.arange(num_tokens, device=device)
    seq_of_token = torch.searchsorted(query_start[1:], tokens, right=True)
    return out[seq_of_token * max_q + tokens - query_start[seq_of_token]]


def triton_attend(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """Attend over a cache that already holds this step's K/V (CUDA): decode rows through the
    split-K decode kernel, prefill chunks through the tiled kernel."""
    nd = meta.num_decode_seqs
    if nd == 0:
        return triton_attention.triton_paged_attention(q, kv_cache, layer, meta, scale)
    decode_out = triton_decode.triton_decode_attention(
        q[:nd], kv_cache, layer, meta.block_tables[:nd], meta.context_lens[:nd], meta.max_context_len, scale)
    if nd == meta.context_lens.shape[0]:
        return decode_out
    _, prefill = meta.split_decodes()
    return torch.cat([decode_out, triton_attention.triton_paged_attention(q[nd:], kv_cache, layer, prefill, scale)])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into the cache, then attend ``q`` ``[T, Hq, D]`` -> ``[T, Hq, D]``."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    write_kv_cache(k, v, kv_cache, layer, meta.slot_mapping)
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    if q.is_cuda and triton_attention.HAS_TRITON:
        return triton_attend(q, kv_cache, layer, meta, scale)
    if 0 < meta.num_decode_seqs < meta.context_lens.shape[0] and meta.max_query_len > 1:
        decode, prefill = meta.split_decodes()
        nd = meta.num_decode_seqs  # decode sequences hold exactly one token each
        return torch.cat([gather_paged_attention(q[:nd], kv_cache, layer, decode, scale),
                          gather_paged_attention(q[nd:], kv_cache, layer, prefill, scale)])
    return gather_paged_attention(q, kv_cache, layer, meta, scale)
