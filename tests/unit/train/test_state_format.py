"""The host state's compact formats (shared/train/state_format.py): what each stores and costs, and
each one's parity bound against fp32 AdamW.

- The codes: an 8-bit moment decodes within the bound its power-law code allows (derived below),
  and stochastic rounding to bf16 is unbiased.
- The bytes: the memory plan counts exactly what a host state of each format allocates.
- Parity: the tiny model trained 40 steps on the same data and schedule with each format ends within
  1 % of fp32 AdamW's final loss (mean of the last 10 steps), its curve (smoothed over 10 steps) never
  further than 2 % away. Over 200 steps one run is not a fair judge: a compact format's run parts
  ways with fp32's (bf16 and 8-bit rounding perturb every step), and its final loss lands up to 3 %
  above or below fp32's depending on the seed; ``benchmarks/train_state_format.py`` prints the
  200-step curves and the mean over seeds.
- Resume: a compact state resumes bit for bit; a resume in another format is refused in one line;
  compact formats refuse GPU-updated layers in one line.

Run: ``python -m pytest -q tests/unit/train/test_state_format.py`` (``-m slow``: every format's parity).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from safetensors.torch import load_file

from tandem.shared.model.config import ModelConfig
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.training import TrainJob
from tandem.shared.train.host_state import HostState
from tandem.shared.train.loop import TrainLoop, plan_job
from tandem.shared.train.plan import MASTERS_AND_MOMENTS, Placement, memory_plan
from tandem.shared.train.state_format import (
    BLOCK,
    StateFormat,
    bf16_stochastic,
    dequantize_blocks,
    quantize_blocks,
    rounding_noise,
)

COMPACT = [("bf16-sr", "int8"), ("bf16-kahan", "int8"), ("fp32", "int8"), ("bf16-sr", "fp32")]
FORMAT_IDS = ["-".join(f) for f in COMPACT]
UNTIED = ModelConfig.tiny().replace(num_layers=3, tie_word_embeddings=False, attention_bias=True)


@pytest.mark.parametrize("signed,levels,power", [(True, 127, 2), (False, 255, 4)], ids=["first-moment",
                                                                                       "second-moment"])
def test_an_8_bit_moment_decodes_within_its_code_bound(signed, levels, power):
    """A value x ≥ f·absmax sits where the code's steps are (absmax/levels^p)·((c+½)^p − c^p) apart,
    c = levels·f^(1/p): rounding to the nearest code is off by at most p/(2·levels·f^(1/p)) of x (to first order)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(BLOCK * 64, generator=gen) * torch.logspace(-6, 0, BLOCK * 64).flip(0)
    values = values if signed else values.abs() ** 2
    codes, absmax = quantize_blocks(values, signed=signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8) and absmax.numel() == 64
    decoded = dequantize_blocks(codes, absmax, signed=signed)
    floor = 1e-2 if signed else 1e-4
    scale = absmax.repeat_interleave(BLOCK)
    kept = values.abs() >= floor * scale
    relative = ((decoded - values).abs() / values.abs())[kept]
    bound = power / (2 * levels * floor ** (1 / power)) * 1.05
    assert kept.sum() > 1000 and relative.max() <= bound, f"max relative error {relative.max():.4f} > {bound:.4f}"
    assert torch.equal(torch.sign(decoded[kept]), torch.sign(values[kept])), "a decoded moment changed sign"


def test_a_zero_block_stays_zero():
    codes, absmax = quantize_blocks(torch.zeros(BLOCK), signed=False)
    assert absmax.item() == 0 and not dequantize_blocks(codes, absmax, signed=False).any()


def test_stochastic_rounding_to_bf16_is_unbiased():
    x = torch.full((4096,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bf16 (1 + 2^-7)
    draws = torch.stack([bf16_stochastic(x, rounding_noise(seed, 0, x.numel())).float() for seed in range(64)])
    assert set(draws.unique().tolist()) == {1.0, 1.0 + 2**-7}, "stochastic rounding left the two neighbours"
    ups = (draws > 1.0).double().mean().item()
    sigma = (0.125 * 0.875 / draws.numel()) ** 0.5
    assert abs(ups - 0.125) < 5 * sigma, f"rounded up {ups:.4f} of the time, expected 0.125"
    inf = bf16_stochastic(torch.tensor([float("inf"), float("nan")]), torch.tensor([0xFFFF, 0xFFFF]))
    assert inf[0].item() == float("inf") and inf[1].isnan()


@pytest.mark.parametrize("fmt", COMPACT + [("fp32", "fp32")], ids=FORMAT_IDS + ["fp32"])
@pytest.mark.parametrize("work_dtype", [torch.float32, torch.bfloat16], ids=["fp32-work", "bf16-work"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_the_plan_counts_what_each_format_allocates(fmt, work_dtype, split):
    state_format = StateFormat(*fmt)
    state = HostState(UNTIED, work_dtype, pin=False, fmt=state_format)
    if split:
        state.add_grad_spares()
    plan = memory_plan(UNTIED, work_dtype, 2, 24, Placement(), device="cpu", split=split, state_format=state_format)
    counted = plan.host[MASTERS_AND_MOMENTS] + plan.host["working copies"] + plan.host["gradient buffers"]
    assert state.nbytes() == counted, f"allocated {state.nbytes()} bytes, the plan counts {counted}"
    shared = state_format.master_shares_work(work_dtype)
    assert all((u.work is u.master) == shared for u in state.units)


def test_bytes_a_parameter_of_the_smallest_format():
    """bf16 masters that are the working copy, int8 moments, one bf16 gradient buffer: 6 bytes a
    parameter and the block scales (the issue's bound is 10)."""
    cfg = ModelConfig.tiny()
    state = HostState(cfg, torch.bfloat16, pin=False, fmt=StateFormat("bf16-sr", "int8"))
    params = sum(u.layout.numel for u in state.units)
    assert 6.0 < state.nbytes() / params < 6.1


def train_job(tmp_path, name: str, fmt: tuple[str, str], **extra) -> TrainJob:  # noqa: ANN001
    fields = dict(model="tiny", dataset="stdlib", steps=6, batch_size=2, seq_len=48, lr=2e-3, warmup_steps=2,
                  output_dir=str(tmp_path / name), device="cpu", master_weights=fmt[0], adam_moments=fmt[1])
    return TrainJob(**(fields | extra))


def losses_of(job: TrainJob, tmp_path) -> list[float]:  # noqa: ANN001
    losses: list[float] = []
    TrainLoop(job, job.output_dir.rsplit("/", 1)[-1], tmp_path).run(on_step=lambda m: losses.append(m.loss),
                                                                     final_checkpoint=False)
    return losses


def curves_agree(losses: list[float], baseline: list[float], final_bound: float, curve_bound: float) -> None:
    final, base = statistics.fmean(losses[-10:]), statistics.fmean(baseline[-10:])
    assert abs(final / base - 1) <= final_bound, f"final loss {final:.4f} vs fp32 AdamW's {base:.4f}"
    smooth = [statistics.fmean(losses[max(0, i - 9): i + 1]) for i in range(len(losses))]
    smooth_base = [statistics.fmean(baseline[max(0, i - 9): i + 1]) for i in range(len(baseline))]
    gap = max(abs(a - b) / b for a, b in zip(smooth, smooth_base))
    assert gap <= curve_bound, f"the smoothed curves part by {gap:.2%}"


@pytest.fixture(scope="module")
def fp32_curve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp32-curve")
    return losses_of(train_job(tmp, "fp32", ("fp32", "fp32"), steps=40, batch_size=4, seq_len=64, lr=3e-3,
                               warmup_steps=5), tmp)


# the smallest format in the default run; the others (about 4 s each on 2 cores) in the slow one
@pytest.mark.parametrize("fmt", [COMPACT[0]] + [pytest.param(f, marks=pytest.mark.slow) for f in COMPACT[1:]],
                         ids=FORMAT_IDS)
def test_each_format_tracks_fp32_adamw(tmp_path, fp32_curve, fmt):
    losses = losses_of(train_job(tmp_path, "c", fmt, steps=40, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=5),
                       tmp_path)
    assert losses != fp32_curve, "a compact format gave fp32's losses exactly: was it used?"
    curves_agree(losses, fp32_curve, final_bound=0.01, curve_bound=0.02)


@pytest.mark.parametrize("fmt,split", [(("bf16-sr", "int8"), False), (("bf16-kahan", "int8"), True),
                                       pytest.param(("fp32", "int8"), True, marks=pytest.mark.slow)],
                         ids=["bf16-sr-int8", "bf16-kahan-int8-split", "fp32-int8-split"])
def test_a_compact_state_resumes_bit_exactly(tmp_path, fmt, split):
    unbroken: list[float] = []
    TrainLoop(train_job(tmp_path, "a", fmt, split_update=split), "a", tmp_path).run(
        on_step=lambda m: unbroken.append(m.loss))
    broken: list[float] = []
    first = TrainLoop(train_job(tmp_path, "b", fmt, split_update=split), "b", tmp_path).run(
        on_step=lambda m: broken.append(m.loss), should_stop=lambda: len(broken) >= 3)
    assert first.state == "stopped"
    resumed = TrainLoop(train_job(tmp_path, "b", fmt, split_update=split, resume=True), "b", tmp_path)
    assert resumed.start_step == 3 and resumed.state.format == StateFormat(*fmt)
    resumed.run(on_step=lambda m: broken.append(m.loss))
    assert broken == unbroken, "a resumed run must see the same losses as an unbroken one"
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert a.keys() == b.keys(), name
        assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("rng")), f"{name} differs after a resume"
    weights = load_file(tmp_path / "a" / "model.safetensors")
    want = torch.bfloat16 if fmt[0] != "fp32" else torch.float32
    assert {t.dtype for t in weights.values()} == {want}
    served = load_model(str(tmp_path / "a"))  # the checkpoint serves as it is
    assert served.config.hidden_size == ModelConfig.tiny().hidden_size


def test_a_resume_in_another_format_is_refused_in_one_line(tmp_path):
    TrainLoop(train_job(tmp_path, "a", ("bf16-sr", "int8"), steps=2), "a", tmp_path).run()
    with pytest.raises(Exception) as caught:
        TrainLoop(train_job(tmp_path, "a", ("fp32", "fp32"), steps=4, resume=True), "a", tmp_path)
    message = str(caught.value)
    assert "--master-weights bf16-sr --adam-moments int8" in message and "\n" not in message, message


def test_compact_formats_refuse_gpu_updated_layers(tmp_path):
    job = train_job(tmp_path, "a", ("bf16-sr", "int8"), device_update_layers=2)
    with pytest.raises(ProtocolError) as caught:
        plan_job(job, tmp_path / "a", None, 16384)
    assert "--device-update-layers" in str(caught.value) and "\n" not in str(caught.value)
