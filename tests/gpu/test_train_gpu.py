"""The streaming trainer on CUDA: bf16 parity with plain fp32 PyTorch, real overlap of transfers with
compute, GPU memory that does not grow with depth, and flash attention at long sequence lengths.

Run: ``python -m pytest -q -m gpu tests/gpu/test_train_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch
from train_support import CLIP, LR, batches, reference_model, reference_optimizer, reference_step

from tandem.shared.model.config import ModelConfig
from tandem.shared.train.host_state import HostState
from tandem.shared.train.lanes import hidden_fraction
from tandem.shared.train.offload_step import OffloadStep
from tandem.shared.train.optimizer import HostAdamW, lr_schedule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def engine_for(cfg: ModelConfig, lr_at=lambda step: LR, split: bool = False,
               **kw) -> tuple[HostState, HostAdamW, OffloadStep]:  # noqa: ANN001
    state = HostState.random(cfg, seed=3, work_dtype=torch.bfloat16, pin=True)
    opt = HostAdamW(state, lr_at, 0.1, CLIP, split=split)
    opt.start()
    return state, opt, OffloadStep(cfg, state, opt, CUDA, **kw)


@pytest.mark.parametrize("how", [
    dict(),
    dict(compile_layers=True, split=True),  # the benchmark's way: compiled blocks, preview + commit
    dict(compile_layers=True, split=True, device_update_layers=2, device_update_sets=3),
], ids=["eager", "compiled-split", "compiled-split-device2"])
def test_bf16_training_tracks_fp32_pytorch(how):
    cfg, steps = ModelConfig.tiny().replace(tie_word_embeddings=False, num_layers=4), 6
    lr_at = lr_schedule(LR, 2, steps)
    state, opt, engine = engine_for(cfg, lr_at, mlp_chunk=96, loss_chunk=128, **how)
    assert opt.split == how.get("split", False), "the host AdamW kernel did not build"
    model = reference_model(state, "cuda")
    ref_opt = reference_optimizer(model)
    try:
        for step, (ids, targets) in enumerate(batches(steps, 4, 64, cfg.vocab_size), start=1):
            handle = engine.step(ids, targets, record_timeline=True)
            loss = handle.loss()
            ref_loss, ref_norm = reference_step(model, ref_opt, lr_at(step), ids.cuda(), targets.cuda())
            handle.job.done.wait()
            assert loss == pytest.approx(ref_loss, rel=2e-2), f"step {step}"
            assert handle.job.grad_norm == pytest.approx(ref_norm, rel=5e-2), f"step {step}"
        opt.wait_all(steps)
    finally:
        opt.close()
    ours = state.state_dict()
    diffs = [(ours[k] - v.cpu()).abs().mean().item() for k, v in model.state_dict().items() if k in ours]
    # bf16 gradients move each Adam update by a fraction of lr; fp32 masters keep those drifts small.
    assert max(diffs) < 0.25 * LR * steps, diffs


def run_wide(num_layers: int) -> tuple[int, list[float], int]:
    """Peak GPU bytes above the start, hidden fractions per step, and one layer's bf16 bytes."""
    cfg = ModelConfig.tiny().replace(hidden_size=1024, intermediate_size=4096, num_heads=16, num_kv_heads=4,
                                     head_dim=64, num_layers=num_layers, tie_word_embeddings=False, vocab_size=4096)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state, opt, engine = engine_for(cfg)
    hidden = []
    try:
        for ids, targets in batches(4, 4, 1024, cfg.vocab_size):
            handle = engine.step(ids, targets, record_timeline=True)
            handle.loss()
            handle.job.done.wait()
            ops = handle.trace.device_ops()
            assert all(0 <= o.start_s <= o.end_s for o in ops)
            hidden.append(hidden_fraction(ops))
    finally:
        opt.close()
    return torch.cuda.max_memory_allocated() - base, hidden, state.units[1].work.nbytes


def test_transfers_overlap_compute_and_memory_does_not_grow_with_depth():
    shallow, _, layer_bytes = run_wide(4)
    deep, hidden, _ = run_wide(16)
    # 12 more layers would add 12 x (weights + gradients) if they sat on the GPU.
    assert deep - shallow < 2 * layer_bytes, (deep, shallow, layer_bytes)
    assert max(hidden[1:]) > 0.3, f"transfers should run under compute: {hidden}"


def test_long_sequence_uses_memory_efficient_attention():
    cfg = ModelConfig.tiny().replace(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2,
                                     head_dim=64, num_layers=2, max_position_embeddings=65536)
    state, opt, engine = engine_for(cfg, mlp_chunk=8192)
    torch.cuda.reset_peak_memory_stats()
    try:
        (ids, targets), = batches(1, 1, 65536, cfg.vocab_size)
        loss = engine.step(ids, targets).loss()
    finally:
        opt.close()
    assert 4 < loss < 7
    # Dense attention scores alone would be 8 heads x 64k x 64k x 2 bytes = 64 GiB.
    assert torch.cuda.max_memory_allocated() < 4 * 2**30


def _attention_and_embedding_grads(packed: bool) -> list[torch.Tensor]:
    """dQ, dK, dV of the trainer's attention call (functional.attend) and the embedding gradient, at
    the 3B preset's shapes (24 heads of 128 over 8 KV heads, two rows of 2,048 tokens; ids from a
    128-token alphabet, so they repeat)."""
    from tandem.shared.train import functional as fn
    from tandem.shared.train.presets import preset_config

    cfg = preset_config("3b")
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn((2, 2048, 24, 128), device=CUDA, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    k, v = (torch.randn((2, 2048, 8, 128), device=CUDA, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
            for _ in range(2))
    grad_out = torch.randn((2, 2048, 24 * 128), device=CUDA, dtype=torch.bfloat16, generator=gen)
    mask = None
    if packed:  # four examples of 512 tokens a row, the dense mask (deterministic steps keep SDPA: functional.py)
        segments = torch.arange(2048, device=CUDA).div(512, rounding_mode="floor").expand(2, -1)
        mask = fn.segment_mask(segments, torch.bfloat16)
    fn.attend(q, k, v, cfg, mask).backward(grad_out)
    ids = torch.randint(0, 128, (2, 2048), device=CUDA, generator=gen)
    grad_embed = torch.zeros(512, 3072, device=CUDA)
    fn.embed_backward(grad_embed, ids, torch.randn(2, 2048, 3072, device=CUDA, dtype=torch.bfloat16, generator=gen))
    return [q.grad, k.grad, v.grad, grad_embed]


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_the_step_mode_makes_the_racing_backward_reductions_bit_exact(packed):
    """The reductions that use atomics by default (determinism.py) give the same bits twice under
    ``deterministic_kernels``; with it off at least one of them usually differs (not asserted)."""
    from tandem.shared.train.determinism import deterministic_kernels, fix_cublas_workspace

    fix_cublas_workspace()
    with deterministic_kernels(True):
        first, second = _attention_and_embedding_grads(packed), _attention_and_embedding_grads(packed)
    names = ["dQ", "dK", "dV", "embedding"]
    differing = [name for name, a, b in zip(names, first, second) if not torch.equal(a, b)]
    assert not differing, f"deterministic kernels still gave different bits for {differing}"
    assert not torch.are_deterministic_algorithms_enabled(), "the mode must be put back after the block"
