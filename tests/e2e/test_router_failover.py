"""A worker that is alive (heartbeating) but does not take a request in time is not dropped.

Placing the request elsewhere could run it twice (the slow worker may still take it), so the
router fails that one request with a typed timeout and keeps the worker. A worker that is gone
(no responders) is still dropped and the request placed on another.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from cli_support import launch, service_env

from tandem.client import NoWorkersError, RequestTimeoutError, connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.fleet import Heartbeat

SILENT = "decode-silent"
VANISHED = "decode-vanished"


async def fake_decode_worker(url: str, name: str, answers_alive: bool) -> tuple[nats.NATS, asyncio.Task, list]:
    """Heartbeats of a decode worker whose admit subject takes messages and never answers; its
    alive subject answers when ``answers_alive`` (a live but stuck process), else not (a request
    delivered in the instant the process died)."""
    nc = await nats.connect(url)
    admits: list = []

    async def take(msg) -> None:
        admits.append(msg)

    async def alive(msg) -> None:
        await msg.respond(b"ok")

    await nc.subscribe(subjects.decode_admit(name), cb=take)
    if answers_alive:
        await nc.subscribe(subjects.alive("decode", name), cb=alive)
    beat = Heartbeat(service="decode", instance_id=name, host="test", pid=1, model="tiny", num_blocks=64,
                     free_blocks=64, max_model_len=2048)

    async def beating() -> None:
        while True:
            await nc.publish(subjects.heartbeat("decode", name), encode(beat))
            await asyncio.sleep(0.2)

    return nc, asyncio.create_task(beating()), admits


@pytest.fixture
async def silent_decode_worker(nats_server):
    nc, task, admits = await fake_decode_worker(nats_server.url, SILENT, answers_alive=True)
    yield admits
    task.cancel()
    await nc.close()


@pytest.fixture
async def vanished_decode_worker(nats_server):
    nc, task, admits = await fake_decode_worker(nats_server.url, VANISHED, answers_alive=False)
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


async def test_a_worker_that_died_with_the_request_is_dropped_within_a_second(nats_server, vanished_decode_worker,
                                                                              tmp_path):
    """The request reached the worker's subscription as its process died (so no "no responders"):
    its alive subject finds it gone, and the router drops it within about a second, instead of
    waiting out the 10 s forward timeout. With no restart wait (the router would otherwise hold the
    request for a restarted worker, tests/unit/router/test_owner_and_restart.py), it then fails."""
    router = launch(nats_server.url, "router", "router-vanished", tmp_path, service_env(tmp_path),
                    ["--router-restart-wait-s", "0"])
    try:
        async with connect(nats_server.url, request_timeout_s=20) as client:
            for _ in range(150):  # until the router is up and has heard the worker's heartbeat
                if vanished_decode_worker:
                    break
                try:
                    await client.complete("hello", max_tokens=4)
                except NoWorkersError:
                    await asyncio.sleep(0.1)
            assert vanished_decode_worker, "the router never forwarded a request to the worker"
            await asyncio.sleep(0.6)  # its next heartbeats make the router take it back
            vanished_decode_worker.clear()
            started = time.monotonic()
            with pytest.raises(NoWorkersError, match="no decode worker"):
                await client.complete("hello", max_tokens=4)
            took = time.monotonic() - started
        assert len(vanished_decode_worker) == 1, f"forwarded {len(vanished_decode_worker)} times, not once"
        assert took < 2.5, f"{took:.1f}s to give up on a worker gone, not about a second"
    finally:
        router.terminate()
        router.wait(10)
