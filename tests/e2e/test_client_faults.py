"""The client library when things go wrong around it: the bus goes away (a stopping ``tandem up``),
a loop is left early while the client stays connected. Real nats-servers; the router is a few lines
answering on its subject, which is all the client sees of one."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from support import prompt_of

from tandem.client import ConnectionLostError, TandemError, connect
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import Cancel, GenerateAccepted, GenerateRequest


@pytest.fixture
def private_server():
    server = NatsServer.start()
    yield server
    server.stop()


async def accepting_router(url: str) -> nats.NATS:
    """Accepts every request and streams nothing: the request stays in flight."""
    nc = await nats.connect(url)

    async def on_generate(msg) -> None:
        request = decode(msg.data, GenerateRequest)
        await msg.respond(encode(GenerateAccepted(request_id=request.request_id, prompt_token_ids=[1, 2],
                                                  prefill_worker=None, decode_worker="decode-x")))

    await nc.subscribe(subjects.ROUTER_GENERATE, cb=on_generate)
    return nc


async def test_the_bus_going_away_mid_stream_is_a_typed_error(private_server):
    router = await accepting_router(private_server.url)
    async with connect(private_server.url, worker_timeout_s=60) as client:
        stream = client.generate("hello", max_tokens=4)
        await stream.__aenter__()
        await router.close()
        started = time.monotonic()
        private_server.stop()
        with pytest.raises(ConnectionLostError, match="lost the connection to NATS"):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 5, "the stream should fail as soon as the connection drops"
        with pytest.raises(TandemError):  # and so does the next request, typed, not nats-py's own error
            await client.complete("again", max_tokens=2)


async def test_connect_to_nothing_is_one_typed_line():
    with pytest.raises(TandemError, match="cannot reach NATS at nats://127.0.0.1:1") as caught:
        async with connect("nats://127.0.0.1:1"):
            pass
    assert "\n" not in str(caught.value)


async def test_connect_with_no_url_and_no_running_up_says_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_NATS_URL", raising=False)
    with pytest.raises(TandemError, match="tandem up"):
        async with connect():
            pass


async def test_breaking_out_sends_the_cancel_at_once_while_connected(start_system):
    """No waiting for the workers' liveness probe: every stream left by ``break`` is cancelled
    within a moment, while the client stays connected and subscribed to nothing else."""
    system = start_system(prefill=0, decode=1)
    watcher = await nats.connect(system.url)
    cancels: list[str] = []

    async def on_cancel(msg) -> None:
        cancels.append(decode(msg.data, Cancel).request_id)

    await watcher.subscribe(subjects.CANCEL, cb=on_cancel)
    await watcher.flush()
    try:
        async with connect(system.url) as client:
            ids = [f"leave-{i}" for i in range(6)]
            for request_id in ids:
                async for _ in client.generate(prompt_of(20), max_tokens=500, temperature=0.0, ignore_eos=True,
                                               request_id=request_id):
                    break
            deadline = time.monotonic() + 1.0
            while set(cancels) != set(ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert sorted(cancels) == sorted(ids), f"cancels seen within 1 s while connected: {cancels}"
    finally:
        await watcher.close()


async def test_only_the_owner_can_cancel_a_request(start_system):
    """The routing decisions anyone may read name every request id; a cancel must also name the
    request's stream subject, which holds its client's random id. A forged one changes nothing."""
    system = start_system(prefill=0, decode=1)
    attacker = await nats.connect(system.url)
    try:
        async with connect(system.url) as client:
            tokens = []
            async for chunk in client.generate(prompt_of(20), max_tokens=40, temperature=0.0, ignore_eos=True,
                                               request_id="victim-1"):
                if not tokens:
                    for forged in ("_INBOX.tandem.attacker.victim-1", "victim-1"):
                        await attacker.publish(subjects.CANCEL, encode(Cancel(request_id="victim-1",
                                                                              stream_subject=forged)))
                    await attacker.flush()
                tokens += chunk.token_ids
        assert len(tokens) == 40, f"a forged cancel stopped the request after {len(tokens)} tokens"
    finally:
        await attacker.close()
