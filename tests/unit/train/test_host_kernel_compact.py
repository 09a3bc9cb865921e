"""The host kernel's compact pass (host_adam.c's ``tandem_adamw_compact``) against
``state_format.adamw_reference``, bit for bit: every master, moment, grad and working-copy format,
each pass of the preview/commit split, several steps fed back, ragged and multi-thread lengths.

Run: ``python -m pytest -q tests/unit/train/test_host_kernel_compact.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.shared.train import host_kernel
from tandem.shared.train.state_format import BLOCK, adamw_reference, quantize_blocks, step_seed

KERNEL = host_kernel.load()
if KERNEL is None:
    pytest.skip("the host AdamW kernel did not build (is a C compiler installed?)", allow_module_level=True)

BETAS, EPS = (0.9, 0.95), 1e-8
N = BLOCK * 37 + 19  # a partial last block
BIG_N = 2 * 65536 + 5 * BLOCK + 77  # three of the kernel's pieces, the last one partial
MASTERS = ("fp32", "bf16-sr", "bf16-kahan")
NAMES = ("master", "comp", "exp_avg", "exp_avg_sq", "m_absmax", "v_absmax", "work")
DTYPE = {None: "shared", torch.float32: "fp32", torch.bfloat16: "bf16"}


def hyper(step: int, lr: float = 3e-4, wd: float = 0.1, scale: float = 0.8) -> tuple[float, ...]:
    b1, b2 = BETAS
    return (scale, 1 - lr * wd, 1 - b1, b2, 1 - b2, EPS, lr / (1 - b1**step), math.sqrt(1 - b2**step))


def writes(kind: str, master: str) -> tuple[bool, bool, bool]:
    """(write_master, write_moments, write_work) of a pass, as the optimizer's split makes them."""
    bf16 = master != "fp32"
    return {"whole": (True, True, True), "preview": (bf16, False, True), "commit": (not bf16, True, False)}[kind]


def quantized(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n = values.numel()
    padded = torch.zeros(-(-n // BLOCK) * BLOCK)
    padded[:n] = values
    codes, absmax = quantize_blocks(padded, signed)
    return codes[:n].clone(), absmax


def make_state(n: int, master: str, moments: str, work_dtype: torch.dtype | None, seed: int,
               master_values: torch.Tensor | None = None, m: torch.Tensor | None = None,
               v: torch.Tensor | None = None) -> list[torch.Tensor | None]:
    """[master, comp, exp_avg, exp_avg_sq, m_absmax, v_absmax, work], of a training run's magnitudes
    unless given."""
    gen = torch.Generator().manual_seed(seed)
    p = master_values if master_values is not None else torch.randn(n, generator=gen) * 0.02
    m = m if m is not None else torch.randn(n, generator=gen) * 1e-4
    v = v if v is not None else (torch.randn(n, generator=gen) * 3e-4) ** 2
    comp = (torch.randn(n, generator=gen) * 1e-6).bfloat16() if master == "bf16-kahan" else None
    if master != "fp32":
        p = p.bfloat16()
    if moments == "int8":
        (m, m_absmax), (v, v_absmax) = quantized(m, signed=True), quantized(v, signed=False)
    else:
        m_absmax = v_absmax = None
    # garbage in the working copy, so that a pass that should not write it shows
    work = None if work_dtype is None else torch.randn(n, generator=gen).to(work_dtype)
    return [p, comp, m, v, m_absmax, v_absmax, work]


def grads(n: int, dtype: torch.dtype, seed: int, scale: float = 1e-3) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def run_both(kernel_state: list, ref_state: list, grad: torch.Tensor, args: tuple, seed: int, index_base: int,
             flags: tuple[bool, bool, bool]) -> None:
    k, r = kernel_state, ref_state
    KERNEL.adamw_compact(*k[:6], grad, k[6], args, seed, index_base, *flags)
    adamw_reference(*r[:6], grad, r[6], args, seed, index_base, *flags)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_bits(got: list, want: list, where: str, nan_alike: bool = False) -> None:
    """Every buffer's bits equal; with ``nan_alike`` a NaN matches any NaN (torch's bf16 NaN is
    0xFFFF from its vector path, 0x7FC0 from its scalar one, the kernel's the quieted input)."""
    for name, a, b in zip(NAMES, got, want):
        if a is None:
            continue
        differ = raw(a) != raw(b)
        if nan_alike and a.is_floating_point():
            differ &= ~(torch.isnan(a) & torch.isnan(b))
        if differ.any():
            i = int(differ.nonzero()[0])
            raise AssertionError(f"{where}: {name} differs from the reference in {int(differ.sum())} of {a.numel()} "
                                 f"elements, first at {i}: kernel {a[i].item()!r}, reference {b[i].item()!r}")


def grid():
    for master in MASTERS:
        for moments in ("fp32", "int8"):
            for grad_dtype in (torch.bfloat16, torch.float32):
                for work in (None, torch.float32, torch.bfloat16):
                    if work is None and master == "fp32":
                        continue  # an fp32 master is never the working copy
                    for kind in ("whole", "preview", "commit"):
                        yield pytest.param(master, moments, grad_dtype, work, kind,
                                           id=f"{master}-{moments}-grad_{DTYPE[grad_dtype]}-work_{DTYPE[work]}-{kind}")


@pytest.mark.parametrize("master, moments, grad_dtype, work_dtype, kind", grid())
def test_three_steps_match_the_reference_bit_for_bit(master, moments, grad_dtype, work_dtype, kind):
    kernel_state = make_state(N, master, moments, work_dtype, seed=1)
    ref_state = [None if t is None else t.clone() for t in kernel_state]
    for step in range(1, 4):
        grad = grads(N, grad_dtype, seed=10 + step)
        run_both(kernel_state, ref_state, grad, hyper(step + 10), step_seed(7, 3, step), 12_345,
                 writes(kind, master))
        assert_same_bits(kernel_state, ref_state, f"step {step}")


@pytest.mark.parametrize("master, work_dtype", [("fp32", torch.bfloat16), ("bf16-sr", torch.bfloat16),
                                                ("bf16-kahan", torch.float32)], ids=MASTERS)
@pytest.mark.parametrize("flags", [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)],
                         ids=lambda f: "writes_" + "".join(name if on else "-" for name, on in zip("MVW", f)))
def test_every_combination_of_writes_matches_the_reference(master, work_dtype, flags):
    """Those the split never makes too, such as a working copy from an unwritten bf16 master's p."""
    kernel_state = make_state(N, master, "int8", work_dtype, seed=12)
    ref_state = [None if t is None else t.clone() for t in kernel_state]
    run_both(kernel_state, ref_state, grads(N, torch.bfloat16, seed=13), hyper(3), 17, 4_096, flags)
    assert_same_bits(kernel_state, ref_state, f"writes {flags}")


@pytest.mark.parametrize("master, moments, grad_dtype, work_dtype", [
    ("bf16-sr", "int8", torch.bfloat16, torch.bfloat16),
    ("bf16-kahan", "int8", torch.float32, None),
    ("fp32", "fp32", torch.bfloat16, torch.bfloat16),
], ids=["bf16-sr-int8", "bf16-kahan-int8", "fp32-fp32"])
def test_a_pass_dealt_out_to_threads_matches_the_reference(monkeypatch, master, moments, grad_dtype, work_dtype):
    monkeypatch.setattr(KERNEL, "threads", 3)  # the default is one thread on a two-core machine
    kernel_state = make_state(BIG_N, master, moments, work_dtype, seed=2)
    ref_state = [None if t is None else t.clone() for t in kernel_state]
    for step in (1, 2):
        # an index base past 2^31: the noise's index arithmetic wraps in 32 bits
        run_both(kernel_state, ref_state, grads(BIG_N, grad_dtype, seed=20 + step), hyper(step), 99 + step,
                 3_000_000_000, (True, True, True))
        assert_same_bits(kernel_state, ref_state, f"step {step}")


@pytest.mark.parametrize("master", MASTERS)
def test_zero_blocks_quantize_to_zero_scales(master):
    n = BLOCK * 6 + 100
    zero = torch.zeros(n, dtype=torch.bool)
    zero[2 * BLOCK: 3 * BLOCK] = True  # a whole block
    zero[6 * BLOCK:] = True  # and the partial last one
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(n, generator=gen).mul_(1e-4).masked_fill_(zero, 0.0)
    v = torch.randn(n, generator=gen).mul_(3e-4).pow_(2).masked_fill_(zero, 0.0)
    kernel_state = make_state(n, master, "int8", torch.bfloat16, seed=4, m=m, v=v)
    ref_state = [None if t is None else t.clone() for t in kernel_state]
    for step in (1, 2):
        grad = grads(n, torch.bfloat16, seed=30 + step).masked_fill_(zero, 0.0)
        run_both(kernel_state, ref_state, grad, hyper(step), 5, 0, (True, True, True))
        assert_same_bits(kernel_state, ref_state, f"step {step}")
    for absmax in kernel_state[4:6]:
        assert absmax[2] == 0 and absmax[6] == 0 and (absmax[[0, 1, 3, 4, 5]] > 0).all(), "the zero blocks' scales"


def bits_to_f32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("moments", ["fp32", "int8"], ids=["fp32_moments", "int8_moments"])
def test_extreme_values_match_the_reference(master, moments):
    """Subnormal, huge and zero gradients and moments side by side in a block; masters at ±0, subnormal,
    near the largest float (stochastic rounding may carry into infinity), infinite and NaN."""
    n = BLOCK * 3 + 45
    gen = torch.Generator().manual_seed(5)
    magnitudes = torch.tensor([0.0, 1e-40, 1e-30, 1e-12, 1e-3, 1.0, 1e6, 1e12, 1e18])
    pick = torch.randint(0, len(magnitudes), (n,), generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    grad = magnitudes[pick] * sign * (1 + torch.rand(n, generator=gen))
    m = magnitudes[torch.randint(0, len(magnitudes), (n,), generator=gen)] * sign.roll(1)
    v = magnitudes[torch.randint(0, len(magnitudes), (n,), generator=gen)] ** 2 * 0.01  # up to 1e34, finite
    specials = bits_to_f32([0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
                            0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x3F808000, 0x3F818000])
    p = torch.randn(n, generator=gen) * 0.02
    p[: specials.numel()] = specials
    p[BLOCK: BLOCK + specials.numel()] = specials
    kernel_state = make_state(n, master, moments, torch.bfloat16, seed=6, master_values=p, m=m, v=v)
    ref_state = [None if t is None else t.clone() for t in kernel_state]
    for step in (1, 2):
        run_both(kernel_state, ref_state, grad, hyper(step, lr=1e-2, scale=1.0), 11, 1_000, (True, True, True))
        assert_same_bits(kernel_state, ref_state, f"step {step}", nan_alike=True)


@pytest.mark.parametrize("master, work_dtype", [
    ("fp32", torch.bfloat16), ("fp32", torch.float32), ("bf16-sr", None), ("bf16-sr", torch.bfloat16),
    ("bf16-kahan", None), ("bf16-kahan", torch.float32),
], ids=lambda value: DTYPE[value] if not isinstance(value, str) else value)
def test_preview_then_commit_equals_a_whole_pass(master, work_dtype):
    state = make_state(N, master, "int8", work_dtype, seed=7)
    whole = [None if t is None else t.clone() for t in state]
    grad, args, seed = grads(N, torch.bfloat16, seed=8), hyper(4), 1234
    KERNEL.adamw_compact(*whole[:6], grad, whole[6], args, seed, 777, *writes("whole", master))

    before = [None if t is None else t.clone() for t in state]
    KERNEL.adamw_compact(*state[:6], grad, state[6], args, seed, 777, *writes("preview", master))
    untouched = [2, 3, 4, 5] + ([0] if master == "fp32" else [])
    for i in untouched:
        assert torch.equal(raw(state[i]), raw(before[i])), f"the preview pass changed {NAMES[i]}"
    after_preview = [None if t is None else t.clone() for t in state]
    KERNEL.adamw_compact(*state[:6], grad, state[6], args, seed, 777, *writes("commit", master))
    for i in [6] + ([0, 1] if master != "fp32" else []):
        if state[i] is not None:
            assert torch.equal(raw(state[i]), raw(after_preview[i])), f"the commit pass changed {NAMES[i]}"
    assert_same_bits(state, whole, "preview + commit against whole")


def test_mismatched_buffers_are_refused():
    state = make_state(N, "bf16-kahan", "int8", torch.bfloat16, seed=9)
    grad, args = grads(N, torch.bfloat16, seed=9), hyper(1)
    with pytest.raises(ValueError, match="one length"):
        KERNEL.adamw_compact(*state[:6], grad[:-1], state[6], args, 0, 0, True, True, True)
    with pytest.raises(ValueError, match="absmax"):
        KERNEL.adamw_compact(*state[:5], state[5][:-1], grad, state[6], args, 0, 0, True, True, True)
    with pytest.raises(ValueError, match="Kahan"):
        KERNEL.adamw_compact(state[0].float(), *state[1:6], grad, state[6], args, 0, 0, True, True, True)
    with pytest.raises(ValueError, match="moments"):
        KERNEL.adamw_compact(state[0], state[1], state[2].float(), *state[3:6], grad, state[6], args, 0, 0, True,
                             True, True)
