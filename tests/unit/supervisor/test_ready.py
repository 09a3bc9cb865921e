"""Readiness and URLs against a real nats-server, with stand-in services registered in this process:
``wait_until_ready`` waits for heartbeats from the workers but not from the frontend (it sends
none), by count or for the instances it names (others on the bus do not stand in), and
``Supervisor.read_urls`` takes each child's ``metrics_url`` and the frontend's ``http_url`` from
``$SRV.INFO`` metadata, naming the children that have not answered yet.

Run: ``python3 -m pytest -q tests/unit/supervisor/test_ready.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import nats
import pytest
from nats.micro import add_service
from nats.micro.service import ServiceConfig

from tandem.cli.supervisor import Child, Supervisor, wait_until_ready
from tandem.shared.infra.config import Settings
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.fleet import Heartbeat


@pytest.fixture
async def register(nats_server):
    """``await register(service, instance_id, beats=..., **metadata)``: one stand-in micro service on
    its own connection, heartbeating every 0.1 s if ``beats``; all removed at teardown."""
    connections: list[nats.NATS] = []
    beating: list[asyncio.Task] = []

    async def add(service: str, instance_id: str, beats: bool = False, **metadata: str) -> None:
        nc = await nats.connect(nats_server.url)
        connections.append(nc)
        await add_service(nc, ServiceConfig(name=f"tandem-{service}", version="0.0.0",
                                            metadata={"instance_id": instance_id, **metadata}))
        if beats:
            beat = Heartbeat(service=service, instance_id=instance_id, host="h", pid=os.getpid(), model="tiny")

            async def loop() -> None:
                while True:
                    await nc.publish(subjects.heartbeat(service, instance_id), encode(beat))
                    await asyncio.sleep(0.1)
            beating.append(asyncio.create_task(loop()))

    yield add
    for task in beating:
        task.cancel()
    await asyncio.gather(*beating, return_exceptions=True)
    for nc in connections:
        await nc.close()


def never_dies() -> None:
    pass


async def test_the_frontend_and_the_router_need_no_heartbeat(nats_server, register):
    await register("router", "router-t1")
    await register("frontend", "frontend-t1", http_url="http://127.0.0.1:1/")
    await register("decode", "decode-t1", beats=True)
    await asyncio.wait_for(wait_until_ready(nats_server.url, {"router": 1, "frontend": 1, "decode": 1}, never_dies,
                                            timeout_s=10), 15)


async def test_a_worker_without_heartbeats_is_not_ready(nats_server, register):
    await register("prefill", "prefill-t2")  # answers PING, never beats
    with pytest.raises(RuntimeError, match="only 0 of 1 workers send heartbeats"):
        await wait_until_ready(nats_server.url, {"prefill": 1}, never_dies, timeout_s=2)


async def test_instances_named_are_not_stood_in_for_by_others_on_the_bus(nats_server, register):
    """Another system's router and decode worker answer and beat; waiting by name for new ones
    is not satisfied by them, nor by a new worker that answers PING but has not beaten yet."""
    await register("router", "router-old")
    await register("decode", "decode-old", beats=True)
    want = {"router": ["router-new"], "decode": ["decode-new"]}
    with pytest.raises(RuntimeError, match="services not ready"):
        await wait_until_ready(nats_server.url, want, never_dies, timeout_s=1.5)
    await register("router", "router-new")
    await register("decode", "decode-new")  # answers PING, no heartbeat yet
    with pytest.raises(RuntimeError, match="only 0 of 1 workers send heartbeats"):
        await wait_until_ready(nats_server.url, want, never_dies, timeout_s=2)
    await register("decode", "decode-new", beats=True)  # a second registration of the id, beating
    await asyncio.wait_for(wait_until_ready(nats_server.url, want, never_dies, timeout_s=10), 15)


@pytest.fixture
def sleepers():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


async def read_until(sup: Supervisor, nc: nats.NATS, missing: list[str], timeout_s: float = 10.0) -> list[str]:
    """``sup.read_urls`` again until it reports ``missing`` (or the timeout): one read waits 0.3 s for
    the ``$SRV.INFO`` answers, which a loaded machine can miss, and the supervisor reads until none
    is missing anyway."""
    deadline = time.monotonic() + timeout_s
    while (got := await sup.read_urls(nc)) != missing and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return got


async def test_urls_come_from_the_children_metadata(nats_server, register, sleepers):
    sup = Supervisor(Settings(), frontend=True, gpus=[])
    sup.children = [Child("decode", sleepers[0], "decode-t3"), Child("frontend", sleepers[1], "frontend-t3"),
                    Child("router", sleepers[2], "router-t3")]
    await register("decode", "decode-t3", metrics_url="http://127.0.0.1:9100/metrics")
    await register("frontend", "frontend-t3", metrics_url="http://127.0.0.1:9101/metrics",
                   http_url="http://127.0.0.1:8000")
    await register("decode", "decode-someone-elses", metrics_url="http://127.0.0.1:9999/metrics")
    nc = await nats.connect(nats_server.url)
    try:
        assert await read_until(sup, nc, ["router-t3"]) == ["router-t3"], "the router has not registered yet"
        assert sup.http_url == "http://127.0.0.1:8000"
        assert sup.metrics_urls == {"decode-t3": "http://127.0.0.1:9100/metrics",
                                    "frontend-t3": "http://127.0.0.1:9101/metrics"}, "only this supervisor's children"
        await register("router", "router-t3", metrics_url="http://127.0.0.1:9102/metrics")
        assert await read_until(sup, nc, []) == []
        assert list(sup.metrics_urls) == ["decode-t3", "frontend-t3", "router-t3"], "in the children's order"
        sleepers[0].kill()
        sleepers[0].wait()
        assert await read_until(sup, nc, []) == [] and "decode-t3" not in sup.metrics_urls, "a dead child's URL goes"
    finally:
        await nc.close()
