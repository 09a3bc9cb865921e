"""The console's view of LoRA adapters: a worker's heartbeats give its slots and the names (versions
dropped) of the adapters in its slots and in host memory; a beat that changes nothing redraws
nothing; the NATS source follows the heartbeats of the bus and forgets a worker discovery no longer
finds. The panes' pictures are in test_console_snapshots.py.

Run: ``python3 -m pytest -q tests/unit/console/test_console_adapters.py``.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.micro import add_service
from nats.micro.service import ServiceConfig

from tandem.console.source import NatsSource
from tandem.console.state import ConsoleState, WorkerAdapters, adapter_name
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.fleet import Heartbeat


def beat(instance_id: str, max_loras: int = 4, resident: tuple[str, ...] = (), host: tuple[str, ...] = ()) -> Heartbeat:
    return Heartbeat(service="decode", instance_id=instance_id, host="h", pid=1, model="tiny", max_loras=max_loras,
                     max_lora_rank=16 if max_loras else 0, adapters_resident=list(resident), adapters_host=list(host))


def test_names_lose_their_version_and_the_summary_counts_the_slots() -> None:
    assert adapter_name("sql-lora@3f9a") == "sql-lora" and adapter_name("team@sql@v2") == "team@sql"
    adapters = WorkerAdapters.of(beat("d", resident=("sql@1", "chat@2"), host=("sql@1", "chat@2", "old@9")))
    assert adapters == WorkerAdapters(4, ("sql", "chat"), ("sql", "chat", "old"))
    assert adapters.summary() == "2/4 chat,sql", "most recently used first"
    assert WorkerAdapters.of(beat("d", max_loras=0)).summary() == "-"
    assert WorkerAdapters(2).summary() == "0/2"


def test_only_a_beat_that_changes_the_adapters_redraws() -> None:
    state = ConsoleState()
    state.add_heartbeat(beat("d", resident=("sql@1",)))
    version = state.version
    state.add_heartbeat(beat("d", resident=("sql@1",)))
    assert state.version == version
    state.add_heartbeat(beat("d", resident=("sql@2",)))  # a new version of the same name: the same picture
    assert state.version == version
    state.add_heartbeat(beat("d", resident=("sql@2", "chat@1")))
    assert state.version > version and state.adapters["d"].resident == ("sql", "chat")
    state.forget_live()
    assert state.adapters == {}


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.slow  # waits out a worker's heartbeats, ~3 s
async def test_the_source_follows_heartbeats_and_forgets_a_worker_gone(nats_server) -> None:
    worker = await nats.connect(nats_server.url)
    service = await add_service(worker, ServiceConfig(name="tandem-decode", version="0.0.0",
                                                      metadata={"instance_id": "decode-lora", "host": "h"}))
    source, state = NatsSource(nats_server.url), ConsoleState()
    await source.start(state)
    try:
        await until(lambda: any(r.instance_id == "decode-lora" for r in state.services), "discovery")
        payload = encode(beat("decode-lora", resident=("sql@1",), host=("sql@1",)))
        await worker.publish(subjects.heartbeat("decode", "decode-lora"), payload)
        await until(lambda: "decode-lora" in state.adapters, "the heartbeat")
        assert state.adapters["decode-lora"].summary() == "1/4 sql"
        await service.stop()
        await until(lambda: "decode-lora" not in state.adapters, "the worker forgotten")
    finally:
        await source.stop()
        await worker.close()
