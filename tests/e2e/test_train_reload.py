"""Hot weight reload end to end: a decode worker serving ``tiny`` gets a ``WeightsUpdated`` while a
long request is in flight; that request finishes on the old weights, later requests match the new
weights' reference output, and the worker's KV namespace carries the weights version.

Run: ``python -m pytest -q tests/e2e/test_train_reload.py``.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from support import flushed, worker_beats

from tandem.client import connect
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.loader import build_random_model, load_model, save_hf_checkpoint
from tandem.shared.model.meta import load_model_meta
from tandem.shared.model.reference import reference_generate
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.training import WeightsUpdated

PROMPT = "def walk(self):\n    "
LONG, SHORT = 400, 24


@pytest.fixture(scope="module")
def solo(start_system):
    return start_system(prefill=0, decode=1)


@pytest.fixture(scope="module")
def weights(data_dir):
    """The served tiny model's reference outputs, and a new checkpoint with its own (in the data dir,
    where a trainer writes: a worker loads weights from nowhere else)."""
    old = load_model("tiny")
    path = save_hf_checkpoint(build_random_model(ModelConfig.tiny(), seed=77), ModelConfig.tiny(),
                              data_dir / "train" / "new-weights" / "tiny")
    new = load_model(str(path))
    ids = old.tokenizer.encode(PROMPT)
    old_long, _ = reference_generate(old.model, ids, LONG)
    old_short, new_short = reference_generate(old.model, ids, SHORT)[0], reference_generate(new.model, ids, SHORT)[0]
    assert old_short != new_short
    return path, list(old_long), list(new_short)


async def namespaces(url: str) -> list[str]:
    return [b.kv_namespace for b in (await worker_beats(url, 0.4)).values() if b.service == "decode"]


@pytest.mark.slow  # 10 s: a training job and a reload under load
async def test_in_flight_finishes_on_old_weights_new_requests_use_new(solo, weights):
    path, old_long, new_short = weights
    before = await namespaces(solo.url)
    served = load_model_meta("tiny").weights_id()  # the shipped checkpoint (the data dir holds none)
    assert before and all(ns.startswith(f"tiny@{served}/") for ns in before), before
    nc = await nats.connect(solo.url)
    # A path outside the data dir is ignored (anyone on the bus could name any folder).
    outside = save_hf_checkpoint(build_random_model(ModelConfig.tiny(), seed=78), ModelConfig.tiny(),
                                 path.parents[3] / "outside-weights")
    await nc.publish(subjects.WEIGHTS_UPDATED,
                     encode(WeightsUpdated(model="tiny", path=str(outside), step=1, version="evil")))
    # An event for another model is ignored.
    await nc.publish(subjects.WEIGHTS_UPDATED,
                     encode(WeightsUpdated(model="other", path=str(path), step=1, version="x")))
    update = WeightsUpdated(model="tiny", path=str(path), step=1, version="job-1.1")
    tokens: list[int] = []
    published_at = finished_at = None
    async with connect(solo.url) as client:
        async for chunk in client.generate(PROMPT, max_tokens=LONG, temperature=0.0, ignore_eos=True):
            tokens += chunk.token_ids
            if published_at is None:
                await nc.publish(subjects.WEIGHTS_UPDATED, encode(update))
                await flushed(nc)
                published_at = time.monotonic()
        finished_at = time.monotonic()
        assert len(tokens) < LONG or finished_at > published_at
        assert tokens == old_long, "the request in flight at the reload must finish on the old weights"

        deadline = time.monotonic() + 30
        while not all("tiny@job-1.1/" in ns for ns in await namespaces(solo.url)):
            assert time.monotonic() < deadline, f"the worker never reported the new weights version\n{solo.logs()}"
            await asyncio.sleep(0.2)
        result = await client.complete(PROMPT, max_tokens=SHORT, temperature=0.0, ignore_eos=True)
    await nc.close()
    assert result.token_ids == new_short, "a request after the reload must use the new weights"
