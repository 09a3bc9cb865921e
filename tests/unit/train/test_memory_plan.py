"""The memory plan (shared/train/plan.py) against what a CPU run allocates, its refusals, the
placement it chooses from a GPU cap, and the bytes behind the step's bound.

Persistent buffers are compared exactly with the tensors a run holds (found by walking the engine,
not through the engine's own accounting); the activation estimate is compared with the peak that
torch's profiler sees the allocator reach during one CPU step.
Run: ``python -m pytest -q tests/unit/train/test_memory_plan.py``.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from train_support import allocation_peak, batches

from tandem.shared.model.config import ModelConfig
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.training import TrainJob
from tandem.shared.train import loop as runner_mod
from tandem.shared.train.functional import ATTENTION_CHUNK
from tandem.shared.train.host_state import HostState
from tandem.shared.train.layout import extras_layout, layer_layout
from tandem.shared.train.offload_step import OffloadStep
from tandem.shared.train.optimizer import HostAdamW
from tandem.shared.train.plan import (
    H200,
    MASTERS_AND_MOMENTS,
    GiB,
    Placement,
    PlanError,
    choose_placement,
    memory_plan,
    step_bound,
    step_bytes,
)
from tandem.shared.train.presets import preset_config

TINY = ModelConfig.tiny()
UNTIED = TINY.replace(num_layers=5, tie_word_embeddings=False, attention_bias=True, qk_norm=True, num_kv_heads=2)
HOST_ONLY = ("ckpt_host", "sumsq_host", "loss_host")  # the engine's host buffers; every other tensor is the device's
NOT_OWNED = ("state", "opt", "optimizer", "lanes", "trace", "cfg", "config")  # references, not the engine's buffers


def walk_tensors(obj, seen: dict[int, torch.Tensor], skip=NOT_OWNED, depth: int = 0) -> None:  # noqa: ANN001
    """Every tensor reachable from ``obj``'s attributes (lists, tuples and dicts included), by storage."""
    if isinstance(obj, torch.Tensor):
        seen.setdefault(obj.untyped_storage().data_ptr(), obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            walk_tensors(item, seen, skip, depth)
    elif isinstance(obj, dict):
        for item in obj.values():
            walk_tensors(item, seen, skip, depth)
    elif hasattr(obj, "__dict__") and depth < 3 and not isinstance(obj, type):
        for name, value in vars(obj).items():
            if name not in skip:
                walk_tensors(value, seen, skip, depth + 1)


def engine_tensors(engine: OffloadStep) -> tuple[int, int]:
    """``(device bytes, host bytes)`` of the tensors the engine and its updater hold."""
    device, host = {}, {}
    walk_tensors(engine, device, skip=NOT_OWNED + HOST_ONLY)
    walk_tensors({k: getattr(engine, k) for k in HOST_ONLY}, host)
    return sum(t.untyped_storage().nbytes() for t in device.values()), sum(t.nbytes for t in host.values())


@pytest.mark.parametrize("cfg,placement,split,attention_chunk", [
    (TINY, Placement(0, 0), False, ATTENTION_CHUNK),
    (TINY, Placement(0, 0), True, ATTENTION_CHUNK),
    (UNTIED, Placement(2, 4, sets=3), True, ATTENTION_CHUNK),  # 2 resident, 2 streamed (3 sets: 2 usable)
    (UNTIED, Placement(1, 5, sets=2), False, ATTENTION_CHUNK),
    (UNTIED, Placement(5, 5), False, ATTENTION_CHUNK),
    (UNTIED, Placement(1, 2), True, 16),  # long-sequence mode: staged attention, every layer's input a checkpoint
], ids=["tiny", "tiny-split", "resident2-streamed2", "resident1-streamed4", "all-resident", "staged"])
def test_plan_counts_exactly_the_buffers_a_cpu_run_allocates(cfg, placement, split, attention_chunk):
    batch, seq = 2, 24
    state = HostState.random(cfg, seed=0, work_dtype=torch.float32, pin=False)
    opt = HostAdamW(state, lambda step: 1e-3, 0.1, 1.0, split=split)
    if split and not opt.split:
        pytest.fail("the host AdamW kernel did not build (is a C compiler installed?)")
    opt.start()
    engine = OffloadStep(cfg, state, opt, torch.device("cpu"), device_update_layers=placement.device_update,
                             device_update_sets=placement.sets, device_resident_layers=placement.resident,
                             attention_chunk=attention_chunk)
    try:
        (ids, targets), = batches(1, batch, seq, cfg.vocab_size)
        engine.step(ids, targets).loss()
        opt.wait_all(1)
        engine.synchronize()
    finally:
        opt.close()
    plan = memory_plan(cfg, torch.float32, batch, seq, placement, device="cpu", split=split,
                       attention_chunk=attention_chunk)
    unit_bytes = sum(t.nbytes for u in state.units for t in u.buffers())
    assert unit_bytes == plan.host[MASTERS_AND_MOMENTS] + plan.host["working copies"] + plan.host[
        "gradient buffers"]
    device_bytes, host_bytes = engine_tensors(engine)
    assert host_bytes == plan.host["checkpoints"] + plan.host["engine"]
    assert device_bytes == plan.gpu_persistent, {k: v for k, v in plan.gpu.items() if v}
    assert engine.gpu_buffers_nbytes() == plan.gpu_persistent
    assert engine.host_buffers_nbytes() == host_bytes


def cpu_step_peak(cfg: ModelConfig, batch: int, seq: int, mlp_chunk: int, loss_chunk: int | None,
                  attention_chunk: int = ATTENTION_CHUNK) -> tuple[int, int]:
    """Peak bytes the CPU allocator holds above the engine's buffers during one step, and the
    engine's loss chunk."""
    from torch.profiler import ProfilerActivity, profile

    state = HostState.random(cfg, seed=0, work_dtype=torch.float32, pin=False)
    opt = HostAdamW(state, lambda step: 1e-3, 0.0, 1.0)
    opt.start()
    engine = OffloadStep(cfg, state, opt, torch.device("cpu"), mlp_chunk=mlp_chunk, loss_chunk=loss_chunk,
                             attention_chunk=attention_chunk)
    (ids, targets), = batches(1, batch, seq, cfg.vocab_size)
    try:
        engine.step(ids, targets).loss()  # buffers of this shape exist from here on
        opt.wait_all(1)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            engine.step(ids, targets).loss()
        opt.wait_all(2)
    finally:
        opt.close()
    return allocation_peak(prof), engine.loss_chunk


WIDE = TINY.replace(num_layers=3, hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=2, head_dim=64,
                    vocab_size=4096, tie_word_embeddings=False)


@pytest.mark.parametrize("cfg,batch,seq,mlp_chunk,loss_chunk,attention_chunk", [
    (TINY.replace(num_layers=3), 2, 512, 256, None, ATTENTION_CHUNK),  # chunked MLP
    (TINY.replace(num_layers=3), 1, 2048, 1 << 20, None, ATTENTION_CHUNK),  # one MLP chunk
    (WIDE, 2, 512, 300, 128, ATTENTION_CHUNK),
    pytest.param(WIDE, 1, 2048, 512, 256, 256, marks=pytest.mark.slow),  # the long-sequence path: attention staged
], ids=["chunked-mlp", "one-mlp-chunk", "gqa-untied", "staged-attention"])
def test_activation_estimate_bounds_what_a_cpu_step_allocates(cfg, batch, seq, mlp_chunk, loss_chunk, attention_chunk):
    measured, chunk = cpu_step_peak(cfg, batch, seq, mlp_chunk, loss_chunk, attention_chunk)
    plan = memory_plan(cfg, torch.float32, batch, seq, Placement(), device="cpu", split=False, mlp_chunk=mlp_chunk,
                       loss_chunk=chunk, attention_chunk=attention_chunk)
    assert measured > 0
    assert measured <= plan.gpu_working <= 1.4 * measured, (measured, plan.working)


def test_gpu_refusal_is_one_line_naming_what_to_change():
    cfg = preset_config("1b")
    plan = memory_plan(cfg, torch.bfloat16, 1, 524288, Placement(), device="cuda", gpu_cap=32 * GiB,
                       deterministic=True)
    assert not plan.fits_gpu()
    with pytest.raises(PlanError) as info:
        plan.check()
    message = str(info.value)
    assert "\n" not in message and "GPU memory" in message
    assert "--gpu-memory-gib" in message and "--seq-len" in message and "32.0 GiB cap" in message
    # the H200's 132 SMs over 32 heads: 5 fp32 dq accumulators of 4 GiB where the atomics kernel keeps one
    assert "--no-deterministic (the deterministic flash backward needs 16.0 GiB more)" in message
    # with GPU-updated layers the message names them too
    state = memory_plan(preset_config("3b"), torch.bfloat16, 8, 2048, Placement(10, 12), device="cuda",
                        gpu_cap=16 * GiB)
    with pytest.raises(PlanError, match="fewer GPU-resident/updated layers"):
        state.check()


def test_host_refusal_names_the_knobs():
    plan = memory_plan(preset_config("3b"), torch.bfloat16, 8, 2048, Placement(), device="cuda", split=True,
                       gpu_cap=16 * GiB, host_available=40 * GiB)
    with pytest.raises(PlanError) as info:
        plan.check()
    message = str(info.value)
    assert "\n" not in message and message.startswith("host RAM")
    assert "--no-split-update" in message and "--seq-len" in message and "40.0 GiB" in message


def test_runner_refuses_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "host_ram_available", lambda: 4 * GiB)

    def no_allocation(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("the host state was allocated before the plan was checked")

    monkeypatch.setattr(HostState, "random", no_allocation)
    job = TrainJob(model="3b", dataset="random", device="cpu", batch_size=8, seq_len=2048, steps=1,
                   output_dir=str(tmp_path / "out"))
    with pytest.raises(ProtocolError) as info:
        runner_mod.TrainLoop(job, "big", tmp_path)
    assert "host RAM" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow  # two CLI processes, 5 s on 2 cores
def test_cli_plan_prints_the_plan_and_exits(tmp_path):
    args = [sys.executable, "-m", "tandem", "train", "--data-dir", str(tmp_path), "--device", "cpu",
            "--dataset", "random", "--batch-size", "2", "--seq-len", "64", "--plan"]
    ok = subprocess.run(args + ["--model", "tiny"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "memory plan:" in ok.stdout and "placement:" in ok.stdout and "fits" in ok.stdout
    assert not (tmp_path / "train").exists(), "--plan must not train"
    big = subprocess.run(args + ["--model", "7b", "--batch-size", "64", "--seq-len", "65536"], capture_output=True,
                         text=True, timeout=120)
    assert big.returncode == 2 and "does NOT fit" in big.stdout
    refusal = [ln for ln in big.stderr.splitlines() if ln.startswith("tandem train:")]
    assert len(refusal) == 1 and "host RAM" in refusal[0]


@pytest.mark.parametrize("cap_gib", [8, 16, 24, 40])
def test_chosen_placement_fills_the_cap_without_exceeding_it(cap_gib):
    cfg, cap = preset_config("3b"), cap_gib * GiB
    placement, terms = choose_placement(cfg, torch.bfloat16, 8, 2048, cap, H200)
    plan = memory_plan(cfg, torch.bfloat16, 8, 2048, placement, gpu_cap=cap)
    assert plan.fits_gpu() and placement.reason.startswith("auto")
    assert terms["bound"] == pytest.approx(step_bound(cfg, 8, 2048, placement, H200)["bound"])
    # the cap is not left unused for nothing: one more resident layer, or one more streamed one, either
    # does not fit or would not predict a faster step
    r, k = placement.resident, placement.device_update
    for more in (Placement(r + 1, max(k, r + 1), placement.sets), Placement(r, k + 1, placement.sets)):
        if more.device_update <= cfg.num_layers and memory_plan(cfg, torch.bfloat16, 8, 2048, more,
                                                                gpu_cap=cap).fits_gpu():
            assert step_bound(cfg, 8, 2048, more, H200)["bound"] >= terms["bound"] - 1e-4, more
    assert plan.gpu_peak + plan.headroom <= cap
    # and no placement that fits has a lower predicted bound
    for r in range(0, cfg.num_layers + 1, 3):
        for k in range(r, cfg.num_layers + 1, 3):
            other = Placement(r, k, placement.sets)
            if memory_plan(cfg, torch.bfloat16, 8, 2048, other, gpu_cap=cap).fits_gpu():
                assert step_bound(cfg, 8, 2048, other, H200)["bound"] >= terms["bound"] - 1e-9, other


def test_more_cap_never_predicts_a_slower_step():
    cfg = preset_config("3b")
    bounds = [choose_placement(cfg, torch.bfloat16, 8, 2048, c * GiB, H200)[1]["bound"] for c in (8, 12, 16, 24, 40)]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] < bounds[0]


def test_step_bytes_by_hand():
    """UNTIED (5 layers), 1 resident, 1 streamed, 3 on the host, bf16, batch 2 x 8."""
    n, ne, e, act = layer_layout(UNTIED).numel, extras_layout(UNTIED).numel, 2, 2 * 8 * UNTIED.hidden_size * 2
    b = step_bytes(UNTIED, 2, 8, Placement(1, 2), e=e, split=True)
    # forward: 4 non-resident layers + extras; backward reloads layers 1 and 2 (0 is resident, 3 and 4 stay)
    assert b.h2d == (4 + 2) * n * e + ne * e + 3 * act + 12 * n
    assert b.d2h == (3 * n + ne) * e + 3 * act + (12 + e) * n
    host = 3 * n + ne
    assert b.host_read == host * (12 + e) * 2 + b.h2d
    assert b.host_write == host * (e + 12) + b.d2h
    assert (b.first_read, b.first_write) == (host * (12 + e), host * e)
    whole = step_bytes(UNTIED, 2, 8, Placement(1, 2), e=e, split=False)
    assert whole.host_read == host * (12 + e) + whole.h2d and whole.host_write == host * (12 + e) + whole.d2h
    # the clip window: the previews, the forward's 4 layers + extras up, the streamed layer's state up,
    # the forward's 3 checkpoints down
    assert b.window == host * (12 + e) + host * e + (4 * n + ne) * e + 12 * n + 3 * act


def test_the_clip_window_binds_when_the_previews_share_host_memory_with_the_copies():
    cfg, placement, compute = preset_config("3b"), Placement(3, 8), (0.17, 0.52)
    alone = step_bound(cfg, 8, 2048, placement, H200, compute_s=compute)
    assert alone["clip window (host memory)"] == pytest.approx(
        step_bytes(cfg, 8, 2048, placement).window / H200.dram + 0.52)
    shared = replace(H200, preview_dram=H200.dram / 2)
    slow = step_bound(cfg, 8, 2048, placement, shared, compute_s=compute)
    assert slow["bound"] == slow["clip window (host memory)"] > alone["clip window (host memory)"], slow
    # every other term is the same: only the window knows the rate the previews get beside the copies
    assert {k: v for k, v in slow.items() if "window" not in k and k != "bound"} == {
        k: v for k, v in alone.items() if "window" not in k and k != "bound"}
    # with no host layer the window is the streamed chain's: no term of its own
    every = Placement(0, cfg.num_layers)
    assert step_bound(cfg, 8, 2048, every, shared, compute_s=compute)["clip window (host memory)"] == 0.0
