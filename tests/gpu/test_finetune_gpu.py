"""Packed fine-tuning batches on CUDA: the masked bf16 loss tracks each example run alone in fp32,
unpacked rows keep the flash kernel while packed rows run FlexAttention under the block-diagonal
block mask (never SDPA with a dense mask), what a packed step costs next to an unpacked one, and the
block mask built from the examples' starts against FlexAttention's own evaluation of the rule.

Run: ``python -m pytest -q -s -m gpu tests/gpu/test_finetune_gpu.py`` (skipped without CUDA; ``-s``
shows the measured step times).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from train_support import CLIP, LR, finetune_records, reference_masked_step, reference_model, write_jsonl

from tandem.shared.model.config import ModelConfig
from tandem.shared.text.chat_template import tiny_template
from tandem.shared.text.tokenizer import BYTE_EOS_ID, ByteTokenizer
from tandem.shared.train.data import Batch
from tandem.shared.train.finetune_data import Encoder, FinetuneData, read_records
from tandem.shared.train.host_state import HostState
from tandem.shared.train.offload_step import OffloadStep
from tandem.shared.train.optimizer import HostAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def packed_data(tmp_path, seq: int) -> tuple[FinetuneData, list]:  # noqa: ANN001
    path = write_jsonl(tmp_path / "data.jsonl", finetune_records(24))
    data = FinetuneData.load(path, "any", ByteTokenizer(), tiny_template(), eos_id=BYTE_EOS_ID, vocab_size=259,
                             seq_len=seq)
    encoder = Encoder(ByteTokenizer(), tiny_template(), BYTE_EOS_ID)
    return data, [encoder.encode(r, path) for r in read_records(path)]


def engine_for(cfg: ModelConfig, **kw) -> tuple[HostState, HostAdamW, OffloadStep]:  # noqa: ANN003
    state = HostState.random(cfg, seed=3, work_dtype=torch.bfloat16, pin=True)
    opt = HostAdamW(state, lambda step: LR, 0.1, CLIP)
    opt.start()
    return state, opt, OffloadStep(cfg, state, opt, CUDA, **kw)


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager", "compiled"])
def test_packed_bf16_loss_tracks_each_example_alone(compile_layers, tmp_path):
    cfg = ModelConfig.tiny().replace(num_layers=4, tie_word_embeddings=False)
    data, examples = packed_data(tmp_path, 160)
    assert data.packed
    batch = data.batch(0, len(data.rows), 160, seed=0)
    state, opt, engine = engine_for(cfg, compile_layers=compile_layers)
    model = reference_model(state, "cuda")  # fp32 masters
    ref_loss, ref_norms = reference_masked_step(model, examples)
    try:
        handle = engine.step(batch.inputs, batch.targets, segments=batch.segments)
        loss = handle.loss()
        norms = {unit.name: float(engine.sumsq_host[i]) for i, unit in enumerate(state.units)}
        handle.job.done.wait()
    finally:
        opt.close()
    assert loss == pytest.approx(ref_loss, rel=2e-2), f"bf16 packed loss {loss} vs fp32 examples alone {ref_loss}"
    for unit, ref in ref_norms.items():
        assert norms[unit] == pytest.approx(ref, rel=1e-1), f"{unit}: squared gradient norm {norms[unit]} vs {ref}"


def test_unpacked_rows_keep_flash_and_packed_rows_take_flex_attention(tmp_path):
    """Eager blocks, every step with SDPA allowed only its flash kernel: a packed step through SDPA
    (a dense mask) would raise, so the packed one ran FlexAttention."""
    cfg = ModelConfig.tiny().replace(num_layers=2, tie_word_embeddings=False)
    data, _ = packed_data(tmp_path, 160)
    packed = data.batch(0, 4, 160, seed=0)
    plain = torch.randint(0, 256, (4, 161))
    state, opt, engine = engine_for(cfg)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            engine.step(plain[:, :-1], plain[:, 1:]).loss()
            single = Batch(packed.inputs, packed.targets, torch.where(packed.segments > 0, -1, packed.segments))
            engine.step(single.inputs, single.targets, segments=single.segments).loss()  # one example a row
            assert engine.step(packed.inputs, packed.targets, segments=packed.segments).loss() > 0
        opt.wait_all(engine.version)
    finally:
        opt.close()


def timed_steps(engine: OffloadStep, batch: Batch, steps: int) -> float:
    engine.step(batch.inputs, batch.targets, segments=batch.segments).loss()  # compile / warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        handle = engine.step(batch.inputs, batch.targets, segments=batch.segments)
        handle.loss()
        handle.job.done.wait()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("seq", [2048, 8192])
def test_packed_step_cost_next_to_unpacked(seq, deterministic):
    """The same tokens as one causal sequence per row, and packed as examples of 256 tokens: the mask
    path's cost, printed, with the default deterministic kernels (the dense mask) and without
    (FlexAttention, bounded loosely: it skips the masked tiles, 0.92-1.03x the unpacked step on the H200)."""
    cfg = ModelConfig.tiny().replace(hidden_size=2048, intermediate_size=8192, num_heads=16, num_kv_heads=4,
                                     head_dim=128, num_layers=4, tie_word_embeddings=False, vocab_size=4096)
    bsz = max(1, 16384 // seq)
    ids = torch.randint(0, cfg.vocab_size, (bsz, seq + 1))
    plain = Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    segments = (torch.arange(seq, dtype=torch.int32) // 256).expand(bsz, seq).contiguous()
    packed = Batch(plain.inputs, plain.targets, segments)
    state, opt, engine = engine_for(cfg, compile_layers=True, deterministic=deterministic)
    try:
        t_plain = timed_steps(engine, plain, 3)
        torch.cuda.reset_peak_memory_stats()
        t_packed = timed_steps(engine, packed, 3)
        peak = torch.cuda.max_memory_allocated() / 2**30
    finally:
        opt.close()
    kernels = "deterministic" if deterministic else "atomics"
    print(f"\n{kernels}, seq {seq} x batch {bsz}: unpacked {t_plain * 1e3:.1f} ms/step, packed "
          f"{t_packed * 1e3:.1f} ms/step, ratio {t_packed / t_plain:.2f}, peak {peak:.2f} GiB")
    if not deterministic:  # FlexAttention; the deterministic steps' dense mask is only printed
        assert t_packed < 1.5 * t_plain, f"the packed step took {t_packed / t_plain:.2f}x the unpacked one"


def test_the_block_mask_from_example_starts_is_the_rules_own_on_cuda():
    """:func:`segment_block_mask` on CUDA against FlexAttention's create_block_mask evaluating the rule
    pair by pair (as the CPU test does), then one 524,288-token row: its build stays inside the
    plan's "packed mask build" (the rule's own evaluation would need 256 GiB of booleans)."""
    from train_support import assert_same_block_mask, packed_rows, rule_block_mask

    from tandem.shared.train import functional as fn
    from tandem.shared.train.plan import Placement, memory_plan

    for seq in (1, 127, 129, 300, 1024, 4096):
        for seed in range(10):
            segments = packed_rows(seq, 1 + seed % 3, seed).to(CUDA)
            assert_same_block_mask(fn.segment_block_mask(segments), rule_block_mask(segments), segments)
    seq = 524288
    segments = (torch.arange(seq, device=CUDA) // 1500)[None]
    fn.segment_block_mask(segments[:, :4096])  # the kernels' first launches out of the timing
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn.segment_block_mask(segments)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before
    plan = memory_plan(ModelConfig.tiny(), torch.bfloat16, 1, seq, Placement(), device="cuda", packed=True)
    estimate = plan.working["packed mask build"]
    print(f"\nblock mask of a {seq}-token row: built in {took * 1e3:.1f} ms, peak {peak / 2**20:.0f} MiB, "
          f"plan {estimate / 2**20:.0f} MiB")
    assert peak <= estimate, f"the build peaked at {peak / 2**20:.0f} MiB, past the plan"
