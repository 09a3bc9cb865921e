"""The console's connection follows a restarted ``tandem up``: started without a URL it reads the
up's state file, and when that ``up`` is replaced by one on another port (its state file rewritten)
it connects there and starts afresh; while the bus is gone the rows of live services are cleared;
with no ``up`` running it says it waits for one. A console given an explicit URL keeps to it.

Real nats-servers (two, one after the other) with stand-in services registered in this process;
the data source runs without the app (it only fills a ``ConsoleState``), the status line is drawn
from that state. Run: ``python3 -m pytest -q tests/unit/console/test_console_follow.py``.
"""

from __future__ import annotations

import asyncio
import os
import time

import nats
import pytest
from nats.micro import add_service
from nats.micro.service import ServiceConfig

from tandem.client.runstate import RunState, state_file, write_state
from tandem.console.screens.base import status_text
from tandem.console.source import NatsSource
from tandem.console.state import ConsoleState
from tandem.shared.infra.natsserver import NatsServer


async def until(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def instances(state: ConsoleState) -> set[str]:
    return {row.instance_id for row in state.services}


@pytest.fixture
async def servers():
    """``await start()`` -> a fresh nats-server with one stand-in service registered on it; every
    server and connection is stopped at teardown."""
    started: list[tuple[NatsServer, nats.NATS]] = []

    async def start(service: str, instance_id: str) -> NatsServer:
        server = NatsServer.start(jetstream=False)
        nc = await nats.connect(server.url, allow_reconnect=False)
        await add_service(nc, ServiceConfig(name=f"tandem-{service}", version="0.0.0",
                                            metadata={"instance_id": instance_id, "host": "h"}))
        started.append((server, nc))
        return server

    yield start
    for server, nc in started:
        if not nc.is_closed:
            await nc.close()
        server.stop()


@pytest.fixture
async def sources():
    """``watch(source)`` -> the state it fills, running until teardown."""
    running: list[NatsSource] = []

    async def watch(source: NatsSource) -> ConsoleState:
        state = ConsoleState()
        await source.start(state)
        running.append(source)
        return state

    yield watch
    for source in running:
        await source.stop()


@pytest.mark.slow  # two nats-servers, one lost and waited for: 6 s on 2 cores
async def test_the_console_follows_a_restarted_up_and_an_explicit_url_stays(tmp_path, servers, sources):
    first = await servers("router", "router-first")
    # The state file of a running up: this process's pid stands for the up (find_running wants it alive).
    write_state(tmp_path, RunState(pid=os.getpid(), nats_url=first.url))
    follower = await sources(NatsSource(None, follow=tmp_path))
    fixed = await sources(NatsSource(first.url))
    for state in (follower, fixed):
        await until(lambda s=state: s.connection == "connected" and instances(s) == {"router-first"},
                    "both consoles to see the first system")
    assert follower.url == first.url

    first.stop()  # the up is gone, and its bus with it
    for state in (follower, fixed):
        await until(lambda s=state: s.connection == "unreachable", "the lost connection to be noticed")
        assert state.services == [] and not state.discovered, "stale rows outlived the bus"

    second = await servers("decode", "decode-second")
    assert second.url != first.url
    write_state(tmp_path, RunState(pid=os.getpid(), nats_url=second.url))  # a new up on another port
    await until(lambda: follower.url == second.url and follower.connection == "connected"
                and instances(follower) == {"decode-second"}, "the follower to reach the new up")
    assert status_text(follower, False, "").plain.startswith(f"● connected {second.url}")

    await asyncio.sleep(2.5)  # longer than a follow round and a discovery round
    assert fixed.url == first.url and fixed.connection == "unreachable" and fixed.services == [], \
        "an explicit --nats-url must not be swapped for the state file's"

    state_file(tmp_path).unlink()  # that up stopped too
    await until(lambda: follower.connection == "no-url", "the follower to notice no up runs")
    line = status_text(follower, False, "").plain
    assert f"no `tandem up` running on data dir {tmp_path}: waiting for one" in line, line
    assert follower.services == []


async def test_a_state_file_of_a_dead_up_is_not_followed(tmp_path, servers, sources):
    server = await servers("router", "router-dead")
    dead = 2 ** 22 + 12345  # above the usual pid_max: no such process
    write_state(tmp_path, RunState(pid=dead, nats_url=server.url))
    state = await sources(NatsSource(None, follow=tmp_path))
    await until(lambda: state.connection == "no-url", "the follower to find no running up")
    await asyncio.sleep(0.5)
    assert state.url is None and state.services == [], "it connected to what a dead up's file names"
    write_state(tmp_path, RunState(pid=os.getpid(), nats_url=server.url))
    await until(lambda: state.connection == "connected" and instances(state) == {"router-dead"},
                "the follower to pick up an up that appears later")
