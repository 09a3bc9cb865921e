"""Long sequences: the staged attention half (functional.layer_backward past ``attention_chunk``
tokens) against the whole-sequence one, layer by layer and through the streaming engine, and the
memory plan of the issue's long-context jobs.

The staged path computes q, k, v chunk by chunk without a graph, keeps only SDPA's and o_proj's
graphs across the layer, and recomputes the projections chunk by chunk after SDPA's backward; the
engine drops the resident tail there (every layer's input is a checkpoint). Same math in another
order: fp32 outputs and gradients agree to rounding. Small chunks (not dividing the sequence) make
CPU runs take that path.
Run: ``python -m pytest -q tests/unit/train/test_long_context.py``.
"""

from __future__ import annotations

import pytest
import torch
from train_support import batches

from tandem.shared.model.config import ModelConfig
from tandem.shared.train import functional as fn
from tandem.shared.train.host_state import HostState
from tandem.shared.train.offload_step import OffloadStep
from tandem.shared.train.optimizer import HostAdamW
from tandem.shared.train.plan import GiB, Placement, memory_plan, resident_tail
from tandem.shared.train.presets import preset_config

CONFIGS = {
    "gqa-tied": ModelConfig.tiny().replace(num_layers=3),
    "gqa-bias-qknorm": ModelConfig.tiny().replace(num_layers=2, tie_word_embeddings=False, attention_bias=True,
                                                  o_proj_bias=True, qk_norm=True, num_kv_heads=2),
    "mha": ModelConfig.tiny().replace(num_layers=2, num_kv_heads=8),
}
WHOLE = 1 << 30  # an attention_chunk no test batch reaches: the whole-sequence path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def layer_run(cfg: ModelConfig, unit, x, grad_out, cos, sin, mask, attention_chunk: int):  # noqa: ANN001
    """``(layer output, dL/dx, parameter gradients)`` of one decoder layer."""
    grads = torch.zeros_like(unit.work)
    leaves = {}
    for (name, w), g in zip(unit.layout.views(unit.work).items(), unit.layout.views(grads).values()):
        leaves[name] = w.detach().requires_grad_(True)
        leaves[name].grad = g
    out = fn.layer_forward(unit.layout.views(unit.work), x, cos, sin, cfg, 40, mask=mask,
                           attention_chunk=attention_chunk)
    dx = fn.layer_backward(leaves, x, grad_out.clone(), cos, sin, cfg, 40, mask=mask, attention_chunk=attention_chunk)
    return out, dx, grads


@pytest.mark.parametrize("attention_chunk", [24, 50], ids=["chunk-24", "chunk-50"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("name", CONFIGS)
def test_staged_layer_matches_the_whole_sequence_layer(name, packed, attention_chunk):
    cfg, bsz, seq = CONFIGS[name], 2, 64
    state = HostState.random(cfg, seed=3, work_dtype=torch.float32, pin=False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(bsz, seq, cfg.hidden_size, generator=gen)
    grad_out = torch.randn(bsz, seq, cfg.hidden_size, generator=gen)
    cos, sin = fn.rope_tables(cfg, seq, torch.device("cpu"))
    mask = None
    if packed:  # two examples in the first row, three in the second
        segments = torch.tensor([[0] * 20 + [1] * 44, [0] * 10 + [1] * 30 + [2] * 24])
        cos, sin = fn.packed_rope(cos, sin, fn.packed_positions(segments))
        mask = fn.segment_mask(segments, torch.float32)
    assert fn.staged(bsz * seq, attention_chunk) and not fn.staged(bsz * seq, WHOLE)
    whole = layer_run(cfg, state.units[1], x, grad_out, cos, sin, mask, WHOLE)
    staged = layer_run(cfg, state.units[1], x, grad_out, cos, sin, mask, attention_chunk)
    for what, a, b in zip(("layer output", "dL/dx", "parameter gradients"), staged, whole):
        assert rel_err(a, b) < 1e-5, f"{what}: staged differs from the whole-sequence layer by {rel_err(a, b):.2e}"


@pytest.mark.parametrize("name", ["gqa-tied", "gqa-bias-qknorm"])
def test_engine_steps_agree_staged_and_whole(name):
    """Three steps each way from one initial state: the losses and every unit's gradient norm agree,
    so the staged backward, the checkpointed top layers and their reload order change nothing but
    rounding. (Not the masters: AdamW turns a rounding-sized gradient into an update of up to lr.)"""
    cfg = CONFIGS[name]
    data = batches(3, 2, 32, cfg.vocab_size)
    runs = {}
    for label, chunk in (("whole", WHOLE), ("staged", 20)):
        state = HostState.random(cfg, seed=5, work_dtype=torch.float32, pin=False)
        opt = HostAdamW(state, lambda step: 1e-3, 0.1, 1.0)
        opt.start()
        losses, norms = [], []
        try:
            engine = OffloadStep(cfg, state, opt, torch.device("cpu"), mlp_chunk=24, attention_chunk=chunk)
            for ids, targets in data:
                losses.append(engine.step(ids, targets).loss())
                norms.append(engine.sumsq_host.clone())
            opt.wait_all(len(data))
            assert engine.tail == resident_tail(cfg.num_layers, 64, chunk)
        finally:
            opt.close()
        runs[label] = losses, torch.stack(norms)
    assert runs["staged"][0] == pytest.approx(runs["whole"][0], rel=1e-5), runs
    err = rel_err(runs["staged"][1], runs["whole"][1])
    assert err < 1e-4, f"squared gradient norms differ by {err:.2e} between staged and whole-sequence attention"


@pytest.mark.parametrize("model,seq", [("1b", 524288), ("3b", 262144)])
def test_the_issue_long_contexts_fit_a_32_gib_cap(model, seq):
    """The jobs of issue 20 (batch 1, bf16, GPU capped at 32 GiB): the whole-sequence attention half's
    graph alone is tens of GiB there; staged, the plan fits, and every layer's input is a checkpoint."""
    cfg = preset_config(model, max_position_embeddings=seq)
    staged = memory_plan(cfg, torch.bfloat16, 1, seq, Placement(), gpu_cap=32 * GiB)
    whole = memory_plan(cfg, torch.bfloat16, 1, seq, Placement(), gpu_cap=32 * GiB, attention_chunk=WHOLE)
    staged.check()
    assert not whole.fits_gpu(), "the whole-sequence attention should not fit: the plan lost its long-sequence term"
    assert staged.gpu_peak < whole.gpu_peak
    assert staged.host["checkpoints"] == cfg.num_layers * seq * cfg.hidden_size * 2


@pytest.mark.parametrize(("seq_len", "recorded"), [(2048, 4096), (4160, 4160)], ids=["within", "past"])
def test_a_job_past_the_models_positions_records_its_length(tmp_path, seq_len, recorded):
    """A checkpoint trained at more tokens than its config's ``max_position_embeddings`` says so, or a
    server loading it caps requests at the old length (engine.py takes the smaller of the two)."""
    from tandem.shared.model.meta import read_hf_config
    from tandem.shared.protocol.training import TrainJob
    from tandem.shared.train.loop import TrainLoop

    assert ModelConfig.tiny().max_position_embeddings == 4096
    job = TrainJob(model="tiny", dataset="random", device="cpu", batch_size=1, seq_len=seq_len, steps=1,
                   output_dir=str(tmp_path / "out"))
    runner = TrainLoop(job, "positions", tmp_path)
    assert runner.setup.config.max_position_embeddings == recorded
    summary = runner.run()
    assert summary.state == "finished", summary
    saved = read_hf_config(next(p.parent for p in (tmp_path / "out").rglob("config.json")))
    assert saved.max_position_embeddings == recorded, "the checkpoint records the positions it trained at"
