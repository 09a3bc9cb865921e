"""Fused Triton kernels for the CUDA forward: residual add + RMSNorm, RoPE + KV-cache write, SiLU * up.

Inside a CUDA graph the cost of a small kernel is its launch slot, not its math: the unfused layer
runs ~50 of them (RMSNorm alone is seven elementwise ops), which at batch 1 costs more than reading
the layer's weights. These three kernels bring a layer to ten launches. Each rounds where the
PyTorch modules round (RMSNorm normalises in float32, casts, then multiplies by the weight in the
activation dtype; SiLU is rounded before the product), so they compute what ``llama.py`` computes;
RoPE is done in float32 and rounded once, which is at least as accurate as the module's bf16 steps.

Importing never fails: without Triton ``HAS_TRITON`` is False and nothing here is called (the
model keeps its PyTorch path). ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors for tests.
"""

from __future__ import annotations

import torch

from tandem.shared.infra.triton_runtime import HAS_TRITON, tl, triton


@triton.jit
def _add_rms_norm_kernel(X, Residual, Weight, Out, ResidualOut, stride_x, stride_r, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(Out.dtype.element_ty)
        tl.store(ResidualOut + row * N + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * N + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; with ``residual=None``, ``(rms_norm(x), x)``."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
        residual.stride(0) if residual is not None else 0, float(eps),
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=8 if block >= 4096 else 4,
    )
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * N + offs, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[T, 2I]`` -> ``[T, I]``."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), N=n, BLOCK=block)
    return out


@triton.jit
def _rope_and_cache_kernel(QKV, Positions, Cos, Sin, QOut, Cache, Slots, stride_qkv, stride_cos,
                           stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
                           NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HALF: tl.constexpr, HALF_PADDED: tl.constexpr, HEADS: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # q heads, then k heads
    offs = tl.arange(0, HALF_PADDED)
    in_range = (heads < NUM_Q_HEADS + NUM_KV_HEADS)[:, None] & (offs < HALF)[None, :]
    pos = tl.load(Positions + token)
    cos = tl.load(Cos + pos * stride_cos + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_cos + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    row = QKV + token * stride_qkv + heads[:, None] * HEAD_DIM + offs[None, :]
    x1 = tl.load(row, mask=in_range, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=in_range, other=0.0).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(QOut.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(QOut.dtype.element_ty)
    is_q = (heads < NUM_Q_HEADS)[:, None]
    out = QOut + (token * NUM_Q_HEADS + heads)[:, None] * HEAD_DIM + offs[None, :]
    tl.store(out, r1, mask=in_range & is_q)
    tl.store(out + HALF, r2, mask=in_range & is_q)
    is_k = in_range & ~is_q
    kv_head = tl.where(heads < NUM_Q_HEADS, 0, heads - NUM_Q_HEADS)[:, None]
    slot = tl.load(Slots + token)
    base = (Cache + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head + offs[None, :])
    tl.store(base, r1, mask=is_k)
    tl.store(base + HALF, r2, mask=is_k)
    v_row = QKV + token * stride_qkv + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs[None, :]
    tl.store(base + stride_cache_kv, tl.load(v_row, mask=is_k), mask=is_k)
    tl.store(base + stride_cache_kv + HALF, tl.load(v_row + HALF, mask=is_k), mask=is_k)


# Heads one program rotates in a prefill step (from this many tokens): one program per head and
# token, 64-element loads each, left 8,192 tokens x 40 heads at about a third of HBM's rate; a
# decode step's few tokens keep one head per program, spread over the SMs.
ROPE_HEADS_PER_PROGRAM, ROPE_WIDE_FROM_TOKENS = 8, 1024


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_q_heads: int, num_kv_heads: int, kv_cache: torch.Tensor, layer: int,
                   slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q and k of a fused projection ``qkv [T, (Hq + 2 Hkv) D]`` by their positions, write k and
    v into ``kv_cache[:, layer]`` at ``slot_mapping``, and return the rotated q ``[T, Hq, D]``.

    ``cos``/``sin`` are the model's float32 tables ``[max_positions, D/2]``."""
    tokens = qkv.shape[0]
    head_dim = kv_cache.shape[-1]
    q = torch.empty((tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    layer_cache = kv_cache[:, layer]  # [blocks, 2, bs, Hkv, D]
    heads = 1 if tokens < ROPE_WIDE_FROM_TOKENS else min(ROPE_HEADS_PER_PROGRAM,
                                                          triton.next_power_of_2(num_q_heads + num_kv_heads))
    _rope_and_cache_kernel[(tokens, triton.cdiv(num_q_heads + num_kv_heads, heads))](
        qkv, positions, cos, sin, q, layer_cache, slot_mapping, qkv.stride(0), cos.stride(0),
        layer_cache.stride(0), layer_cache.stride(1), layer_cache.stride(2), layer_cache.stride(3),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        HALF_PADDED=triton.next_power_of_2(head_dim // 2), HEADS=heads, BLOCK_SIZE=kv_cache.shape[3],
        num_warps=2,
    )
    return q


def can_fuse(x: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda
