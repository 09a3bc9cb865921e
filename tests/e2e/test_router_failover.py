"""A worker that is alive (heartbeating) but does not take a request in time is not dropped.

Placing the request elsewhere could run it twice (the slow worker may still take it), so the
router fails that one request with a typed timeout and keeps the worker. A worker that is gone
(no responders) is still dropped and the request placed on another.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from cli_support import launch, service_env

from tandem.client import NoWorkersError, RequestTimeoutError, connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.fleet import Heartbeat

SILENT = "decode-silent"


@pytest.fixture
async def silent_decode_worker(nats_server):
    """Heartbeats of a decode worker whose admit subject takes messages and never answers."""
    nc = await nats.connect(nats_server.url)
    admits: list = []

    async def take(msg) -> None:
        admits.append(msg)

    await nc.subscribe(subjects.decode_admit(SILENT), cb=take)
    beat = Heartbeat(service="decode", instance_id=SILENT, host="test", pid=1, model="tiny", num_blocks=64,
                     free_blocks=64, max_model_len=2048)

    async def beating() -> None:
        while True:
            await nc.publish(subjects.heartbeat("decode", SILENT), encode(beat))
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beating())
    yield admits
    task.cancel()
    await nc.close()


async def test_slow_but_alive_worker_fails_the_request_and_stays(nats_server, silent_decode_worker, tmp_path):
    env = {**service_env(tmp_path), "TANDEM_FORWARD_TIMEOUT_S": "1"}
    router = launch(nats_server.url, "router", "router-failover", tmp_path, env, [])
    try:
        async with connect(nats_server.url, request_timeout_s=20) as client:
            for _ in range(150):  # until the router is up and has heard the worker's heartbeat
                try:
                    await client.complete("hello", max_tokens=4)
                except NoWorkersError:
                    await asyncio.sleep(0.1)
                except RequestTimeoutError:
                    break
            silent_decode_worker.clear()
            for attempt in range(2):
                with pytest.raises(RequestTimeoutError, match="did not take the request"):
                    await client.complete("hello", max_tokens=4)
                assert len(silent_decode_worker) == attempt + 1, "the same live worker was asked again"
    finally:
        router.terminate()
        router.wait(10)
