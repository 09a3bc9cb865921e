"""How compactly the host keeps a full-training job's state: the masters' and Adam moments' formats.

The default keeps fp32 masters and fp32 moments (12 bytes a parameter, plus the working copy and the
gradient buffers). Two options shrink it, each with its own parity bound against fp32 AdamW
(tests/unit/train/test_state_format.py):

- ``master_weights``: ``bf16-sr`` keeps the masters in bf16 and rounds each update stochastically
  (unbiased: small updates survive on average instead of rounding away); ``bf16-kahan`` keeps a
  bf16 compensation beside the bf16 master, carrying what rounding dropped into the next update.
  Where the compute dtype is bf16 (CUDA) a bf16 master *is* the working copy: no separate one.
- ``adam_moments``: ``int8`` keeps both moments 8-bit, block-quantized as bitsandbytes' Adam8bit
  does (a scale per block of :data:`BLOCK` elements, its largest magnitude), with a power-law code
  so small values keep precision: the first moment signed, ``m = s · absmax · (q/127)²``; the
  second unsigned, ``v = absmax · (q/255)⁴``. Codes are rounded to nearest (ties to even).

The update itself is AdamW's in fp32 with the new moments unquantized, as host_adam.c's fp32 path;
only what is stored changes. Blocks and random streams are laid out per decay range of a unit
(``UnitLayout.decay_ranges``): a range's first element starts a block, and the stochastic rounding
of element ``i`` of a unit (its index in the unit) draws :func:`hash32` of the step's seed and ``i``,
so a rerun and a resume round alike.

:func:`adamw_reference` is the arithmetic in torch, element for element what host_adam.c's compact
path computes (the kernel is tested against it bit for bit), and the optimizer's path where no C
compiler is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

MasterWeights = Literal["fp32", "bf16-sr", "bf16-kahan"]
AdamMoments = Literal["fp32", "int8"]
BLOCK = 256  # elements per quantization block of the int8 moments
M_LEVELS, V_LEVELS = 127.0, 255.0
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class StateFormat:
    master: MasterWeights = "fp32"
    moments: AdamMoments = "fp32"

    @property
    def default(self) -> bool:
        return self.master == "fp32" and self.moments == "fp32"

    @property
    def bf16_master(self) -> bool:
        return self.master != "fp32"

    @property
    def kahan(self) -> bool:
        return self.master == "bf16-kahan"

    @property
    def int8_moments(self) -> bool:
        return self.moments == "int8"

    def master_shares_work(self, work_dtype: torch.dtype) -> bool:
        """Whether the working copy is the master itself (a bf16 master where the GPU computes in bf16)."""
        return self.bf16_master and work_dtype == torch.bfloat16

    def state_bytes(self, numel: int, ranges: list[tuple[int, int, float]] | None = None) -> int:
        """Host bytes of one unit's masters, compensation and moments (not its working copy or gradients)."""
        master = (2 + (2 if self.kahan else 0)) if self.bf16_master else 4
        if not self.int8_moments:
            return numel * (master + 8)
        blocks = num_blocks(ranges or [(0, numel, 0.0)])
        return numel * (master + 2) + blocks * 8

    def describe(self) -> str:
        master = {"fp32": "fp32 masters", "bf16-sr": "bf16 masters (stochastic rounding)",
                  "bf16-kahan": "bf16 masters with bf16 Kahan compensation"}[self.master]
        moments = "fp32 moments" if not self.int8_moments else f"int8 moments (blocks of {BLOCK})"
        return f"{master}, {moments}"


FP32_STATE = StateFormat()  # the default: fp32 masters and moments


def num_blocks(ranges: list[tuple[int, int, float]]) -> int:
    """Quantization blocks of a unit whose decay ranges are ``ranges``: each range starts a block."""
    return sum(-(-(hi - lo) // BLOCK) for lo, hi, _ in ranges)


def block_offsets(ranges: list[tuple[int, int, float]]) -> list[int]:
    """Per range, the index of its first block in the unit's scale arrays."""
    offsets, at = [], 0
    for lo, hi, _ in ranges:
        offsets.append(at)
        at += -(-(hi - lo) // BLOCK)
    return offsets


def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root, correctly rounded as C's ``sqrtf``: ``torch.sqrt`` on CPU is an ulp off for
    some inputs in some builds (MKL's); fp64's root rounded to fp32 is the correctly rounded one (a
    float's root never lies within an fp64 ulp of a midpoint between floats)."""
    return torch.sqrt(x.double()).float()


def hash32(x: int) -> int:
    """A 32-bit integer mix (lowbias32): the same in Python, torch (:func:`hash32_tensor`) and C."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def hash32_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`hash32` of each element of an int64 tensor holding values below 2³²."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32  # int64 products wrap; their low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def step_seed(job_seed: int, unit: int, step: int) -> int:
    """The stochastic rounding's seed for one unit's update of ``step``."""
    return hash32(job_seed * 0x9E3779B1 + step * 0x85EBCA6B + unit * 0xC2B2AE35)


def rounding_noise(seed: int, start: int, count: int) -> torch.Tensor:
    """The 16 noise bits of elements ``start .. start + count`` of a unit, as int64."""
    index = torch.arange(start, start + count, dtype=torch.int64)
    return hash32_tensor(index * 0x9E3779B1 + seed) & 0xFFFF


def bf16_stochastic(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 ``p`` to bf16, rounding its magnitude up with probability (dropped bits) / 2¹⁶;
    non-finite values round to nearest."""
    bits = p.view(torch.int32).to(torch.int64) & MASK32
    rounded = ((bits + noise) >> 16) & 0xFFFF
    out = rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(p), out, p.to(torch.bfloat16))


def quantize_blocks(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (1-D fp32, its length a multiple of BLOCK after padding with zeros) to codes and
    per-block absmax."""
    blocks = values.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    if signed:
        codes = torch.round(sqrt32(blocks.abs() / safe) * M_LEVELS)
        codes = torch.where(blocks < 0, -codes, codes).to(torch.int8)
    else:
        codes = torch.round(sqrt32(sqrt32(blocks / safe)) * V_LEVELS).to(torch.uint8)
    return codes.view(-1), absmax


def dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    blocks = codes.view(-1, BLOCK).to(torch.float32)
    scale = absmax.unsqueeze(1)
    if signed:
        t = blocks.abs() / M_LEVELS
        out = (t * t) * scale
        out = torch.where(blocks < 0, -out, out)
    else:
        t = blocks / V_LEVELS
        t2 = t * t
        out = (t2 * t2) * scale
    return out.view(-1)


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.numel() == length:
        return t
    out = torch.zeros(length, dtype=t.dtype)
    out[: t.numel()] = t
    return out


def adamw_reference(master: torch.Tensor, comp: torch.Tensor | None, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, m_absmax: torch.Tensor | None, v_absmax: torch.Tensor | None,
                    grad: torch.Tensor, work: torch.Tensor | None, hyper: tuple[float, ...], seed: int,
                    index_base: int, write_master: bool, write_moments: bool, write_work: bool) -> None:
    """One decay range's update, in place, as host_adam.c's compact path: ``master`` fp32 or bf16
    (``comp``: its bf16 Kahan compensation, or None), moments fp32 (``m_absmax`` None) or int8/uint8
    codes with their blocks' absmax, ``grad`` bf16 or fp32, ``work`` a separate working copy (None
    where the master is it). ``hyper`` as host_adam.c's: scale, 1 - lr·wd, 1 - β1, β2, 1 - β2, eps,
    lr / bias correction 1, sqrt(bias correction 2). ``index_base``: the range's first element's
    index in its unit (the rounding noise's)."""
    scale, decay, beta1c, beta2, beta2c, eps, step_size, bc2_sqrt = (torch.tensor(h, dtype=torch.float32)
                                                                      for h in hyper)
    n = master.numel()
    quantized = m_absmax is not None
    padded = -(-n // BLOCK) * BLOCK
    g = grad.to(torch.float32) * scale
    if quantized:
        m_old = dequantize_blocks(_padded(exp_avg, padded), m_absmax, signed=True)[:n]
        v_old = dequantize_blocks(_padded(exp_avg_sq, padded), v_absmax, signed=False)[:n]
    else:
        m_old, v_old = exp_avg, exp_avg_sq
    m = m_old + beta1c * (g - m_old)
    v = v_old * beta2 + (beta2c * g) * g
    p_old = master.to(torch.float32)
    p = p_old * decay
    denom = sqrt32(v) / bc2_sqrt + eps
    p = p - step_size * (m / denom)
    if write_master:
        if master.dtype == torch.float32:
            new_master = p
        elif comp is None:
            new_master = bf16_stochastic(p, rounding_noise(seed, index_base, n))
        else:
            y = comp.to(torch.float32) + (p - p_old)
            new_master = (p_old + y).to(torch.bfloat16)
            comp.copy_((y - (new_master.to(torch.float32) - p_old)).to(torch.bfloat16))
        master.copy_(new_master)
    if write_work and work is not None:
        work.copy_((master if write_master and master.dtype != torch.float32 else p).to(work.dtype))
    if write_moments:
        if quantized:
            codes, absmax = quantize_blocks(_padded(m, padded), signed=True)
            exp_avg.copy_(codes[:n])
            m_absmax.copy_(absmax)
            codes, absmax = quantize_blocks(_padded(v, padded), signed=False)
            exp_avg_sq.copy_(codes[:n])
            v_absmax.copy_(absmax)
        else:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
