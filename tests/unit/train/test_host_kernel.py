"""The host AdamW kernel (shared/train/host_adam.c) against torch.optim.AdamW's math, and its
preview/commit passes against a whole update, bit for bit.

Run: ``python -m pytest -q tests/unit/train/test_host_kernel.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.shared.train import host_kernel

BETAS, EPS = (0.9, 0.95), 1e-8


@pytest.fixture(scope="module")
def kernel() -> host_kernel.HostAdamKernel:
    loaded = host_kernel.load()
    if loaded is None:
        pytest.fail("the host AdamW kernel did not build (is a C compiler installed?)")
    return loaded


def hyper(step: int, lr: float, wd: float, scale: float) -> tuple[float, ...]:
    b1, b2 = BETAS
    return (scale, 1 - lr * wd, 1 - b1, b2, 1 - b2, EPS, lr / (1 - b1**step), math.sqrt(1 - b2**step))


def state(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_three_steps_match_torch_adamw(kernel, grad_dtype, wd):
    n, lr, scale = 10_007, 1e-3, 0.7  # odd length: every thread's range and the tail
    master, m, v = state(n, 0)
    ref = master.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    work = torch.empty(n, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
        ref.grad = grad.float() * scale
        opt.step()
        kernel.adamw(master, m, v, grad, work, hyper(step, lr, wd, scale), write_state=True, write_work=True)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    assert torch.equal(work, master.bfloat16()), "the bf16 working copy is not the rounded master"


@pytest.mark.parametrize("work_dtype", [torch.float32, torch.bfloat16])
def test_preview_then_commit_equals_a_whole_update(kernel, work_dtype):
    n = 4099
    master, m, v = state(n, 2)
    m.normal_(0, 1e-3)
    v.uniform_(0, 1e-6)
    grad = torch.randn(n) * 1e-2
    args = hyper(7, 3e-4, 0.1, 0.5)
    whole = [t.clone() for t in (master, m, v)] + [torch.empty(n, dtype=work_dtype)]
    kernel.adamw(*whole[:3], grad, whole[3], args, write_state=True, write_work=True)

    before = [t.clone() for t in (master, m, v)]
    preview = torch.empty(n, dtype=work_dtype)
    kernel.adamw(master, m, v, grad, preview, args, write_state=False, write_work=True)
    assert all(torch.equal(a, b) for a, b in zip((master, m, v), before)), "preview changed the state"
    untouched = torch.full((n,), 3.0, dtype=work_dtype)
    kernel.adamw(master, m, v, grad, untouched, args, write_state=True, write_work=False)
    assert torch.equal(untouched, torch.full((n,), 3.0, dtype=work_dtype)), "commit wrote the working copy"
    for got, want, name in zip((master, m, v, preview), whole, ("master", "exp_avg", "exp_avg_sq", "work")):
        assert torch.equal(got.view(torch.int32 if got.dtype == torch.float32 else torch.int16),
                           want.view(torch.int32 if want.dtype == torch.float32 else torch.int16)), name


def test_bf16_rounding_matches_torch_on_ties_and_specials(kernel):
    """The working copy is rounded to nearest even like ``Tensor.bfloat16``, NaN stays NaN."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x7F800000, 0xFF800000,
                         0x7FC00000, 0x7F800001, 0x80000000], dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    n = values.numel()
    master, m, v = values.clone(), torch.zeros(n), torch.zeros(n)
    work = torch.empty(n, dtype=torch.bfloat16)
    # lr 0 and no decay: the "update" leaves the master as it is, so work = bf16(master)
    kernel.adamw(master, m, v, torch.zeros(n), work, (1.0, 1.0, 0.1, 0.95, 0.05, EPS, 0.0, 1.0),
                 write_state=False, write_work=True)
    want = values.bfloat16()
    finite = ~torch.isnan(want)
    assert torch.equal(work[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.isnan(work[~finite]).all()


def test_mismatched_lengths_are_refused(kernel):
    master, m, v = state(8, 0)
    with pytest.raises(ValueError, match="one length"):
        kernel.adamw(master, m, v, torch.zeros(7), torch.empty(8), hyper(1, 1e-3, 0.0, 1.0), True, True)


@pytest.mark.parametrize("threads", [2, 5, 16])
def test_a_pass_dealt_out_in_chunks_gives_the_bits_of_one_thread(kernel, monkeypatch, threads):
    n = 3 * 65536 + 12_345  # several of the kernel's pieces and a partial one; more threads than pieces at 16
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-2).bfloat16()
    results = {}
    for count in (1, threads):
        monkeypatch.setattr(kernel, "threads", count)
        master, m, v = state(n, 4)
        work = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2):
            kernel.adamw(master, m, v, grad, work, hyper(step, 1e-3, 0.1, 0.5), write_state=True, write_work=True)
        results[count] = (master, m, v, work)
    for name, one, many in zip(("master", "exp_avg", "exp_avg_sq", "work"), results[1], results[threads]):
        assert torch.equal(one, many), f"{name} differs between 1 and {threads} threads"
    ref = state(n, 4)[0].requires_grad_(True)  # and every piece was updated, the partial one included
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=BETAS, eps=EPS, weight_decay=0.1)
    for _ in (1, 2):
        ref.grad = grad.float() * 0.5
        opt.step()
    torch.testing.assert_close(results[threads][0], ref.detach(), rtol=1e-6, atol=1e-7)
