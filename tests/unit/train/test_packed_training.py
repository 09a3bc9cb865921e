"""Packed fine-tuning batches through the streaming trainer on CPU, against plain PyTorch.

The reference (``train_support.reference_masked_step``) runs each example alone through the repo's
own ``LlamaForCausalLM`` modules (a plain causal forward from position 0), sums the cross-entropy
over its trained targets, and divides the sum over all examples by their count: the masked loss
the trainer must compute from the packed rows. Loss and per-unit gradient norms agree within fp32
rounding (rel 1e-5 and 1e-4). A second check perturbs one example of a row and finds the other's
logits bit-identical. Then the job path: ``tandem train``'s runner on a JSONL file, the checkpoint
serving with the template it trained with, the trainer service's check of a bad file, the CLI flags
and the memory plan's mask.

Run: ``python -m pytest -q tests/unit/train/test_packed_training.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from train_support import (
    CLIP,
    LR,
    WD,
    allocation_peak,
    assert_same_block_mask,
    finetune_records,
    packed_rows,
    reference_masked_step,
    reference_model,
    rule_block_mask,
    write_jsonl,
)

from tandem.shared.model.config import ModelConfig
from tandem.shared.protocol.training import TrainJob
from tandem.shared.text.chat_template import TINY_TEMPLATE, ChatTemplate, chat_template_for, tiny_template
from tandem.shared.text.tokenizer import BYTE_EOS_ID, ByteTokenizer
from tandem.shared.train import functional as fn
from tandem.shared.train.finetune_data import Encoder, FinetuneData, FinetuneDataError, read_records
from tandem.shared.train.host_state import EXTRAS, HostState
from tandem.shared.train.layout import head_weight_name
from tandem.shared.train.loop import TrainLoop
from tandem.shared.train.offload_step import OffloadStep
from tandem.shared.train.optimizer import HostAdamW
from tandem.shared.train.plan import Placement, memory_plan

CONFIGS = {
    "tiny-tied": ModelConfig.tiny().replace(num_layers=3),
    "untied-bias-qknorm-gqa": ModelConfig.tiny().replace(num_layers=2, tie_word_embeddings=False,
                                                         attention_bias=True, o_proj_bias=True, qk_norm=True,
                                                         num_kv_heads=2),
}


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-per-row"])
@pytest.mark.parametrize("name", CONFIGS)
def test_packed_loss_and_gradients_match_each_example_alone(name, pack, tmp_path):
    cfg, seq = CONFIGS[name], 128
    path = write_jsonl(tmp_path / "data.jsonl", finetune_records(14))
    data = FinetuneData.load(path, "any", ByteTokenizer(), tiny_template(), eos_id=BYTE_EOS_ID,
                             vocab_size=cfg.vocab_size, seq_len=seq, pack=pack)
    assert data.packed == pack, "the packed case should pack two examples or more into some row"
    encoder = Encoder(ByteTokenizer(), tiny_template(), BYTE_EOS_ID)
    examples = [encoder.encode(r, path) for r in read_records(path)]
    assert all(len(e.ids) <= seq + 1 for e in examples), "the test's examples should not be cut"
    batch = data.batch(0, len(data.rows), seq, seed=0)  # epoch 0: every row, so every example, once

    state = HostState.random(cfg, seed=1, work_dtype=torch.float32, pin=False)
    model = reference_model(state)  # before the step: the optimizer updates the state behind it
    ref_loss, ref_norms = reference_masked_step(model, examples)
    opt = HostAdamW(state, lambda step: LR, WD, CLIP)
    opt.start()
    try:
        engine = OffloadStep(cfg, state, opt, torch.device("cpu"), mlp_chunk=40, loss_chunk=50)
        handle = engine.step(batch.inputs, batch.targets, segments=batch.segments)
        loss = handle.loss()
        norms = {unit.name: float(engine.sumsq_host[i]) for i, unit in enumerate(state.units)}
        handle.job.done.wait()
    finally:
        opt.close()
    assert loss == pytest.approx(ref_loss, rel=1e-5), f"masked loss {loss} vs each example alone {ref_loss}"
    for unit, ref in ref_norms.items():
        assert norms[unit] == pytest.approx(ref, rel=1e-4), f"{unit}: squared gradient norm {norms[unit]} vs {ref}"


def functional_logits(state: HostState, ids: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """The trainer's own forward (functional.py, the work weights) to logits ``[B, S, vocab]``."""
    cfg = state.config
    extras = state.units[EXTRAS].layout.views(state.units[EXTRAS].work)
    cos, sin = fn.rope_tables(cfg, ids.shape[1], ids.device)
    mask = None
    if segments is not None:
        cos, sin = fn.packed_rope(cos, sin, fn.packed_positions(segments))
        mask = fn.segment_mask(segments, state.work_dtype)
    x = fn.embed_forward(extras, ids)
    for layer in range(cfg.num_layers):
        unit = state.units[layer + 1]
        x = fn.layer_forward(unit.layout.views(unit.work), x, cos, sin, cfg, 16384, mask=mask)
    return F.linear(fn.rms_norm(x, extras["model.norm.weight"], cfg.rms_norm_eps), extras[head_weight_name(cfg)])


@pytest.mark.parametrize("name", CONFIGS)
def test_packing_never_attends_across_examples(name):
    cfg = CONFIGS[name]
    state = HostState.random(cfg, seed=2, work_dtype=torch.float32, pin=False)
    gen = torch.Generator().manual_seed(0)
    a, b, pad = 21, 15, 4
    ids = torch.randint(0, 256, (1, a + b + pad), generator=gen)
    segments = torch.tensor([[0] * a + [1] * b + [-1] * pad], dtype=torch.int32)
    perturbed = ids.clone()
    perturbed[0, :a] = torch.randint(0, 256, (a,), generator=gen)
    rows = slice(a, a + b)

    before = functional_logits(state, ids, segments)[0, rows]
    after = functional_logits(state, perturbed, segments)[0, rows]
    assert torch.equal(before, after), f"example B's logits moved by {(before - after).abs().max():.3g} with A's tokens"
    alone = functional_logits(state, ids[:, rows], None)[0]
    torch.testing.assert_close(before, alone, rtol=1e-5, atol=1e-5,
                               msg="example B packed after A differs from B alone (positions or mask)")
    unmasked = (functional_logits(state, ids, None)[0, rows] - functional_logits(state, perturbed, None)[0, rows])
    assert unmasked.abs().max() > 1e-3, "without the mask A's tokens should reach B: the check above proves nothing"


@pytest.mark.parametrize("name", CONFIGS)
def test_the_cuda_block_mask_attends_as_the_dense_mask(name):
    """FlexAttention under :func:`segment_block_mask` (what CUDA runs; eager here, forward only: its CPU
    kernel has no backward) gives SDPA's output under :func:`segment_mask`, padding included."""
    import warnings

    cfg, seq = CONFIGS[name], 200
    segments = torch.tensor([[0] * 50 + [1] * 100 + [2] * 30 + [-1] * 20, [0] * 130 + [1] * 70])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, cfg.num_heads, cfg.head_dim, generator=gen)
    k, v = (torch.randn(2, seq, cfg.num_kv_heads, cfg.head_dim, generator=gen) for _ in range(2))
    dense = fn.attend(q, k, v, cfg, fn.segment_mask(segments, torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        flex = fn.attend(q, k, v, cfg, fn.segment_block_mask(segments))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5, msg="block mask and dense mask disagree")


@pytest.mark.parametrize("seq", [1, 5, 127, 128, 129, 300, 513, 1024])
def test_the_block_mask_from_example_starts_is_the_rules_own(seq):
    """:func:`segment_block_mask` builds the tiles from where examples start; FlexAttention's
    create_block_mask evaluates the rule on every pair. Same tiles, partial and full, on both sides
    (the backward's), in the same order, over 40 layouts at each length."""
    for seed in range(40):
        segments = packed_rows(seq, 1 + seed % 3, seed)
        assert_same_block_mask(fn.segment_block_mask(segments), rule_block_mask(segments), segments)


def test_an_example_in_two_places_of_a_row_is_refused():
    segments = torch.tensor([[0] * 100 + [1] * 100 + [0] * 56])
    with pytest.raises(ValueError, match="contiguous"):
        fn.segment_block_mask(segments)


# --- the job path -----------------------------------------------------------------------------------


def small_job(tmp_path: Path, dataset: Path, **extra) -> TrainJob:
    fields = dict(model="tiny", dataset=str(dataset), steps=2, batch_size=2, seq_len=128, device="cpu",
                  output_dir=str(tmp_path / "out"))
    return TrainJob(**(fields | extra))


def test_runner_fine_tunes_on_jsonl_and_the_checkpoint_serves_its_template(tmp_path):
    dataset = write_jsonl(tmp_path / "chat.jsonl", finetune_records(10))
    runner = TrainLoop(small_job(tmp_path, dataset), "ft", tmp_path)
    assert runner.data.packed and "10 examples (7 chat, 3 prompt/completion)" in runner.data.description
    losses: list[float] = []
    summary = runner.run(on_step=lambda m: losses.append(m.loss))
    assert summary.state == "finished" and len(losses) == 2 and all(loss > 0 for loss in losses)
    checkpoint = summary.checkpoint
    assert (checkpoint / "chat_template.jinja").read_text() == TINY_TEMPLATE
    # The front end's rule for a checkpoint of another name: its own template file, the one trained with.
    assert chat_template_for(checkpoint, "ft-out").source == TINY_TEMPLATE


def test_step_rates_count_the_tokens_that_are_not_padding(tmp_path):
    """Rows of one example each (no packing) are mostly padding here: the rates count what was not."""
    dataset = write_jsonl(tmp_path / "chat.jsonl", finetune_records(6))
    runner = TrainLoop(small_job(tmp_path, dataset, pack=False, steps=1), "pad", tmp_path)
    batch = runner.data.batch(0, 2, 128, runner.job.seed)
    real = int((batch.segments >= 0).sum())
    assert 0 < real < 2 * 128, "the test's rows should hold some padding"
    metrics = []
    runner.run(on_step=metrics.append, final_checkpoint=False)
    (m,) = metrics
    assert m.padding_fraction == pytest.approx(1 - real / 256), m
    assert m.tokens_per_s * m.step_time_s == pytest.approx(real, rel=1e-6), "tok/s should count the real tokens only"
    from tandem.cli.train import progress

    line = progress(1, 1, m.loss, m.tokens_per_s, m.model_tflops, 1.0, m.padding_fraction)
    assert f"tok/s ({m.padding_fraction:.0%} padding)" in line, line
    assert "padding" not in progress(1, 1, m.loss, m.tokens_per_s, m.model_tflops, 1.0), "no padding, no note"


def test_runner_copies_a_hugging_face_models_template(tmp_path):
    from model_support import make_hf_checkpoint

    source = tmp_path / "hf"
    make_hf_checkpoint("llama3", source)
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    dataset = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "the quick fox"},
                                                                  {"role": "assistant", "content": "jumps over"}]}])
    summary = TrainLoop(small_job(tmp_path, dataset, model=str(source), steps=1, batch_size=1, seq_len=32),
                          "hf", tmp_path).run()
    assert ChatTemplate.from_model_dir(summary.checkpoint).source == template
    assert (summary.checkpoint / "tokenizer.json").is_file()


def test_text_format_reads_a_jsonl_file_as_text(tmp_path):
    dataset = write_jsonl(tmp_path / "notes.jsonl", finetune_records(20))
    runner = TrainLoop(small_job(tmp_path, dataset, data_format="text", seq_len=32), "txt", tmp_path)
    assert not runner.data.packed and "files" in runner.data.description


def test_bad_record_refuses_the_job_before_training(tmp_path):
    lonely = {"messages": [{"role": "user", "content": "x"}]}
    dataset = write_jsonl(tmp_path / "chat.jsonl", [finetune_records(1)[0], lonely])
    with pytest.raises(FinetuneDataError, match=r"chat.jsonl line 2: has no assistant message"):
        TrainLoop(small_job(tmp_path, dataset), "bad", tmp_path)


@pytest.mark.parametrize("rows,data_format,expected", [
    ([{"prompt": "a", "completion": "b"}, "{oops"], "auto", "line 2: is not JSON"),
    ([{"prompt": "a", "completion": "b"}], "chat", "line 1: is a prompt/completion record but the data format is chat"),
])
def test_trainer_service_refuses_a_bad_file_with_the_line(rows, data_format, expected, tmp_path):
    from tandem.services.trainer.service import validate_job

    dataset = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(FinetuneDataError, match=expected):
        validate_job(small_job(tmp_path, dataset, data_format=data_format))


def test_trainer_service_accepts_a_good_file(tmp_path):
    from tandem.services.trainer.service import validate_job

    validate_job(small_job(tmp_path, write_jsonl(tmp_path / "data.jsonl", finetune_records(3))))


@pytest.mark.parametrize("flags,expected", [
    ([], dict(data_format="auto", pack=True)),
    (["--dataset", "x.jsonl", "--data-format", "chat", "--no-pack"], dict(dataset="x.jsonl", data_format="chat",
                                                                          pack=False)),
])
def test_cli_flags_reach_the_job(flags, expected, tmp_path):
    from tandem.cli.train import add_train_parser, build_job

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(), lambda p: None)
    job = build_job(parser.parse_args(["train", *flags]), tmp_path)
    assert {k: getattr(job, k) for k in expected} == expected


@pytest.mark.parametrize("device,deterministic", [("cpu", False), ("cuda", True), ("cuda", False)])
def test_memory_plan_counts_the_packed_mask(device, deterministic):
    cfg, batch, seq = ModelConfig.tiny(), 4, 300
    plain = memory_plan(cfg, torch.bfloat16, batch, seq, Placement(), device=device, deterministic=deterministic)
    packed = memory_plan(cfg, torch.bfloat16, batch, seq, Placement(), device=device, packed=True,
                         deterministic=deterministic)
    if device == "cpu" or deterministic:  # the dense additive mask, its last dim padded to 16, bf16
        mask = batch * seq * 304 * 2
    else:  # FlexAttention's block mask over 3 x 3 tiles: counts and indices, partial and full, both sides
        mask = 4 * (batch * 3 + batch * 3 * 3) * 4
        assert "packed mask build" in packed.working
    assert packed.gpu["packed attention mask"] == mask
    assert packed.gpu_persistent - plain.gpu_persistent == mask + 2 * batch * seq * (cfg.head_dim // 2) * 4


@pytest.mark.parametrize("batch,seq", [(8, 2048), (1, 65536)])
def test_the_plan_bounds_what_building_the_block_mask_allocates(batch, seq):
    """The plan's "packed mask build" against the CPU allocator's peak while the mask is built and
    the mask it keeps: both covered, neither by more than 2x."""
    from torch.profiler import ProfilerActivity, profile

    segments = torch.arange(seq).div(1500, rounding_mode="floor")[None].repeat(batch, 1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn.segment_block_mask(segments)
    peak = allocation_peak(prof)
    plan = memory_plan(ModelConfig.tiny(), torch.bfloat16, batch, seq, Placement(), device="cuda", packed=True)
    estimate = plan.working["packed mask build"]
    assert peak <= estimate <= 2 * peak, f"building the mask peaked at {peak} bytes; the plan says {estimate}"
