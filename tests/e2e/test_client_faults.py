"""The client library when things go wrong around it: the bus goes away (a stopping ``tandem up``)
or is restarted under a stream, the router holding a placement dies before answering, a loop is
left early while the client stays connected. Real nats-servers; the router is a few lines
answering on its subject, which is all the client sees of one."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from support import flushed, prompt_of

from tandem.client import ConnectionLostError, TandemError, WorkerFailureError, connect
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import Cancel, GenerateAccepted, GenerateRequest, PlacementReceived, StreamChunk


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

    await nc.subscribe(subjects.ROUTER_GENERATE_ALL, cb=on_generate)
    return nc


async def test_the_bus_going_away_mid_stream_is_a_typed_error(private_server):
    router = await accepting_router(private_server.url)
    async with connect(private_server.url, worker_timeout_s=60, reconnect_s=1) as client:
        stream = client.generate("hello", max_tokens=4)
        await stream.__aenter__()
        await router.close()
        started = time.monotonic()
        private_server.stop()
        with pytest.raises(ConnectionLostError, match="lost the connection to NATS"):
            async for _ in stream:
                pass
        took = time.monotonic() - started
        assert took < 1 + 4, f"the stream should fail once reconnect_s (1 s) has passed, not after {took:.1f}s"
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


@pytest.mark.slow  # 4 s; break out of a stream cancels in tests/unit/client/test_stream_lifetime.py by default
async def test_breaking_out_sends_the_cancel_at_once_while_connected(start_system):
    """No waiting for the workers' liveness probe: every stream left by ``break`` is cancelled
    within a moment, while the client stays connected and subscribed to nothing else."""
    system = start_system(prefill=0, decode=1)
    watcher = await nats.connect(system.url)
    cancels: list[str] = []

    async def on_cancel(msg) -> None:
        cancels.append(decode(msg.data, Cancel).request_id)

    await watcher.subscribe(subjects.CANCEL_ALL, cb=on_cancel)
    await flushed(watcher)
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
                    for owner, forged in (("attacker", "_INBOX.attacker.x.victim-1"),
                                          (client.owner, f"_INBOX.{client.owner}.attacker.victim-1"),
                                          (client.owner, "victim-1")):
                        await attacker.publish(subjects.cancel(owner), encode(Cancel(request_id="victim-1",
                                                                                     stream_subject=forged)))
                    await flushed(attacker)
                tokens += chunk.token_ids
        assert len(tokens) == 40, f"a forged cancel stopped the request after {len(tokens)} tokens"
    finally:
        await attacker.close()


def position_token(position: int) -> int:
    """The token a counting router streams at output position ``position``: a request's output is
    fixed by position alone, as a seeded one is, so a resumed stream can be checked exactly."""
    return 10 + position % 200


async def counting_router(url: str, requests: list[GenerateRequest], every_s: float = 0.02) -> nats.NATS:
    """Accepts every request and streams ``max_tokens`` tokens one by one from where the request
    resumes, on a connection that reconnects for ever (as a worker's does)."""
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    tasks: set[asyncio.Task] = set()

    async def stream(request: GenerateRequest) -> None:
        start = len(request.resume_output_token_ids)
        for position in range(start, request.params.max_tokens):
            finish = "length" if position + 1 == request.params.max_tokens else None
            await nc.publish(request.stream_subject, encode(StreamChunk(
                request_id=request.request_id, index=position, token_ids=[position_token(position)],
                text="x", finish_reason=finish)))
            await asyncio.sleep(every_s)

    async def on_generate(msg) -> None:
        request = decode(msg.data, GenerateRequest)
        requests.append(request)
        await msg.respond(encode(GenerateAccepted(request_id=request.request_id, prompt_token_ids=[1, 2],
                                                  prefill_worker=None, decode_worker="decode-x",
                                                  max_tokens=request.params.max_tokens)))
        task = asyncio.ensure_future(stream(request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(subjects.ROUTER_GENERATE_ALL, cb=on_generate)
    await flushed(nc)
    return nc


def delay_disconnected_callback(client, delay_s: float) -> None:
    """Run the client's disconnected callback ``delay_s`` late, as a loaded machine can: nats-py marks
    the connection down first, then waits for the old socket to close before calling it."""
    callback = client.nc._disconnected_cb

    async def late() -> None:
        await asyncio.sleep(delay_s)
        await callback()

    client.nc._disconnected_cb = late


async def restart_after(server: NatsServer, delay_s: float) -> None:
    await asyncio.sleep(delay_s)  # about what tandem up takes to notice the death and start it again
    await asyncio.to_thread(server.restart)


@pytest.mark.slow  # a nats-server restarted under a stream, 4 s and more
@pytest.mark.parametrize("callback_delay_s", [pytest.param(0.0, id="prompt-callback"),
                                              pytest.param(2.0, id="late-callback")])
async def test_a_stream_outlives_a_restart_of_the_server_under_it(private_server, callback_delay_s):
    """kill -9 of the nats-server mid-stream, then the server back on its port (as ``tandem up``
    restarts it): the stream waits for the connection, is placed again after the tokens it had,
    and ends with every token once, in order; also when nats-py's disconnected callback comes late."""
    requests: list[GenerateRequest] = []
    router = await counting_router(private_server.url, requests)
    try:
        async with connect(private_server.url, worker_timeout_s=60, reconnect_s=15) as client:
            if callback_delay_s:
                delay_disconnected_callback(client, callback_delay_s)
            tokens: list[int] = []
            restart = None
            async for chunk in client.generate("hello", max_tokens=150, temperature=0.0):
                tokens += chunk.token_ids
                if len(tokens) >= 30 and restart is None:
                    private_server.process.kill()
                    private_server.process.wait()
                    restart = asyncio.create_task(restart_after(private_server, 0.5))  # the stream waits meanwhile
            await restart
        assert tokens == [position_token(p) for p in range(150)], "a gap or a duplicate across the restart"
        assert len(requests) >= 2, "the stream was not placed again after the connection came back"
        resumed = requests[-1].resume_output_token_ids
        assert resumed == tokens[:len(resumed)] and len(resumed) >= 30, \
            f"placed again with {len(resumed)} tokens, not every one delivered before"
    finally:
        await router.close()


async def holding_router(url: str, name: str, held: list[GenerateRequest]) -> nats.NATS:
    """Takes requests (PlacementReceived, and its alive subject answers) but never places them: a
    router whose admission queue holds them."""
    nc = await nats.connect(url)

    async def on_generate(msg) -> None:
        request = decode(msg.data, GenerateRequest)
        held.append(request)
        assert request.ack_placement, "the client asks for the acknowledgement"
        await msg.respond(encode(PlacementReceived(request_id=request.request_id, router=name)))

    async def on_alive(msg) -> None:
        await msg.respond(b"ok")

    await nc.subscribe(subjects.ROUTER_GENERATE_ALL, cb=on_generate)
    await nc.subscribe(subjects.alive("router", name), cb=on_alive)
    await flushed(nc)
    return nc


async def test_a_router_dying_with_a_placement_is_noticed_within_a_second(private_server):
    """The router that took the request dies before answering (kill -9 leaves no goodbye: its
    connection just closes). The client places the request again at once, on another router,
    instead of waiting out its 30 s timeout; the placement held at the dead one is cancelled."""
    held: list[GenerateRequest] = []
    holder = await holding_router(private_server.url, "router-holding", held)
    served: list[GenerateRequest] = []
    other = None
    cancels: list[str] = []
    watcher = await nats.connect(private_server.url)

    async def on_cancel(msg) -> None:
        cancels.append(decode(msg.data, Cancel).request_id)

    await watcher.subscribe(subjects.CANCEL_ALL, cb=on_cancel)
    try:
        async with connect(private_server.url, worker_timeout_s=60) as client:
            stream = client.generate("hello", max_tokens=20, temperature=0.0, request_id="held-1")
            opening = asyncio.ensure_future(stream.__aenter__())
            deadline = time.monotonic() + 5
            while not held and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert held, "the holding router never got the request"
            await asyncio.sleep(1.0)  # held a while, alive: the client keeps waiting
            assert not opening.done(), "the client gave up on a router that is alive and holds the request"
            other = await counting_router(private_server.url, served)
            await holder.close()  # the holder dies
            died = time.monotonic()
            await asyncio.wait_for(opening, 10)
            noticed = time.monotonic() - died
            tokens = [t async for chunk in stream for t in chunk.token_ids]
        assert noticed < 1.5, f"the client took {noticed:.2f}s to place the request again after its router died"
        assert tokens == [position_token(p) for p in range(20)], tokens
        assert served and served[0].request_id != "held-1", "the new placement has its own id"
        assert stream.migrations == 1, "the router's death counts as one migration"
        assert "held-1" in cancels, f"the placement held at the dead router was not cancelled: {cancels}"
        print(f"router death to the request placed again: {noticed * 1e3:.0f} ms")
    finally:
        await watcher.close()
        if other is not None:
            await other.close()


@pytest.mark.slow  # 4.5 s of a router that never acknowledges
async def test_no_acknowledgement_from_any_router_fails_typed_not_by_timeout(private_server):
    """A router that takes the request and says nothing (it died in the instant after receiving
    it): placed again each time, until the migration limit, with the reason in the error."""
    silent = await nats.connect(private_server.url)
    taken: list[bytes] = []

    async def on_generate(msg) -> None:
        taken.append(msg.data)

    await silent.subscribe(subjects.ROUTER_GENERATE_ALL, cb=on_generate)
    await flushed(silent)
    try:
        async with connect(private_server.url, request_timeout_s=60, max_migrations=2) as client:
            started = time.monotonic()
            with pytest.raises(WorkerFailureError, match="no router took the request") as caught:
                await client.complete("hello", max_tokens=4)
            took = time.monotonic() - started
        assert "migrated 2 times" in str(caught.value), str(caught.value)
        assert len(taken) >= 3, f"sent {len(taken)} times: once and once per migration"
        assert took < 10, f"{took:.1f}s: three 1.5 s acknowledgement waits, not the 60 s timeout"
    finally:
        await silent.close()


@pytest.mark.slow  # 7 s with its restarted router's teardown
async def test_a_request_waits_for_a_router_that_is_restarting(private_server):
    """A router answered this client before, then none is there (killed, its supervisor starting
    it again): a new request waits for it instead of failing after a second."""
    served: list[GenerateRequest] = []
    router = await counting_router(private_server.url, served)
    async with connect(private_server.url, worker_timeout_s=60) as client:
        assert len((await client.complete("hello", max_tokens=3)).token_ids) == 3
        await router.close()
        request = asyncio.ensure_future(client.complete("again", max_tokens=3))
        await asyncio.sleep(2.5)  # longer than the second a first-ever placement waits
        assert not request.done(), request
        router = await counting_router(private_server.url, served)
        result = await asyncio.wait_for(request, 10)
        assert result.token_ids == [position_token(p) for p in range(3)]
    await router.close()
