"""Host helpers next to a running engine never wait for the work queued on its GPU stream.

With overlapped decode steps the stream always holds the next step, so a helper that synchronizes
it (a blocking ``torch.tensor(..., device=cuda)``, a ``.cpu()``) stalls the engine for a whole
step. These GPU tests (``-m gpu``) queue a long sleep on the stream and check, with an event rather
than a clock, that sampling returned while the sleep was still running, and that KV blocks reach
the host intact through the side-stream copy.

Run: ``python -m pytest -m gpu tests/test_gpu_streams.py``.
"""

from __future__ import annotations

import pytest
import torch

from tandem.shared.engine import SamplingParams
from tandem.shared.engine.sampling import sample
from tandem.shared.kvcache.cache import to_host

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 2_000_000_000  # about a second of one SM's clock: far longer than sampling's launches

PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top-k-top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "seeded": SamplingParams(temperature=1.0, seed=3),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_sampling_does_not_wait_for_queued_work(kind: str) -> None:
    logits = torch.randn(8, 32000, device="cuda")
    params = [PARAMS[kind], PARAMS["greedy"]] * 4
    sample(logits, params, list(range(8)))  # warm-up: kernels, pinned host blocks
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    queued = torch.cuda.Event()
    queued.record()
    ids = sample(logits, params, list(range(8)))
    still_running = not queued.query()
    torch.cuda.synchronize()
    assert still_running, f"sample() with {kind} rows waited for the work queued before it"
    assert ids.shape == (8,) and bool(((ids >= 0) & (ids < 32000)).all())


def test_to_host_copies_blocks_intact_into_pinned_memory() -> None:
    blocks = torch.randn(6, 4, 2, 16, 8, 64, device="cuda", dtype=torch.bfloat16)
    host = to_host(blocks)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, blocks.cpu()), "to_host changed the bytes"
