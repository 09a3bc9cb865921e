"""Swapping on CUDA: blocks go to pinned host memory and back bit-exact without the host waiting for
the stream, and the engine with its CUDA defaults (decode graphs, overlapped steps, async output)
gives the same tokens under a pool small enough to preempt, swapping or recomputing, as under a
roomy one. The tiny model (its trained checkpoint) in float32, so batches of other sizes cannot
flip a greedy token the way bf16 rounding can (see test_gpu_parity.py).

Run: ``python -m pytest -m gpu tests/gpu/test_swapping_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from factories import greedy, make_engine, make_prompts, make_request, run

from tandem.shared.kvcache.swap_space import GIB
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SWAP_GIB = 64 * 4 * 2 * 16 * 4 * 32 * 4 / GIB  # 64 blocks of the tiny model in float32
SLEEP_CYCLES = 2_000_000_000  # about a second of one SM's clock


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny", device="cuda", dtype=torch.float32)


def workload() -> list:
    requests = []
    for i, prompt in enumerate(make_prompts()):
        params = (greedy(24 + 2 * i) if i % 2 else
                  SamplingParams(max_tokens=24 + 2 * i, temperature=1.0, top_k=40, seed=i, ignore_eos=True))
        requests.append(make_request(f"r{i}", prompt, params=params))
    return requests


def test_blocks_round_trip_through_pinned_memory_without_waiting(tiny_cuda) -> None:
    engine = make_engine(tiny_cuda, device="cuda", num_blocks=16, swap_space_gib=SWAP_GIB, enforce_eager=True)
    runner = engine.runner
    assert runner.swap_space.kv.is_pinned() and runner.swap_space.kv.device.type == "cpu"
    swapped_out = torch.tensor([1, 2, 9], device="cuda")  # made now: a host list would be copied, waiting
    runner.swap_out([(0, 7)])  # warm-up: kernels loaded, the copy engines' paths set up
    runner.swap_in([(15, 7)])
    runner.kv_cache.index_fill_(0, swapped_out, 0.0)
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the copies queue behind it; the host must not wait for it
    queued = torch.cuda.Event()
    queued.record()
    runner.swap_out([(1, 0), (2, 1), (9, 5)])
    runner.kv_cache.index_fill_(0, swapped_out, 0.0)  # queued after the copies, which read the old contents
    runner.swap_in([(3, 0), (4, 1), (12, 5)])
    still_running = not queued.query()
    torch.cuda.synchronize()
    assert still_running, "a swap waited for the work queued before it"
    assert torch.equal(runner.kv_cache[[3, 4, 12]], before[[1, 2, 9]]), "the K/V changed on the way"
    assert torch.equal(runner.kv_cache[[1, 2, 9]], torch.zeros_like(before[[1, 2, 9]]))


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_tiny_pool_matches_roomy_pool_on_cuda(tiny_cuda, mode: str, caching: bool) -> None:
    roomy = make_engine(tiny_cuda, device="cuda", budget=64, caching=caching)
    expected = run(roomy, workload())
    assert roomy.stats()["preemptions"] == 0 and roomy.runner.graphs is not None and roomy.overlap_steps
    engine = make_engine(tiny_cuda, device="cuda", num_blocks=8, budget=64, caching=caching,
                         swap_space_gib=SWAP_GIB, preemption_mode=mode)
    got = run(engine, workload())
    stats = engine.stats()
    assert stats["preemptions"] > 0
    if mode == "swap":
        assert stats["swaps"] == stats["preemptions"]
    elif mode == "recompute":
        assert stats["swaps"] == 0
    for request_id, result in expected.items():
        assert got[request_id].tokens == result.tokens, f"{request_id} diverged ({mode})"
    assert stats["swapped"] == 0 and stats["free_swap_blocks"] == stats["swap_blocks"]
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)
    assert engine.num_overlapped_steps > 0, "steps are still queued ahead while nothing is swapped"
