"""The router refuses a stream that is not its sender's, and holds requests while a lost decode
worker restarts (a router on the in-process bus, tests/fakebus.py; the decode worker is played by
the test)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakebus import FakeBus, bus_settings, serving, take_work

from tandem.services.router.service import Router
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import DecodeRequest, GenerateAccepted, GenerateRequest, SamplingParams

PROMPT = list(range(1, 41))
OWNER = "UOWNERKEY"


def beat(model: str, incarnation: str = "first", draining: bool = False) -> bytes:
    return encode(Heartbeat(service="decode", instance_id="decode-a", host="test", pid=1, model=model,
                            incarnation=incarnation, free_blocks=100, num_blocks=100, max_model_len=2048,
                            max_num_seqs=4, kv_namespace="ns", draining=draining))


def generate(request_id: str, stream_subject: str | None = None, **fields) -> bytes:
    return encode(GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT,
                                  params=SamplingParams(max_tokens=4, temperature=0.0),
                                  stream_subject=stream_subject or f"_INBOX.{OWNER}.client.{request_id}", **fields))


async def ask(bus: FakeBus, payload: bytes, owner: str = OWNER, timeout: float = 10.0):
    return decode((await bus.request(subjects.router_generate(owner), payload, timeout=timeout)).data)


@pytest.fixture
async def router(tmp_path):
    """A router that drops a decode worker silent for 0.3 s and waits 1 s for a lost one to come back."""
    bus = FakeBus()
    settings = bus_settings(tmp_path, instance_id="router-o", heartbeat_interval_s=0.05, worker_timeout_s=0.3,
                            router_restart_wait_s=1.0)
    async with serving(Router(settings), bus) as service:
        taken: list[DecodeRequest] = []
        await take_work(bus, subjects.decode_admit("decode-a"), DecodeRequest, taken)
        yield bus, service, taken
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


@pytest.mark.parametrize("stream_subject", [
    "_INBOX.USOMEONEELSE.client.r1",  # another connection's inbox
    f"_INBOX.{OWNER}X.client.r1",  # a key that only begins like the sender's
    "_INBOX.client.r1.x",  # an inbox with no owner token of the sender's
], ids=["another-owner", "owner-prefix", "no-owner"])
async def test_a_stream_outside_the_senders_inbox_is_refused(router, stream_subject) -> None:
    bus, service, taken = router
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name))
    reply = await ask(bus, generate("r1", stream_subject, resume_output_token_ids=[5]))
    assert isinstance(reply, ErrorReply), f"a request writing into {stream_subject} was placed: {reply}"
    assert (reply.code, reply.param) == (ErrorCode.INVALID_REQUEST, "stream_subject"), reply
    assert f"_INBOX.{OWNER}." in reply.message, f"the refusal does not say which inbox is allowed: {reply.message}"
    assert not taken, "a refused request reached a decode worker"


async def test_a_stream_in_the_senders_inbox_is_placed(router) -> None:
    bus, service, taken = router
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name))
    reply = await ask(bus, generate("r1"))
    assert isinstance(reply, GenerateAccepted), reply
    assert taken[0].spec.stream_subject == f"_INBOX.{OWNER}.client.r1"


async def test_a_request_waits_for_a_lost_decode_worker_to_come_back(router) -> None:
    bus, service, taken = router
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name))
    await bus.settle()
    await asyncio.sleep(0.4)  # silent past worker_timeout_s: the router drops it as lost
    pending = asyncio.ensure_future(ask(bus, generate("r1")))
    await asyncio.sleep(0.2)
    assert not pending.done(), f"with a worker just lost, the request did not wait for its restart: {pending.result()}"
    assert service.admission.depth == 1
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name, incarnation="second"))
    reply = await pending
    assert isinstance(reply, GenerateAccepted), reply
    assert reply.queue_wait_s >= 0.15, f"queue_wait_s {reply.queue_wait_s} does not count the wait"
    assert [w.spec.request_id for w in taken] == ["r1"]


async def test_with_no_worker_back_in_time_the_request_gets_no_workers(router) -> None:
    bus, service, taken = router
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name))
    await bus.settle()
    await asyncio.sleep(0.4)
    start = time.monotonic()
    reply = await ask(bus, generate("r1"))
    waited = time.monotonic() - start
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKERS, reply
    assert "none came back within 1 s" in reply.message, reply.message
    assert 0.3 <= waited <= 3.0, f"the request waited {waited:.2f} s for a restart the router allows 1 s"
    assert service.admission.depth == 0 and not taken


@pytest.mark.parametrize("history", ["never-seen", "drained"])
async def test_with_no_worker_to_wait_for_no_workers_comes_at_once(router, history) -> None:
    bus, service, _ = router
    if history == "drained":  # it left on purpose (a scale-down): nobody brings it back
        await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name, draining=True))
        await bus.settle()
        await asyncio.sleep(0.4)
    start = time.monotonic()
    reply = await ask(bus, generate("r1"))
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKERS, reply
    assert time.monotonic() - start < 0.5, "no_workers waited though no worker was lost"


async def test_two_workers_lost_at_once_are_both_dropped_and_the_request_waits(router) -> None:
    bus, service, taken = router
    for name in ("decode-a", "decode-b"):
        payload = Heartbeat(service="decode", instance_id=name, host="test", pid=1, model=service.meta.name,
                            incarnation="first", free_blocks=100, num_blocks=100, max_model_len=2048, max_num_seqs=4,
                            kv_namespace="ns")
        await bus.publish(subjects.heartbeat("decode", name), encode(payload))
    await bus.settle()
    await asyncio.sleep(0.4)
    pending = asyncio.ensure_future(ask(bus, generate("r1")))
    await asyncio.sleep(0.2)
    assert not pending.done(), f"the request did not wait for a restart: {pending.result()}"
    assert not service.workers["decode"], "a lost worker is still in the router's pool"
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(service.meta.name, incarnation="second"))
    assert isinstance(await pending, GenerateAccepted)


async def test_a_worker_that_beats_but_takes_nothing_is_not_tried_again_by_the_same_request(router) -> None:
    """A process that keeps beating but neither takes a request nor answers its alive subject (the
    trial's vanished worker): the request found it gone once and never goes back to it (its beats
    name the same process), so it waits out the restart wait and gets no_workers, forwarded once."""
    bus, service, _ = router
    forwards: list[str] = []

    async def swallow(msg) -> None:
        forwards.append(decode(msg.data, DecodeRequest).spec.request_id)

    await bus.subscribe(subjects.decode_admit("decode-z"), cb=swallow)
    zombie = Heartbeat(service="decode", instance_id="decode-z", host="test", pid=1, model=service.meta.name,
                       incarnation="only", free_blocks=100, num_blocks=100, max_model_len=2048, max_num_seqs=4,
                       kv_namespace="ns")

    async def beating() -> None:
        while True:
            await bus.publish(subjects.heartbeat("decode", "decode-z"), encode(zombie))
            await asyncio.sleep(0.05)

    beats = asyncio.ensure_future(beating())
    try:
        await asyncio.sleep(0.1)
        start = time.monotonic()
        reply = await ask(bus, generate("r1"))
        took = time.monotonic() - start
    finally:
        beats.cancel()
    assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NO_WORKERS, reply
    assert forwards == ["r1"], f"forwarded {len(forwards)} times to a process already found gone"
    assert took < 4.0, f"{took:.1f} s: the restart wait is 1 s"
