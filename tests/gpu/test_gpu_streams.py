"""Host helpers next to a running engine never wait for the work queued on its GPU stream.

With overlapped decode steps the stream always holds the next step, so a helper that synchronizes
it (a blocking ``torch.tensor(..., device=cuda)``, a ``.cpu()``) stalls the engine for a whole
step (``shared/kvtransfer/devcopy.py``). These GPU tests (``-m gpu``) queue a long sleep on the stream and
check, with an event rather than a clock, that sampling and whole-block export/import returned
while the sleep was still running, and that KV blocks reach the host intact through ``to_host``.

Run: ``python -m pytest -m gpu tests/gpu/test_gpu_streams.py``.
"""

from __future__ import annotations

import pytest
import torch

from tandem.shared.engine.sampling import sample
from tandem.shared.kvcache.cache import gather_blocks, scatter_blocks
from tandem.shared.kvtransfer.devcopy import to_host
from tandem.shared.protocol.serving import SamplingParams

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
    ids: list[torch.Tensor] = []
    still_running = returned_while_queued_work_ran(lambda: ids.append(sample(logits, params, list(range(8)))))
    assert still_running, f"sample() with {kind} rows waited for the work queued before it"
    assert ids[0].shape == (8,) and bool(((ids[0] >= 0) & (ids[0] < 32000)).all())


def returned_while_queued_work_ran(call) -> bool:  # noqa: ANN001
    """Queue a long sleep, then ``call()``: True when it returned before the sleep ended."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    queued = torch.cuda.Event()
    queued.record()
    call()
    still_running = not queued.query()
    torch.cuda.synchronize()
    return still_running


@pytest.mark.parametrize("move", ["gather", "scatter"])
def test_block_export_and_import_do_not_wait_for_queued_work(move: str) -> None:
    cache = torch.zeros(8, 2, 2, 16, 2, 64, device="cuda")
    blocks = torch.randn(2, 2, 2, 16, 2, 64, device="cuda")
    call = ((lambda: gather_blocks(cache, [1, 3])) if move == "gather"
            else (lambda: scatter_blocks(cache, [1, 3], blocks)))
    call()  # warm-up: kernels, pinned host blocks
    assert returned_while_queued_work_ran(call), f"{move}_blocks waited for the work queued before it"
    if move == "scatter":
        assert torch.equal(cache[[1, 3]], blocks)


def test_to_host_copies_blocks_intact_into_pinned_memory() -> None:
    blocks = torch.randn(6, 4, 2, 16, 8, 64, device="cuda", dtype=torch.bfloat16)
    host = to_host(blocks)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, blocks.cpu()), "to_host changed the bytes"
