"""The training forward and backward of the Llama-family decoder, as plain functions of named tensors.

Same math and parameter names as :mod:`tandem.shared.model.llama` (RMSNorm in fp32, half-split RoPE,
SiLU-gated MLP), but over a padded-free ``[B, S]`` batch with causal SDPA instead of the paged KV
cache. The functions take a parameter dict (views into whichever buffer holds the layer), so one
stateless template serves every layer. Memory stays bounded at long sequence lengths: the MLP runs
over token chunks (forward and backward), and the LM head + cross-entropy run chunked with their
backward fused in, so full ``[tokens, vocab]`` logits never exist; past :data:`ATTENTION_CHUNK` tokens
the attention half runs staged (:func:`layer_backward`), so what it holds across the layer is
q, k, v and SDPA's own tensors, not the norm's and projections' graph. On CUDA the two blocks can be
``torch.compile``d (:func:`compiled_blocks`): the norms, RoPE and SiLU-gating fuse into a few kernels,
fewer launches and memory round trips in a step's GPU compute (docs/measurements.md); the math and
parameter names stay the same. A LoRA run's adapter rides in the same parameter dicts: every
projection goes through :func:`project`, which adds the adapter's low-rank term where the dict holds
one (lora.py), so each path here (chunked, staged, packed, compiled) trains it.

Packed rows (several fine-tuning examples in one row, ``data.Batch.segments``) take two extra inputs:
RoPE tables gathered per position (``[B, S, head_dim/2]``, positions restarting at 0 with each
example, so an example sees the rotations it would see alone) and a block-diagonal causal mask that
keeps every query inside its own example. Unpacked rows keep ``is_causal`` SDPA, which is flash
attention on CUDA. On CUDA with the atomics kernels the mask is a FlexAttention block mask
(:func:`segment_block_mask`): the compiled flex kernel skips every 128 x 128 tile outside the
examples, so a packed row costs the attention its examples would cost alone, and the mask is a few
KiB. Elsewhere (CPU, and CUDA's deterministic steps, where compiled flex's fixed-order backward
costs several times the whole step in memory and time) it is the additive ``[B, 1, S, S]`` mask of :func:`segment_mask`
under SDPA: on CUDA the memory-efficient kernel, over every tile, masked or not. The math is the
same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tandem.shared.model.config import ModelConfig
from tandem.shared.model.llama import apply_rope, rope_inv_freq

Params = dict[str, torch.Tensor]
AttentionMask = torch.Tensor | BlockMask | None  # None: causal rows; else packed rows' mask (attend)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(cfg: ModelConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[seq_len, head_dim/2]`` in fp32 for positions 0..seq_len-1 (as the serving tables)."""
    positions = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(cfg))
    return freqs.cos().to(device), freqs.sin().to(device)


def packed_positions(segments: torch.Tensor) -> torch.Tensor:
    """RoPE positions ``[B, S]`` (int64) of packed rows: 0, 1, ... from each segment's first token."""
    seq = segments.shape[-1]
    index = torch.arange(seq, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return index - torch.cummax(torch.where(starts, index, 0), dim=-1).values


def packed_rope(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[S, head_dim/2]`` tables of :func:`rope_tables` gathered at ``positions`` ``[B, S]``."""
    return cos[positions], sin[positions]


def segment_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[B, 1, S, S]`` of packed rows: 0 where query i may see key j (same segment,
    j <= i), -inf elsewhere. Every query sees itself, so no row of the softmax is empty. The last dim
    is allocated padded to a multiple of 16 elements (then sliced): the memory-efficient CUDA kernel
    wants its bias rows aligned, and torch pads (copies) an unaligned mask on every call."""
    bsz, seq = segments.shape
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril_()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    padded = -(-seq // 16) * 16
    mask = torch.zeros(bsz, 1, seq, padded, dtype=dtype, device=segments.device)[..., :seq]
    return mask.masked_fill_(~allowed[:, None], float("-inf"))


FLEX_TILE = 128  # FlexAttention's tile, queries and keys alike


def segment_block_mask(segments: torch.Tensor) -> BlockMask:
    """:func:`segment_mask`'s rule (query i sees key j of its own segment, j <= i) as a FlexAttention
    block mask over ``segments`` ``[B, S]`` (on their device): which 128 x 128 tiles hold any allowed
    pair (partial), which hold only such pairs (full). Made once per step from where each example
    starts, in ``[B, tiles, tiles]`` work, never the ``[B, S, S]`` of the rule itself (at 524,288 tokens
    a row about 1 GiB of tile work, where the pairs would be 256 GiB of booleans).

    Each example is one contiguous run of its row (what packing makes; a ValueError otherwise). Then
    query tile ``t``'s rows see keys from its first row's example start to its last row, every tile
    in that range holds an allowed pair, and tile ``u < t`` is full when the example of ``t``'s last
    row starts at or before ``u``'s first key (one example covers both tiles whole)."""
    bsz, seq = segments.shape
    device = segments.device
    position = torch.arange(seq, device=device)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    ordered = segments.sort(dim=1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1)
    if bool((starts.sum(dim=1) != distinct).any()):
        raise ValueError("a packed row holds an example in two places: each example must be one contiguous run")
    run_start = torch.where(starts, position, 0).cummax(dim=1).values  # [B, S]: where each token's example starts

    tiles = -(-seq // FLEX_TILE)
    tile = torch.arange(tiles, device=device)
    first_row = tile * FLEX_TILE
    last_row = (first_row + FLEX_TILE).clamp(max=seq) - 1
    seen_from = run_start[:, first_row] // FLEX_TILE  # [B, tiles]: the first key tile a query tile sees
    full_from = -(-run_start[:, last_row] // FLEX_TILE)  # the first key tile whole inside the last row's example
    if seq % FLEX_TILE:  # the last query tile is cut short: never full (its rows past the end see nothing)
        full_from[:, -1] = tiles
    key_tile = tile[None, None, :]
    full_to = torch.minimum(full_from, tile[None, :])[..., None]  # full tiles run up to, not into, the diagonal
    full = (key_tile >= full_from[..., None]) & (key_tile < tile[None, :, None])
    partial = ((key_tile >= seen_from[..., None]) & (key_tile < full_to)) | (key_tile == tile[None, :, None])

    def same_example(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - FlexAttention's mask_mod signature
        return (segments[b, q_idx] == segments[b, kv_idx]) & (kv_idx <= q_idx)

    (partial_count, partial_index), (full_count, full_index) = _tile_lists(partial), _tile_lists(full)
    return BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index, BLOCK_SIZE=FLEX_TILE,
                                    mask_mod=same_example, seq_lengths=(seq, seq))


def _tile_lists(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``chosen`` ``[B, query tiles, key tiles]`` as a block mask's (count, indices) ``[B, 1, ...]`` int32:
    each query tile's chosen key tiles first, in increasing order (the order create_block_mask gives)."""
    count = chosen.sum(dim=-1, dtype=torch.int32)
    index = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[:, None].contiguous(), index[:, None].contiguous()


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """FlexAttention through ``torch.compile`` (its fused kernel; uncompiled it materialises the scores)."""
    return torch.compile(flex_attention, dynamic=False)


LORA_SCALING = "lora.scaling"  # a 0-dim fp32 tensor in a layer's params when it carries a LoRA adapter


def project(p: Params, name: str, x: torch.Tensor) -> torch.Tensor:
    """The projection ``name`` (``self_attn.q_proj``, ``mlp.down_proj``, ...) of ``x``: its weight and
    bias, plus, when ``p`` holds ``name.lora_A`` and ``name.lora_B`` (a LoRA run, lora.py), the
    adapter's ``lora_B(lora_A(x)) * scaling`` in PEFT's order of operations, so a CPU run in fp32
    matches PEFT to rounding. The adapter's tensors are its fp32 masters, cast to ``x``'s dtype
    here: on CUDA the adapter computes in bf16 as under autocast, and autograd hands their
    gradients back in fp32."""
    out = F.linear(x, p[name + ".weight"], p.get(name + ".bias"))
    lora_a = p.get(name + ".lora_A")
    if lora_a is None:
        return out
    low = F.linear(F.linear(x, lora_a.to(x.dtype)), p[name + ".lora_B"].to(x.dtype))
    return out + low * p[LORA_SCALING]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[B, S, H, D]`` with tables shared by every row (``[S, D/2]``) or per row
    (``[B, S, D/2]``, packed rows): the serving path's :func:`apply_rope`, over ``B·S`` tokens in the
    second case."""
    if cos.dim() == 2:
        return apply_rope(x, cos, sin)
    bsz, seq, heads, dim = x.shape
    flat = apply_rope(x.reshape(bsz * seq, heads, dim), cos.reshape(bsz * seq, -1), sin.reshape(bsz * seq, -1))
    return flat.view(bsz, seq, heads, dim)


def _project_qkv(p: Params, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_layernorm`` and the q, k, v projections of ``x`` ``[B, S, hidden]``, RoPE applied to q and
    k: ``[B, S, heads, head_dim]`` each (``kv_heads`` for k and v)."""
    bsz, seq, _ = x.shape
    h = rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps)
    q = project(p, "self_attn.q_proj", h).view(bsz, seq, cfg.num_heads, cfg.head_dim)
    k = project(p, "self_attn.k_proj", h).view(bsz, seq, cfg.num_kv_heads, cfg.head_dim)
    v = project(p, "self_attn.v_proj", h).view(bsz, seq, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.rms_norm_eps)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig, mask: AttentionMask) -> torch.Tensor:
    """Attention of ``[B, S, heads, head_dim]`` q, k, v: ``[B, S, q]``. ``mask`` None: causal SDPA; a
    :class:`BlockMask` (packed rows on CUDA): FlexAttention, GQA native, compiled on CUDA (eager on
    CPU: its reference implementation, for tests); a tensor: SDPA under that additive mask."""
    bsz, seq = q.shape[:2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    group = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim**-0.5
    if isinstance(mask, BlockMask):
        flex = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
        out = flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=group > 1)
    else:
        if group > 1:  # explicit GQA expansion: every SDPA backend (flash included) takes it
            k = k[:, :, None].expand(bsz, cfg.num_kv_heads, group, seq, cfg.head_dim).reshape(bsz, cfg.num_heads,
                                                                                               seq, -1)
            v = v[:, :, None].expand(bsz, cfg.num_kv_heads, group, seq, cfg.head_dim).reshape(bsz, cfg.num_heads,
                                                                                               seq, -1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(bsz, seq, cfg.num_heads * cfg.head_dim)


def _o_proj(p: Params, out: torch.Tensor) -> torch.Tensor:
    return project(p, "self_attn.o_proj", out)


def attention_block(p: Params, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig,
                    mask: AttentionMask = None) -> torch.Tensor:
    """``x + o_proj(causal_attention(input_layernorm(x)))`` for ``x`` of shape ``[B, S, hidden]``.

    ``mask`` None: each row is one causal sequence (``is_causal``: flash attention on CUDA). Else
    packed rows' mask (:func:`segment_block_mask` on CUDA, :func:`segment_mask` on CPU), with
    ``cos``/``sin`` per row."""
    q, k, v = _project_qkv(p, x, cos, sin, cfg)
    return x + _o_proj(p, attend(q, k, v, cfg, mask))


def mlp_block(p: Params, a: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``a + down(silu(gate(n)) * up(n))`` with ``n = post_attention_layernorm(a)``; any leading shape."""
    h = rms_norm(a, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    act = F.silu(project(p, "mlp.gate_proj", h)) * project(p, "mlp.up_proj", h)
    return a + project(p, "mlp.down_proj", act)


@dataclass(frozen=True)
class LayerBlocks:
    """The two halves of a decoder layer, eager or compiled; the layer functions run either."""

    attention: Callable[..., torch.Tensor] = attention_block
    mlp: Callable[..., torch.Tensor] = mlp_block


EAGER = LayerBlocks()


@functools.cache
def compiled_blocks() -> LayerBlocks:
    """The blocks through ``torch.compile`` (one compile per input shape and grad mode; the layer
    weights are inputs, so every layer shares the compiled code)."""
    return LayerBlocks(torch.compile(attention_block, dynamic=False), torch.compile(mlp_block, dynamic=False))


ATTENTION_CHUNK = 65536  # tokens past which a layer's attention half runs staged (layer_backward)


def _chunks(num_tokens: int, chunk: int) -> list[slice]:
    chunk = max(1, chunk)
    return [slice(s, min(s + chunk, num_tokens)) for s in range(0, num_tokens, chunk)]


def _table_rows(table: torch.Tensor, rows: slice) -> torch.Tensor:
    """The RoPE table of the positions ``rows``: shared (``[S, D/2]``) or per row (``[B, S, D/2]``)."""
    return table[rows] if table.dim() == 2 else table[:, rows]


@torch.no_grad()
def _staged_qkv(p: Params, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_project_qkv` of the whole sequence, computed ``chunk`` tokens at a time: the fp32 norm
    and the unrotated projections exist for one chunk only."""
    bsz, seq, _ = x.shape
    q = x.new_empty(bsz, seq, cfg.num_heads, cfg.head_dim)
    k = x.new_empty(bsz, seq, cfg.num_kv_heads, cfg.head_dim)
    v = torch.empty_like(k)
    for rows in _chunks(seq, chunk // bsz):
        q[:, rows], k[:, rows], v[:, rows] = _project_qkv(p, x[:, rows], _table_rows(cos, rows),
                                                          _table_rows(sin, rows), cfg)
    return q, k, v


def _mlp_forward(p: Params, a: torch.Tensor, cfg: ModelConfig, mlp_chunk: int, blocks: LayerBlocks) -> torch.Tensor:
    flat = a.view(-1, a.shape[-1])
    if flat.shape[0] <= mlp_chunk:
        return blocks.mlp(p, a, cfg)
    out = torch.empty_like(flat)
    for c in _chunks(flat.shape[0], mlp_chunk):
        out[c] = blocks.mlp(p, flat[c], cfg)
    return out.view_as(a)


def _mlp_backward(p: Params, a: torch.Tensor, grad_out: torch.Tensor, cfg: ModelConfig, mlp_chunk: int,
                  blocks: LayerBlocks, out: torch.Tensor | None = None) -> torch.Tensor:
    """dL/da of the MLP half (its residual included) for ``grad_out``, chunk by chunk over tokens,
    each chunk's graph freed before the next; into ``out`` when given (it may be ``grad_out`` itself:
    each chunk's gradient is read before its rows are written)."""
    a_flat = a.detach().view(-1, a.shape[-1])
    g_flat = grad_out.reshape(-1, a.shape[-1])
    grad_a = torch.empty_like(a_flat) if out is None else out.view(-1, a.shape[-1])
    for c in _chunks(a_flat.shape[0], mlp_chunk):
        a_c = a_flat[c].detach().requires_grad_(True)
        torch.autograd.backward(blocks.mlp(p, a_c, cfg), g_flat[c])
        grad_a[c] = a_c.grad
        del a_c
    return grad_a.view_as(a)


def staged(tokens: int, attention_chunk: int) -> bool:
    """Whether a layer over ``tokens`` (batch x sequence) runs its attention half staged
    (:func:`layer_backward`); the memory plan asks the same."""
    return tokens > attention_chunk


def flex_packing(cuda: bool, deterministic: bool) -> bool:
    """Whether packed rows take FlexAttention's block mask (:func:`segment_block_mask`) rather than
    the dense one: on CUDA with the atomics kernels only (module docstring); the plan asks the same."""
    return cuda and not deterministic


@torch.no_grad()
def layer_forward(p: Params, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig,
                  mlp_chunk: int, blocks: LayerBlocks = EAGER, mask: AttentionMask = None,
                  attention_chunk: int = ATTENTION_CHUNK) -> torch.Tensor:
    """One decoder layer without autograd state (the backward recomputes it); ``mask`` as in
    :func:`attention_block`; past ``attention_chunk`` tokens the projections run chunked, as in
    :func:`layer_backward`."""
    if staged(x.shape[0] * x.shape[1], attention_chunk):
        out = attend(*_staged_qkv(p, x, cos, sin, cfg, attention_chunk), cfg, mask)
        a = x + _o_proj(p, out)
        del out
    else:
        a = blocks.attention(p, x, cos, sin, cfg, mask)
    return _mlp_forward(p, a, cfg, mlp_chunk, blocks)


def layer_backward(p: Params, x: torch.Tensor, grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cfg: ModelConfig, mlp_chunk: int, blocks: LayerBlocks = EAGER,
                   mask: AttentionMask = None, attention_chunk: int = ATTENTION_CHUNK) -> torch.Tensor:
    """Recompute the layer from its input ``x`` and backpropagate ``grad_out``; returns dL/dx.

    ``p`` holds leaf tensors whose ``.grad`` are preset views of a gradient buffer: autograd adds
    into them in place. The MLP half runs chunk by chunk over tokens, each chunk's graph freed
    before the next, so only the attention half's graph is held across the layer.

    Past ``attention_chunk`` tokens (long sequences) even that graph is too large (the fp32 norm
    input, the normalised input, the unrotated projections: about 37 KB a token at 1B), so the
    attention half runs staged: q, k and v are computed chunk by chunk without a graph, only SDPA
    and ``o_proj`` keep theirs (their inputs, which exist anyway), and after SDPA's backward the
    norm and projections are recomputed chunk by chunk to take dq, dk, dv back to dL/dx. That
    computes the q, k, v projections once more (about 3% of a 1B layer's matmul FLOPs) and
    consumes ``grad_out``: its buffer holds dL/dx on return."""
    if staged(x.shape[0] * x.shape[1], attention_chunk):
        return _staged_layer_backward(p, x, grad_out, cos, sin, cfg, mlp_chunk, blocks, mask, attention_chunk)
    with torch.enable_grad():
        x_leaf = x.detach().requires_grad_(True)
        a = blocks.attention(p, x_leaf, cos, sin, cfg, mask)
        grad_a = _mlp_backward(p, a, grad_out, cfg, mlp_chunk, blocks)
        torch.autograd.backward(a, grad_a)
    return x_leaf.grad


def _staged_layer_backward(p: Params, x: torch.Tensor, grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           cfg: ModelConfig, mlp_chunk: int, blocks: LayerBlocks, mask: AttentionMask,
                           attention_chunk: int) -> torch.Tensor:
    q, k, v = (t.requires_grad_(True) for t in _staged_qkv(p, x, cos, sin, cfg, attention_chunk))
    with torch.enable_grad():
        out = attend(q, k, v, cfg, mask)
        out_leaf = out.detach().requires_grad_(True)
        a = x.detach() + _o_proj(p, out_leaf)
    reuse = grad_out if grad_out.is_contiguous() else None  # grad_out is consumed
    grad_a = _mlp_backward(p, a, grad_out, cfg, mlp_chunk, blocks, out=reuse)
    torch.autograd.backward(a, grad_a)
    del a
    torch.autograd.backward(out, out_leaf.grad)
    del out, out_leaf
    dq, dk, dv = q.grad, k.grad, v.grad
    del q, k, v
    with torch.enable_grad():
        for rows in _chunks(x.shape[1], attention_chunk // x.shape[0]):
            x_c = x[:, rows].detach().requires_grad_(True)
            torch.autograd.backward(_project_qkv(p, x_c, _table_rows(cos, rows), _table_rows(sin, rows), cfg),
                                    (dq[:, rows], dk[:, rows], dv[:, rows]))
            grad_a[:, rows] += x_c.grad  # the residual's gradient plus the projections'
            del x_c
    return grad_a


def embed_forward(p: Params, input_ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(input_ids, p["model.embed_tokens.weight"])


@torch.no_grad()
def embed_backward(grad_embed: torch.Tensor, input_ids: torch.Tensor, grad_x: torch.Tensor) -> None:
    """Add dL/d(embedding table) for ``grad_x`` (``[B, S, hidden]``) into ``grad_embed``."""
    grad_embed.index_add_(0, input_ids.reshape(-1), grad_x.reshape(-1, grad_x.shape[-1]).to(grad_embed.dtype))


def head_loss_backward(p: Params, head_name: str, x: torch.Tensor, targets: torch.Tensor, num_targets: int,
                       cfg: ModelConfig, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm + LM head + mean cross-entropy, forward and backward fused, over token chunks.

    Returns ``(loss, dL/dx)``; the norm's and head's gradients are added into their leaves'
    preset ``.grad``. ``num_targets`` is the divisor of the mean (targets of -100 are ignored)."""
    flat, tflat = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
    grad_x = torch.empty_like(flat)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    with torch.enable_grad():
        for c in _chunks(flat.shape[0], chunk):
            x_c = flat[c].detach().requires_grad_(True)
            logits = F.linear(rms_norm(x_c, p["model.norm.weight"], cfg.rms_norm_eps), p[head_name]).float()
            part = F.cross_entropy(logits, tflat[c], reduction="sum", ignore_index=-100) / num_targets
            part.backward()
            grad_x[c] = x_c.grad
            loss += part.detach()
    return loss, grad_x.view_as(x)
