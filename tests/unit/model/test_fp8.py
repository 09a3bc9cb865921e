"""FP8 weights (``--quantization fp8``, shared/model/fp8.py) on CPU: the reference path's arithmetic,
the loader and the engine on it, the setting's refusals, and the memory the quantized linears take.

The CUDA path (``torch._scaled_mm``, per-token activation scales) is tests/gpu/test_fp8_gpu.py; the
bars there were set from :func:`~tandem.shared.model.fp8.emulate_scaled_mm` runs on this CPU.

Run: ``python -m pytest -q tests/unit/model/test_fp8.py``.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from factories import engine_config, make_engine, make_request, record_logits, run
from pydantic import ValidationError
from support import PARITY_LENGTHS, prompt_of

from tandem.cli.flags import settings_from, settings_problem
from tandem.cli.main import parser
from tandem.shared.infra.config import ENV_PREFIX, Settings
from tandem.shared.model import fp8_few_rows
from tandem.shared.model.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    Fp8Linear,
    QuantizationError,
    ScaledMMPlan,
    dequantize_weight,
    emulate_scaled_mm,
    probe_plan,
    quantize_model,
    quantize_rows,
    quantize_weight,
    scaled_mm_plan,
    weight_bytes,
)
from tandem.shared.model.loader import load_model
from tandem.shared.model.reference import reference_generate, reference_logits

# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most half a step, 2^-4 of a normal
# value; below 2^-6 (subnormal codes) the step is 2^-9 of the scale, so half of it is 2^-10.
REL_STEP, SUBNORMAL_HALF_STEP = 2.0**-4, 2.0**-10

NEW_TOKENS = 32
# Measured on the shipped tiny checkpoint in float32, 20 prompts (PARITY_LENGTHS) x 32 greedy steps,
# fp8 reference path against the float model: teacher-forced top-1 agreement 634/640 (99.1%), the
# largest |logit diff| 1.6% of the row's largest |logit| (1.2% at first steps), 16 of 20 prompts
# token-exact through 32 tokens, the other four diverging where the float model's top-2 logits are
# within 0.04 of each other (rows' largest logits 6 to 8). The bars keep a margin over that.
MIN_TOP1_AGREEMENT = 0.98
LOGIT_RTOL = 0.03
MIN_EXACT_PROMPTS = 14


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def tiny_fp8():
    """The shipped tiny model loaded with fp8 weights (its own copy: the session's ``tiny`` is read-only)."""
    return load_model("tiny", device="cpu", dtype=torch.float32, quantization="fp8")


def channel_weights(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (a per-tensor scale would crush the small ones), one zero row."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn((rows, cols), generator=generator) * torch.logspace(-3, 1, rows)[:, None]
    w[5] = 0.0
    return w


def test_weight_round_trip_error_is_bounded_per_channel() -> None:
    w = channel_weights()
    codes, scale = quantize_weight(w)
    assert codes.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    back = dequantize_weight(codes, scale, torch.float32)
    error = (back - w).abs()
    # Every element: half an e4m3 step of itself, or of the subnormal step under the scale.
    bound = REL_STEP * w.abs() + SUBNORMAL_HALF_STEP * scale[:, None]
    assert bool((error <= bound * (1 + 1e-6)).all()), f"worst excess {(error - bound).max():.3g}"
    # Per channel: each row's largest value maps to 448 exactly, and no element is off by more than
    # half the step next to 448 (16 of 448: 1/28 of the row's max |w|).
    amax = w.abs().amax(dim=1)
    live = amax > 0
    assert torch.equal(codes.float().abs().amax(dim=1)[live], torch.full((int(live.sum()),), FP8_MAX))
    assert bool((error.amax(dim=1)[live] <= amax[live] / 28 * (1 + 1e-6)).all())
    # A zero channel: zero codes, the floor scale, exactly zero back.
    assert scale[5] == MIN_SCALE and not codes[5].float().any() and not back[5].any()


def test_activation_rows_are_quantized_per_token_and_padded_with_zeros() -> None:
    x = channel_weights(rows=7, cols=64, seed=1)  # row 5 is zero: a token of zeros quantizes to zeros
    codes, scale = quantize_rows(x, padded_rows=16)
    assert codes.shape == (16, 64) and scale.shape == (16, 1)
    back = codes.float() * scale
    bound = REL_STEP * x.abs() + SUBNORMAL_HALF_STEP * scale[:7]
    assert bool(((back[:7] - x).abs() <= bound * (1 + 1e-6)).all())
    assert not back[5].any() and not back[7:].any() and bool((scale[7:] == MIN_SCALE).all())


def test_reference_linear_matches_f_linear_in_float32() -> None:
    w = channel_weights(rows=64, cols=256, seed=2)
    bias = torch.randn(64)
    x = torch.randn((2, 7, 256), generator=torch.Generator().manual_seed(3))
    layer = Fp8Linear(*quantize_weight(w), bias.clone())
    got = layer(x)
    want = F.linear(x, w, bias)
    assert got.shape == want.shape == (2, 7, 64)
    # A hard bound: each output is off by at most sum_k |x_k| * (element bound of w_k).
    _, scale = quantize_weight(w)
    element_bound = REL_STEP * w.abs() + SUBNORMAL_HALF_STEP * scale[:, None]
    bound = x.abs() @ element_bound.t()
    assert bool(((got - want).abs() <= bound * (1 + 1e-5) + 1e-6).all())
    # What it is in practice, per output channel (rows differ in size by 10^4; channel 5 is zero and
    # exact): the error's RMS over the channel's RMS, measured 2.6% on average and 4.3% at worst for
    # these weights and inputs (rounding errors partly cancel in the sum).
    live = torch.arange(64) != 5
    relative = ((got - want).pow(2).mean(dim=(0, 1)).sqrt() / (want - bias).pow(2).mean(dim=(0, 1)).sqrt())[live]
    assert relative.mean() < 0.035 and relative.max() < 0.06, relative
    assert torch.equal(got[..., 5], want[..., 5])
    # The same codes through the emulation of the CUDA path differ only by the activations' rounding.
    emulated = emulate_scaled_mm(x.reshape(-1, 256), layer.weight, layer.weight_scale) + bias
    assert (emulated - got.reshape(-1, 64)).abs().max() <= 2 * bound.max()


def cpu_scaled_mm_works() -> bool:
    """torch 2.13's CPU build runs row-wise ``_scaled_mm`` too: the CUDA path's call can be checked here."""
    codes = torch.zeros((16, 16), dtype=FP8_DTYPE)
    try:
        torch._scaled_mm(codes, codes.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not cpu_scaled_mm_works(), reason="this torch has no CPU _scaled_mm")
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_scaled_mm_call_matches_its_emulation(rows: int, dtype: torch.dtype) -> None:
    """The CUDA path's exact call (operand layouts, scale shapes, rows padded to 16 and cut back, bias
    added after, output cast to the activation dtype), run by torch's CPU kernel."""
    w = channel_weights(rows=48, cols=64, seed=rows)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4)).to(dtype)
    layer = Fp8Linear(*quantize_weight(w), bias)
    layer.plan = ScaledMMPlan(quantize_rows, torch.bfloat16, "CPU check")
    x = (torch.randn((rows, 64), generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    got = layer._forward_scaled_mm(x)
    assert got.shape == (rows, 48) and got.dtype == dtype
    want = emulate_scaled_mm(x, layer.weight, layer.weight_scale) + bias.float()
    row_max = want.abs().amax(dim=1, keepdim=True)
    assert bool(((got.float() - want).abs() <= 2**-7 * want.abs() + 2**-10 * row_max).all())
    assert layer(x).dtype == dtype  # a CPU tensor still takes the reference path in forward
    probe_plan(layer.plan, torch.device("cpu"), dtype)  # the load-time probe passes on a correct plan


def test_the_probe_refuses_a_plan_that_scales_the_wrong_axis() -> None:
    if not cpu_scaled_mm_works():
        pytest.skip("this torch has no CPU _scaled_mm")

    def transposed_scales(x: torch.Tensor, padded_rows: int | None = None):
        codes, scale = quantize_rows(x, padded_rows)
        return codes, scale.flip(0).contiguous()  # each row scaled by another row's scale

    with pytest.raises(RuntimeError, match="differ|off by"):
        probe_plan(ScaledMMPlan(transposed_scales, torch.bfloat16, "broken"), torch.device("cpu"), torch.bfloat16)


def test_model_quantization_covers_every_decoder_linear_and_nothing_else(tiny_fp8) -> None:
    model = tiny_fp8.model
    assert model.quantization == tiny_fp8.quantization == "fp8"
    assert tiny_fp8.weights_id.endswith("+fp8"), "fp8 KV must not share a namespace with the float model's"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"):
            assert isinstance(getattr(attn, name), Fp8Linear), name
        for name in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
            assert isinstance(getattr(mlp, name), Fp8Linear), name
        # The parts are row views of the fused codes: one copy, and a load into a part writes through.
        assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_proj.weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight_scale.untyped_storage().data_ptr() == \
            mlp.gate_up_proj.weight_scale.untyped_storage().data_ptr()
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    assert not any(isinstance(m, torch.nn.Linear) for layer in model.model.layers for m in layer.modules())
    plan, reason = scaled_mm_plan(torch.device("cpu"), torch.float32)
    assert plan is None and "CUDA" in reason
    assert quantize_model(model).linears == 0, "a second quantization finds nothing left to do"


def test_tiny_model_greedy_keeps_the_float_models_tokens(tiny) -> None:
    """The float tiny model's engine against an engine whose config quantizes its own copy (the
    runner does it): greedy tokens, and teacher-forced top-1 and logits (both models fed the float
    model's tokens, so every step compares, not only those before a divergence)."""
    config = engine_config(max_seqs=len(PARITY_LENGTHS), budget=4096, num_blocks=256, max_model_len=512)
    float_engine = make_engine(tiny, config)
    fp8_engine = make_engine(load_model("tiny", device="cpu", dtype=torch.float32), config, quantization="fp8")
    assert fp8_engine.runner.model.quantization == "fp8"
    float_logits = record_logits(float_engine)
    prompts = [tiny.tokenizer.encode(prompt_of(n, salt=i)) for i, n in enumerate(PARITY_LENGTHS)]
    requests = [make_request(f"p{i}", prompt, NEW_TOKENS) for i, prompt in enumerate(prompts)]
    want, got = run(float_engine, requests), run(fp8_engine, requests)
    agree, worst, exact, divergences = 0, 0.0, 0, []
    for i, prompt in enumerate(prompts):
        a_tokens, b_tokens = want[f"p{i}"].tokens, got[f"p{i}"].tokens
        split = next((j for j, (a, b) in enumerate(zip(a_tokens, b_tokens)) if a != b), None)
        if split is None:
            exact += 1
        else:
            row = float_logits[(f"p{i}", split)].float()
            top2 = row.topk(2).values
            divergences.append((len(prompt), round((top2[0] - top2[1]).item(), 4), round(row.abs().max().item(), 2)))
        ids = prompt + a_tokens
        rows = slice(len(prompt) - 1, len(ids) - 1)
        a, b = reference_logits(tiny.model, ids)[rows], reference_logits(fp8_engine.runner.model, ids)[rows]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        worst = max(worst, ((a - b).abs().amax(-1) / a.abs().amax(-1)).max().item())
    top1 = agree / (len(prompts) * NEW_TOKENS)
    print(f"\nfp8 vs float32 tiny: top-1 {top1:.4f}, worst logit diff {worst:.4f} of the row max, {exact}/"
          f"{len(prompts)} token-exact, divergences (prompt, top-2 margin, row max): {divergences}")
    assert top1 >= MIN_TOP1_AGREEMENT
    assert worst <= LOGIT_RTOL
    assert exact >= MIN_EXACT_PROMPTS
    for n, margin, row_max in divergences:  # only where fp8's disturbance can reorder the top two
        assert margin <= 2 * LOGIT_RTOL * row_max, f"prompt {n} diverged at a top-2 margin of {margin:.3f}"


def test_the_engine_serves_the_quantized_weights_as_the_reference_computes_them(tiny_fp8) -> None:
    """The paged engine on fp8 weights gives the contiguous-KV reference's greedy tokens on the same weights."""
    engine = make_engine(tiny_fp8, quantization="fp8")  # already quantized: the runner leaves it
    prompts = [tiny_fp8.tokenizer.encode(prompt_of(n, salt=i)) for i, n in enumerate((5, 33))]
    results = run(engine, [make_request(f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].tokens == reference_generate(tiny_fp8.model, prompt, 8)[0], f"prompt {i}"


def linear_bytes(model) -> int:
    """Distinct storages under the decoder layers' linear weights (and their fp8 scales)."""
    tensors = [t for layer in model.model.layers for name, t in layer.state_dict(keep_vars=True).items()
               if name.endswith(("proj.weight", "proj.weight_scale"))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_quantized_linears_take_about_half_the_memory_of_bf16() -> None:
    model = load_model("tiny-random", device="cpu", dtype=torch.bfloat16).model
    model.fuse_projections()
    fused = weakref.ref(model.model.layers[0].mlp.gate_up_proj.weight)
    part = weakref.ref(model.model.layers[0].self_attn.q_proj.weight)
    before, total_before = linear_bytes(model), weight_bytes(model)
    report = quantize_model(model)
    gc.collect()
    assert fused() is None and part() is None, "the bf16 weights (fused and their views) must be freed"
    after = linear_bytes(model)
    # Codes at 1 byte against bf16's 2, plus one float32 scale per output channel: 0.5 + 2/K, K = 256 or 704.
    assert 0.5 < after / before < 0.52, (before, after)
    assert (report.bytes_before, report.bytes_after) == (before, after)
    assert report.linears == 4 * len(model.model.layers)
    # Nothing else changed size: the tied embedding / LM head table stays bf16, and so do the norms.
    assert weight_bytes(model) == total_before - before + after
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_float_state_dict_loads_into_the_quantized_model(tiny, tiny_fp8) -> None:
    """A hot reload hands the served model a float checkpoint's state (unfused names): each part
    quantizes on the way in and writes through to the fused codes."""
    model = load_model("tiny", device="cpu", dtype=torch.float32, quantization="fp8").model
    state = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    attn = model.model.layers[1].self_attn
    k_rows = slice(attn.q_proj.out_features, attn.q_proj.out_features + attn.k_proj.out_features)
    state["model.layers.1.self_attn.k_proj.weight"].mul_(0.5)
    model.load_state_dict(state, strict=False)
    codes, scale = quantize_weight(tiny.model.model.layers[1].self_attn.k_proj.weight * 0.5)
    assert torch.equal(attn.qkv_proj.weight[k_rows].float(), codes.float())
    assert torch.equal(attn.qkv_proj.weight_scale[k_rows], scale)
    assert attn.qkv_proj.weight.dtype == FP8_DTYPE
    # The other layers are what they were.
    for (name, a), b in zip(tiny_fp8.model.state_dict().items(), model.state_dict().values()):
        if "layers.1.self_attn" not in name:
            assert torch.equal(a.float(), b.float()), name


def test_a_model_wide_cast_moves_but_never_retypes_the_codes(tiny_fp8) -> None:
    model = load_model("tiny", device="cpu", dtype=torch.float32, quantization="fp8").model
    layer = model.model.layers[0].mlp.down_proj
    codes, scale = layer.weight.clone(), layer.weight_scale.clone()
    model.to(torch.bfloat16)
    assert layer.weight.dtype == FP8_DTYPE and torch.equal(layer.weight.float(), codes.float())
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)
    assert model.lm_head.weight.dtype == torch.bfloat16
    out = model.model.layers[0].mlp(torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_invalid_settings_are_refused_in_one_line(monkeypatch) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(quantization="fp8", dtype="float64")
    for given, named in ((("quantization",), "--quantization fp8"), ((), "TANDEM_QUANTIZATION 'fp8'")):
        message = settings_problem(refused.value, given)  # from a flag, else from its variable
        assert "\n" not in message and named in message, message
        assert "change --dtype" in message and "--quantization none" in message
    with pytest.raises(ValidationError, match="'none' or 'fp8'"):
        Settings(quantization="int4")
    # The flag and the variable come from the field.
    p = parser()
    assert settings_from(p.parse_args(["serve", "decode", "--quantization", "fp8"])).engine.quantization == "fp8"
    with pytest.raises(SystemExit, match="change --dtype"):
        settings_from(p.parse_args(["serve", "decode", "--quantization", "fp8", "--dtype", "float64"]))
    monkeypatch.setenv("TANDEM_QUANTIZATION", "fp8")
    assert Settings().engine.quantization == "fp8"
    assert settings_from(p.parse_args(["up"])).engine.quantization == "fp8"


def test_the_loader_refuses_what_fp8_cannot_compute_in() -> None:
    with pytest.raises(QuantizationError, match="change --dtype"):
        load_model("tiny-random", dtype=torch.float64, quantization="fp8")
    with pytest.raises(QuantizationError, match="unknown quantization 'int4'"):
        load_model("tiny-random", quantization="int4")
    with pytest.raises(ValueError, match="unknown quantization"):  # QuantizationError is a ModelLoadError
        quantize_model(load_model("tiny-random").model, "int8")


def test_the_benchmarks_fp8_floor_reads_the_decoder_weights_at_one_byte() -> None:
    """benchmarks/serving_gpu.py's fp8 part: the 8B preset's batch-1 step floor with fp8 linears
    reads half the matmul bytes (the LM head stays bf16), at the H200's rates in ../shared/DESIGN.md."""
    import importlib.util
    from pathlib import Path

    from tandem.shared.model.meta import load_model_meta

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "serving_gpu.py"
    spec = importlib.util.spec_from_file_location("serving_gpu_fp8", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = load_model_meta("random:llama3-8b").config
    bf16 = bench.step_floor(cfg, 1, 576, 4229.0, 782.0)
    fp8 = bench.step_floor(cfg, 1, 576, 4229.0, 782.0, linear_bytes=1)
    assert fp8["matmuls"]["hbm_ms"] == pytest.approx(bf16["matmuls"]["hbm_ms"] / 2, abs=2e-3)
    assert fp8["lm_head"] == bf16["lm_head"] and fp8["matmuls"]["bound"] == "hbm"
    assert fp8["floor_ms"] == pytest.approx(1.91, abs=0.02) and bf16["floor_ms"] == pytest.approx(3.56, abs=0.02)


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096), (512, 704), (768, 256), (48, 80)])
def test_every_scaled_mm_shape_has_a_few_row_tile(n: int, k: int) -> None:
    """Any shape _scaled_mm takes (N and K multiples of 16) has a tile the few-row kernel can run;
    wide tiles only where they divide the shape (the kernel has no masks on the codes)."""
    for rows in fp8_few_rows.ROW_BUCKETS:
        assert any(t.fits(n, k, rows) for t in fp8_few_rows.CANDIDATES), f"no tile for {rows} rows of [{n}, {k}]"
    tiles = [t for t in fp8_few_rows.CANDIDATES if t.fits(n, k)]
    assert all(n % t.block_n == 0 and k % t.block_k == 0 for t in tiles)
    assert (max(t.block_k for t in tiles) >= 256) == (k % 256 == 0), "wide K tiles must be taken wherever they fit"


def test_the_few_row_kernel_is_never_taken_off_cuda() -> None:
    x = torch.randn(1, 256)
    codes, _ = quantize_weight(torch.randn(768, 256))
    assert not fp8_few_rows.supports(x, codes), "the CPU takes the dequantize reference"
