"""LoRA fine-tuning (``tandem train --lora-rank``): the trainer's adapter against PEFT + torch's AdamW,
its output in PEFT's format, bit-exact resumes, what it keeps in memory, and its refusals.

The reference is ``peft.get_peft_model`` on transformers' model of a small random Hugging Face
directory, started from the trainer's initial adapter and trained by ``torch.optim.AdamW`` after
``clip_grad_norm_`` on the very batches of the run (tests/lora_train_support.py); the trainer runs
the job as ``tandem train`` does (``TrainLoop``: the frozen base, the streamed step with its chunked
MLP, the device-side AdamW, the checkpoint it writes), on CPU in fp32.
Run: ``python -m pytest -q tests/unit/train/test_lora_training.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lora_train_support import peft_adapter, peft_key, peft_model, peft_optimizer, peft_step
from model_support import make_hf_checkpoint
from safetensors.torch import load_file
from train_support import LR, WD, batches, finetune_records, write_jsonl

from tandem.cli.main import main
from tandem.shared.lora.peft_format import load_adapter, read_adapter_config
from tandem.shared.model.config import ModelConfig
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.training import TrainJob
from tandem.shared.train import functional as fn
from tandem.shared.train.frozen_base import FrozenBase
from tandem.shared.train.host_state import HostState
from tandem.shared.train.layout import head_weight_name, layer_layout
from tandem.shared.train.loop import TrainLoop
from tandem.shared.train.lora import AdapterAdamW, TrainedAdapter, adapter_numel, group_of, lora_config
from tandem.shared.train.lora_step import LoraStep
from tandem.shared.train.optimizer import BETAS, EPS, lr_schedule
from tandem.shared.train.plan import MASTERS_AND_MOMENTS, GiB, Placement, choose_lora_resident, memory_plan
from tandem.shared.train.presets import preset_config

STEPS = 5
CLIP = 0.1  # below every step's gradient norm in the parity runs: clipping always acts
CPU = torch.device("cpu")
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


def lora_job(tmp_path, name: str, **extra) -> TrainJob:  # noqa: ANN001
    """A short LoRA job on the tiny model; its text is this file (the stdlib takes seconds to read)."""
    fields = dict(model="tiny", dataset=__file__, steps=6, batch_size=2, seq_len=48, lr=2e-3, warmup_steps=2,
                  output_dir=str(tmp_path / name), device="cpu", lora_rank=4)
    return TrainJob(**(fields | extra))


def trained_logits(runner: TrainLoop, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the run's frozen base with its adapter, through the trainer's own layer functions."""
    cfg, base = runner.config, runner.state
    extras = base.units[0].layout.views(base.units[0].work)
    cos, sin = fn.rope_tables(cfg, ids.shape[1], CPU)
    x = fn.embed_forward(extras, ids)
    for i in range(cfg.num_layers):
        unit = base.units[i + 1]
        x = fn.layer_forward(unit.layout.views(unit.work) | runner.adapter.params(i), x, cos, sin, cfg, 1 << 20)
    return F.linear(fn.rms_norm(x, extras["model.norm.weight"], cfg.rms_norm_eps), extras[head_weight_name(cfg)])


# -- against PEFT ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case,targets,alpha", [
    ("llama3", None, None),  # every projection, alpha 2 x rank; llama3 RoPE scaling, untied head
    ("qwen2", ["q_proj", "v_proj", "down_proj"], 6.0),  # projections with biases; a subset; scaling 1.5
    pytest.param("qwen3", None, 3.0, marks=pytest.mark.slow),  # q/k norms, tied embeddings
])
def test_training_matches_peft_and_torch_adamw(tmp_path, case, targets, alpha):
    hf = tmp_path / "hf"
    make_hf_checkpoint(case, hf)
    seq = 33
    job = TrainJob(model=str(hf), dataset="random", steps=STEPS, batch_size=2, seq_len=seq, lr=LR, warmup_steps=2,
                   weight_decay=WD, grad_clip=CLIP, device="cpu", output_dir=str(tmp_path / "out"), lora_rank=4,
                   lora_alpha=alpha, lora_targets=targets)
    runner = TrainLoop(job, "parity", tmp_path, mlp_chunk=40)  # chunks of 40 tokens: the chunked MLP runs
    model = peft_model(hf, runner.setup.lora, runner.adapter.weights())
    opt = peft_optimizer(model, LR, WD)
    metrics = []
    runner.run(on_step=metrics.append)
    assert len(metrics) == STEPS

    lr_at, slack = lr_schedule(LR, 2, STEPS), {}
    for step, m in enumerate(metrics, start=1):
        batch = runner.data.batch(step - 1, job.batch_size, seq, job.seed)
        ref_loss, ref_norm = peft_step(model, opt, lr_at(step), CLIP, batch.inputs, batch.targets, slack)
        assert m.loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-5), f"step {step} loss"
        assert m.grad_norm == pytest.approx(ref_norm, rel=1e-4), f"step {step} grad norm"
        assert m.grad_norm > CLIP, "the test should exercise clipping"

    saved = load_adapter(tmp_path / "out", runner.config)  # what the run wrote, read back
    reference = peft_adapter(model)
    assert len(reference) == 2 * runner.config.num_layers * len(saved.config.targets)
    for (layer, target, side), ref in reference.items():
        ours = (saved.a if side == "A" else saved.b)[(layer, target)]
        allowed = 2e-5 + 1e-4 * ref.abs() + slack[(layer, target, side)]
        excess = (ours - ref).abs() - allowed
        worst = int(excess.argmax())
        assert excess.max() <= 0, (f"layer {layer} {target} lora_{side}: element {worst} is "
                                   f"{ours.flatten()[worst].item():.8g}, PEFT's {ref.flatten()[worst].item():.8g}")
    for key, extra in slack.items():  # the slack widens a few ill-conditioned elements, not the whole check
        assert (extra > 2e-5).float().mean().item() < 0.02, f"{key}: rounding slack over 2% of the elements"
    moments = runner.adapter.layout.views(runner.adapter.exp_avg)
    for name, p in model.named_parameters():  # AdamW's moments agree too
        if p.requires_grad:
            layer, target, side = peft_key(name)
            torch.testing.assert_close(moments[f"{layer}.{group_of(target)}.{target}.lora_{side}"],
                                       opt.state[p]["exp_avg"], rtol=1e-3, atol=1e-7)


def test_the_saved_adapter_loads_in_peft_and_gives_the_trained_logits(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    make_hf_checkpoint("llama3", hf)
    out = tmp_path / "adapter"
    job = TrainJob(model=str(hf), dataset="random", steps=3, batch_size=2, seq_len=24, lr=1e-2, device="cpu",
                   output_dir=str(out), lora_rank=4, lora_targets=["q_proj", "k_proj", "o_proj", "up_proj"])
    runner = TrainLoop(job, "save", tmp_path)
    summary = runner.run()
    assert summary.checkpoint == out
    trained = runner.adapter.weights()
    assert all(b.abs().max() > 0 for b in trained.b.values()), "training moved every B off zero"

    config = read_adapter_config(out)
    assert (config.rank, config.alpha, config.targets) == (4, 8.0, ("q_proj", "k_proj", "o_proj", "up_proj"))
    ours = load_adapter(out, runner.config)
    for key in trained.a:
        assert torch.equal(ours.a[key], trained.a[key]) and torch.equal(ours.b[key], trained.b[key])
    assert not (out / "config.json").exists() and not list(out.glob("model*.safetensors")), "no model beside it"

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = torch.randint(0, runner.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        model = peft.PeftModel.from_pretrained(base, out).eval()
        loaded = peft_adapter(model)
        theirs = model(input_ids=ids).logits
    assert len(loaded) == 2 * runner.config.num_layers * 4
    for (layer, target, side), tensor in loaded.items():
        assert torch.equal(tensor, (trained.a if side == "A" else trained.b)[(layer, target)])
    with torch.no_grad():
        mine = trained_logits(runner, ids)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert (theirs - plain).abs().max() > 1e-3, "the adapter changes the logits (else the check above is empty)"


# -- resume, start --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("data", ["text", "packed chat"])
def test_resume_continues_bit_exactly(tmp_path, data, device):
    """On CUDA (bf16 base, compiled blocks, deterministic kernels) too, as full training's resume test."""
    how: dict = dict(device=device)
    if data == "packed chat":
        records = write_jsonl(tmp_path / "chat.jsonl", finetune_records(48))
        how |= dict(dataset=str(records), seq_len=128, lora_targets=["v_proj", "o_proj", "gate_proj"])
    unbroken: list[float] = []
    TrainLoop(lora_job(tmp_path, "a", **how), "a", tmp_path).run(on_step=lambda m: unbroken.append(m.loss))

    broken: list[float] = []
    first = TrainLoop(lora_job(tmp_path, "b", **how), "b", tmp_path).run(
        on_step=lambda m: broken.append(m.loss), should_stop=lambda: len(broken) >= 3)
    assert first.state == "stopped" and first.step == 3
    resumed = TrainLoop(lora_job(tmp_path, "b", resume=True, **how), "b", tmp_path)
    assert resumed.start_step == 3
    second = resumed.run(on_step=lambda m: broken.append(m.loss))
    assert second.state == "finished" and second.step == 6

    assert broken == unbroken, "a resumed LoRA run must see the same losses as an unbroken one"
    for name in ("adapter_model.safetensors", "optimizer.safetensors"):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("rng")), f"{name} differs"
    assert json.loads((tmp_path / "b" / "trainer_state.json").read_text())["step"] == 6


def test_a_lora_run_starts_from_the_base_model_exactly(tmp_path):
    """B starts at zero (PEFT's default), so the first step's loss is the base model's, bit for bit,
    and the frozen random base is the full trainer's random model of that seed."""
    full: list[float] = []
    TrainLoop(lora_job(tmp_path, "full", lora_rank=None, steps=1), "full", tmp_path).run(
        on_step=lambda m: full.append(m.loss))
    lora: list[float] = []
    runner = TrainLoop(lora_job(tmp_path, "lora", steps=1), "lora", tmp_path)
    runner.run(on_step=lambda m: lora.append(m.loss))
    assert lora == full

    cfg = ModelConfig.tiny()
    state = HostState.random(cfg, seed=5, work_dtype=torch.float32, pin=False)
    base = FrozenBase.random(cfg, 5, torch.float32, CPU)
    assert all(torch.equal(u.work, b.work) for u, b in zip(state.units, base.units, strict=True))

    adapter = TrainedAdapter(cfg, lora_config(8, None, None), CPU)
    adapter.init_(0)
    weights = adapter.weights()
    for (layer, target), a in weights.a.items():
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and a.std() > 0.5 * bound
        assert not weights.b[(layer, target)].any()
    again = TrainedAdapter(cfg, lora_config(8, None, None), CPU)
    again.init_(0)
    assert torch.equal(again.master, adapter.master)
    again.init_(1)
    assert not torch.equal(again.master, adapter.master)


@pytest.mark.slow  # the staged path's twin of the parity above
def test_staged_attention_trains_the_adapter_as_the_whole_sequence_does():
    """Past ``attention_chunk`` tokens the layer recomputes q, k and v chunk by chunk after SDPA's
    backward (functional.layer_backward): the adapter's gradients accumulate over the chunks."""
    cfg = ModelConfig.tiny().replace(num_layers=2, tie_word_embeddings=False, attention_bias=True, qk_norm=True)
    base = FrozenBase.random(cfg, 0, torch.float32, CPU)
    results = []
    for attention_chunk in (1 << 30, 16):
        adapter = TrainedAdapter(cfg, lora_config(4, None, None), CPU)
        adapter.init_(0)
        adapter.master.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))  # B off zero: A gets gradients
        opt = AdapterAdamW(adapter, lambda step: 1e-3, 0.1, 0.0, BETAS, EPS)
        engine = LoraStep(cfg, base, opt, CPU, mlp_chunk=24, attention_chunk=attention_chunk)
        losses = [engine.step(ids, t).loss() for ids, t in batches(2, 2, 40, cfg.vocab_size)]
        results.append((losses, adapter.master.clone(), float(engine.sumsq_host.sum())))
    (whole_losses, whole, whole_sq), (staged_losses, staged, staged_sq) = results
    assert staged_losses == pytest.approx(whole_losses, rel=1e-6)
    assert staged_sq == pytest.approx(whole_sq, rel=1e-5)
    torch.testing.assert_close(staged, whole, rtol=1e-4, atol=2e-6)


# -- memory ---------------------------------------------------------------------------------------

def test_the_plan_counts_exactly_what_a_lora_run_allocates():
    cfg = ModelConfig.tiny().replace(num_layers=3, tie_word_embeddings=False, attention_bias=True)
    lora = lora_config(8, None, ["q_proj", "v_proj", "up_proj", "down_proj"])
    batch, seq = 2, 24
    base = FrozenBase.random(cfg, 0, torch.float32, CPU)
    adapter = TrainedAdapter(cfg, lora, CPU)
    opt = AdapterAdamW(adapter, lambda step: 1e-3, 0.0, 1.0, BETAS, EPS)
    engine = LoraStep(cfg, base, opt, CPU)
    (ids, targets), = batches(1, batch, seq, cfg.vocab_size)
    engine.step(ids, targets).loss()
    plan = memory_plan(cfg, torch.float32, batch, seq, Placement(), device="cpu", split=False, lora=lora)
    n = layer_layout(cfg).numel
    assert plan.host["frozen base"] == base.host_nbytes() == cfg.num_layers * n * 4  # the work dtype only
    assert MASTERS_AND_MOMENTS not in plan.host and "gradient buffers" not in plan.host
    assert plan.gpu["adapter"] == adapter.nbytes() == 16 * adapter_numel(cfg, lora) + 8
    assert engine.gpu_buffers_nbytes() == plan.gpu_persistent, {k: v for k, v in plan.gpu.items() if v}
    assert engine.host_buffers_nbytes() == plan.host["checkpoints"] + plan.host["engine"]
    assert adapter.layout.numel == adapter_numel(cfg, lora)


@pytest.mark.slow  # a profiled step, ~1.5 s on 2 cores
def test_the_activation_estimate_bounds_what_a_lora_step_allocates():
    from torch.profiler import ProfilerActivity, profile
    from train_support import allocation_peak

    cfg = ModelConfig.tiny().replace(num_layers=3, hidden_size=512, intermediate_size=1408, num_heads=8,
                                     num_kv_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=False)
    lora = lora_config(16, None, None)
    base = FrozenBase.random(cfg, 0, torch.float32, CPU)
    adapter = TrainedAdapter(cfg, lora, CPU)
    adapter.master.normal_(0, 0.02)
    opt = AdapterAdamW(adapter, lambda step: 1e-3, 0.0, 1.0, BETAS, EPS)
    engine = LoraStep(cfg, base, opt, CPU, mlp_chunk=300, loss_chunk=128)
    (ids, targets), = batches(1, 2, 512, cfg.vocab_size)
    engine.step(ids, targets).loss()  # the buffers of this shape exist from here on
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.step(ids, targets).loss()
    measured = allocation_peak(prof)
    plan = memory_plan(cfg, torch.float32, 2, 512, Placement(), device="cpu", split=False, mlp_chunk=300,
                       loss_chunk=128, lora=lora)
    assert measured <= plan.gpu_working <= 1.4 * measured, (measured, plan.working)


def test_a_34b_base_takes_two_bytes_a_parameter_of_host_ram():
    """The measurement the issue asks for: a LoRA run keeps no fp32 state of the base, so a 34B Llama
    streams from host RAM at 2 bytes a parameter (bf16) with an 80 GiB GPU and 128 GiB of host RAM;
    and a 70B one fits there too once the GPU holds what it can of the base."""
    lora = lora_config(16, None, None)
    cfg = preset_config("34b")
    n = layer_layout(cfg).numel
    streamed = memory_plan(cfg, torch.bfloat16, 8, 2048, Placement(), device="cuda", split=False, gpu_cap=80 * GiB,
                           lora=lora)
    assert streamed.host["frozen base"] == 2 * cfg.num_layers * n
    assert streamed.fits_gpu() and streamed.host_total < 128 * GiB
    full = memory_plan(cfg, torch.bfloat16, 8, 2048, Placement(), device="cuda", split=False, gpu_cap=80 * GiB)
    assert full.host_total > 8 * streamed.host["frozen base"]  # 16 + 2 + 2 bytes a parameter, and more
    big = preset_config("70b")
    placement = choose_lora_resident(big, torch.bfloat16, 4, 2048, 80 * GiB, lora)
    plan = memory_plan(big, torch.bfloat16, 4, 2048, placement, device="cuda", split=False, gpu_cap=80 * GiB, lora=lora)
    assert 0 < placement.resident < big.num_layers and plan.fits_gpu() and plan.host_total < 128 * GiB
    one_more = memory_plan(big, torch.bfloat16, 4, 2048, Placement(placement.resident + 1), device="cuda",
                           split=False, gpu_cap=80 * GiB, lora=lora)
    assert not one_more.fits_gpu()
    assert plan.host["frozen base"] == 2 * (big.num_layers - placement.resident) * layer_layout(big).numel


# -- refusals -------------------------------------------------------------------------------------

def run_train(argv: list[str], capsys) -> tuple[int, str]:  # noqa: ANN001
    try:
        code = main(["train", *argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", "0"], "tandem train: --lora-rank must be >= 1"),
    (["--lora-rank", "-3"], "tandem train: --lora-rank must be >= 1"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "tandem train: --lora-alpha must be > 0"),
    (["--lora-alpha", "8"], "tandem train: --lora-alpha, --lora-targets and --publish need --lora-rank"),
    (["--lora-rank", "4", "--lora-targets", "q_proj,lm_head"],
     "tandem train: --lora-targets: 'lm_head' is not a projection of the model's decoder layers; choose from "
     "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    (["--lora-rank", "4", "--lora-targets", ","], "tandem train: --lora-targets names no projection; choose from "
     "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    (["--lora-rank", "4", "--device-update-layers", "2"],
     "tandem train: a LoRA run updates no base layer: leave out --device-update-layers (--device-resident-layers "
     "keeps base layers on the GPU)"),
    (["--lora-rank", "4", "--default"],
     "tandem train: --default trains the tiny model in full; leave out --lora-rank, or give --model instead"),
])
def test_bad_lora_flags_are_refused_in_one_line(tmp_path, capsys, flags, message):
    code, err = run_train(["--model", "tiny", "--device", "cpu", "--data-dir", str(tmp_path), "--steps", "1",
                           *flags], capsys)
    assert (code, err) == (2, message + "\n")


def test_a_lora_run_keeps_off_a_full_checkpoint_and_resumes_only_its_own_adapter(tmp_path, capsys):
    TrainLoop(lora_job(tmp_path, "full", lora_rank=None, steps=1), "full", tmp_path).run()
    code, err = run_train(["--model", "tiny", "--device", "cpu", "--data-dir", str(tmp_path), "--steps", "1",
                           "--lora-rank", "4", "--output-dir", str(tmp_path / "full")], capsys)
    assert code == 2 and "holds a full-training checkpoint" in err and len(err.splitlines()) == 1, err

    TrainLoop(lora_job(tmp_path, "lora", steps=1), "lora", tmp_path).run()
    with pytest.raises(ProtocolError, match="holds a LoRA adapter's checkpoint"):
        TrainLoop(lora_job(tmp_path, "lora", lora_rank=None, steps=2, resume=True), "lora", tmp_path)
    with pytest.raises(ProtocolError, match="holds a rank-4 adapter") as refused:
        TrainLoop(lora_job(tmp_path, "lora", lora_rank=8, steps=2, resume=True), "lora", tmp_path)
    assert "\n" not in refused.value.message


def test_the_trainer_service_refuses_a_target_the_model_lacks():
    from tandem.services.trainer.service import validate_job

    with pytest.raises(ProtocolError, match="'c_attn' is not a projection"):
        validate_job(TrainJob(model="tiny", device="cpu", lora_rank=4, lora_targets=["q_proj", "c_attn"]))
    validate_job(TrainJob(model="tiny", device="cpu", lora_rank=4, lora_targets=["q_proj"]))
