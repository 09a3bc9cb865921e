"""The router's admission queue (services/router/admission.py): the saturation rule, the bounds,
FCFS by priority, the wait limit, cancellation; then the router itself on an in-process bus
(tests/fakebus.py) queueing behind a saturated decode worker played by the test."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakebus import FakeBus, bus_settings, serving, take_work

from tandem.services.router.admission import AdmissionQueue, QueuedRequestCancelled, WorkerLoad, has_room
from tandem.services.router.service import Router
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import Cancel, DecodeRequest, GenerateAccepted, GenerateRequest, SamplingParams


@pytest.mark.parametrize("load,limit,room", [
    (WorkerLoad(running=0, waiting=0, placed_unseen=0, max_num_seqs=4), 0, True),
    (WorkerLoad(running=4, waiting=0, placed_unseen=3, max_num_seqs=4), 0, True),  # by default: two batches
    (WorkerLoad(running=4, waiting=0, placed_unseen=4, max_num_seqs=4), 0, False),  # what it was just given counts
    (WorkerLoad(running=1, waiting=1, placed_unseen=0, max_num_seqs=4), 0, False),  # its own queue is not empty
    (WorkerLoad(running=8, waiting=0, placed_unseen=0, max_num_seqs=4), 9, True),  # the setting wins
    (WorkerLoad(running=2, waiting=0, placed_unseen=0, max_num_seqs=4), 2, False),
    (WorkerLoad(running=99, waiting=0, placed_unseen=0, max_num_seqs=0), 0, True),  # no bound said: waiting only
], ids=["idle", "one-slot-left", "slot-taken-by-a-placement", "waiting", "setting-above", "setting-below",
        "unbounded"])
def test_a_worker_has_room_below_its_bound_with_nothing_waiting(load, limit, room):
    assert has_room(load, limit) is room


class Slots:
    """What the router's workers can take: ``room()`` while slots are left, ``take()`` on placement."""

    def __init__(self, free: int = 0) -> None:
        self.free = free

    def room(self) -> bool:
        return self.free > 0

    def take(self) -> None:
        assert self.free > 0, "placed with no room"
        self.free -= 1


def queue(slots: Slots, max_requests: int = 16, max_prompt_tokens: int = 10_000, max_wait_s: float = 30.0,
          waits: list[float] | None = None) -> AdmissionQueue:
    return AdmissionQueue(max_requests, max_prompt_tokens, max_wait_s, slots.room,
                          (waits if waits is not None else []).append)


async def placed_in_order(q: AdmissionQueue, slots: Slots, order: list[str], key: str, tokens: int = 10,
                          priority: int = 0) -> float:
    """A request as the router places it: admitted, then its worker's slot taken before any await."""
    waited = await q.admit(key, tokens, priority)
    slots.take()
    order.append(key)
    await asyncio.sleep(0)
    return waited


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_with_room_and_nobody_queued_a_request_passes_at_once():
    waits: list[float] = []
    q = queue(Slots(1), waits=waits)
    assert await q.admit("r1", 10) == 0.0
    assert (q.depth, q.prompt_tokens, waits) == (0, 0, [0.0])


async def test_past_the_request_bound_overloaded_comes_at_once():
    slots = Slots(0)
    q = queue(slots, max_requests=2)
    waiting = [asyncio.ensure_future(q.admit(f"r{i}", 10)) for i in range(2)]
    await settle()
    assert q.depth == 2
    start = time.perf_counter()
    with pytest.raises(ProtocolError) as refused:
        await q.admit("r2", 10)
    assert refused.value.code is ErrorCode.OVERLOADED and "queue is full (2 requests waiting)" in refused.value.message
    assert time.perf_counter() - start < 0.01 and q.refused == 1 and q.depth == 2
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert (q.depth, q.prompt_tokens) == (0, 0)


async def test_past_the_prompt_token_bound_overloaded_comes_at_once():
    q = queue(Slots(0), max_prompt_tokens=100)
    first = asyncio.ensure_future(q.admit("r0", 60))
    await settle()
    with pytest.raises(ProtocolError) as refused:
        await q.admit("r1", 50)
    assert refused.value.code is ErrorCode.OVERLOADED
    assert "holds 60 prompt tokens (at most 100)" in refused.value.message
    third = asyncio.ensure_future(q.admit("r2", 40))  # still fits
    await settle()
    assert (q.depth, q.prompt_tokens) == (2, 100)
    for task in (first, third):
        task.cancel()
    await asyncio.gather(first, third, return_exceptions=True)


async def test_no_queue_at_all_refuses_when_saturated():
    q = queue(Slots(0), max_requests=0)
    with pytest.raises(ProtocolError, match="overloaded"):
        await q.admit("r0", 1)


async def test_queued_requests_leave_by_priority_then_arrival():
    slots = Slots(0)
    q = queue(slots)
    order: list[str] = []
    tasks = [asyncio.ensure_future(placed_in_order(q, slots, order, key, priority=prio))
             for key, prio in (("a", 0), ("b", 0), ("c", -5), ("d", 5), ("e", -5))]
    await settle()
    assert q.depth == 5 and not order
    slots.free = 5
    q.pump()
    waited = await asyncio.gather(*tasks)
    assert order == ["c", "e", "a", "b", "d"], "lower priority value first, then first come first served"
    assert all(w > 0 for w in waited) and q.depth == 0


async def test_room_for_one_wakes_exactly_one():
    """A woken request's load is on its worker before the next is woken, so one free slot places one."""
    slots = Slots(0)
    q = queue(slots)
    order: list[str] = []
    tasks = [asyncio.ensure_future(placed_in_order(q, slots, order, f"r{i}")) for i in range(3)]
    await settle()
    slots.free = 1
    q.pump()
    q.pump()  # pumping twice (two heartbeats at once) changes nothing
    await settle()
    assert order == ["r0"] and q.depth == 2
    slots.free = 2
    q.pump()
    await asyncio.gather(*tasks)
    assert order == ["r0", "r1", "r2"]


async def test_a_newcomer_never_overtakes_the_queue():
    slots = Slots(0)
    q = queue(slots)
    order: list[str] = []
    first = asyncio.ensure_future(placed_in_order(q, slots, order, "old"))
    await settle()
    slots.free = 2  # room came, no pump yet: the newcomer must still go after the one waiting
    await asyncio.gather(first, placed_in_order(q, slots, order, "new"))
    assert order == ["old", "new"]


async def test_a_request_waiting_past_the_limit_gets_overloaded():
    waits: list[float] = []
    q = queue(Slots(0), max_wait_s=0.05, waits=waits)
    start = time.perf_counter()
    with pytest.raises(ProtocolError) as refused:
        await q.admit("r0", 10)
    elapsed = time.perf_counter() - start
    assert refused.value.code is ErrorCode.OVERLOADED and "0.05 s" in refused.value.message
    assert 0.04 < elapsed < 1.0 and (q.depth, q.prompt_tokens, q.refused) == (0, 0, 1)
    assert len(waits) == 1 and waits[0] == pytest.approx(elapsed, abs=0.05)


async def test_a_cancelled_request_leaves_the_queue():
    slots = Slots(0)
    q = queue(slots)
    order: list[str] = []
    by_client = asyncio.ensure_future(q.admit("gone", 30))
    by_task = asyncio.ensure_future(q.admit("dropped", 20))
    stays = asyncio.ensure_future(placed_in_order(q, slots, order, "stays"))
    await settle()
    assert (q.depth, q.prompt_tokens) == (3, 60)
    assert q.cancel("gone") and not q.cancel("gone") and not q.cancel("never-queued")
    with pytest.raises(QueuedRequestCancelled):
        await by_client
    by_task.cancel()  # the router's task itself cancelled (shutdown)
    await asyncio.gather(by_task, return_exceptions=True)
    assert (q.depth, q.prompt_tokens) == (1, 10)
    slots.free = 1
    q.pump()
    await stays
    assert order == ["stays"] and q.depth == 0


async def test_fail_all_ends_every_queued_request():
    q = queue(Slots(0))
    tasks = [asyncio.ensure_future(q.admit(f"r{i}", 10)) for i in range(3)]
    await settle()
    q.fail_all(ProtocolError(ErrorCode.NO_WORKERS, "no decode worker"))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ProtocolError) and r.code is ErrorCode.NO_WORKERS for r in results) and q.depth == 0


# -- the router on an in-process bus ---------------------------------------------------------------------

PROMPT = list(range(1, 41))


def beat(model: str, running: int) -> bytes:
    return encode(Heartbeat(service="decode", instance_id="decode-a", host="test", pid=1, model=model,
                            running=running, free_blocks=100, num_blocks=100, max_model_len=2048, max_num_seqs=1,
                            kv_namespace="ns"))


def generate(request_id: str, priority: int = 0) -> bytes:
    return encode(GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT, priority=priority,
                                  params=SamplingParams(max_tokens=4, temperature=0.0),
                                  stream_subject=f"_INBOX.tandem.client.{request_id}"))


@pytest.fixture
async def saturated(tmp_path):
    """A router whose one decode worker (max_num_seqs 1, so two in flight) holds two requests; its
    queue holds 2."""
    bus = FakeBus()
    settings = bus_settings(tmp_path, instance_id="router-q", router_max_queued_requests=2,
                            heartbeat_interval_s=0.05)
    async with serving(Router(settings), bus) as router:
        taken: list[DecodeRequest] = []
        await take_work(bus, subjects.decode_admit("decode-a"), DecodeRequest, taken)
        await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(router.meta.name, running=2))
        await bus.settle()
        yield bus, router, taken
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


async def test_the_router_queues_behind_a_saturated_worker_and_places_on_room(saturated):
    bus, router, taken = saturated
    first = asyncio.ensure_future(bus.request(subjects.router_generate("tandem"), generate("r1"), timeout=10))
    second = asyncio.ensure_future(bus.request(subjects.router_generate("tandem"), generate("r2"), timeout=10))
    await bus.settle()
    assert router.admission.depth == 2 and not taken and router.metrics()["queue_depth"] == 2

    refused = decode((await bus.request(subjects.router_generate("tandem"), generate("r3"), timeout=10)).data)
    assert isinstance(refused, ErrorReply) and refused.code is ErrorCode.OVERLOADED, refused

    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(router.meta.name, running=1))
    accepted = decode((await first).data)
    assert isinstance(accepted, GenerateAccepted) and accepted.queue_wait_s > 0, accepted
    assert [w.spec.request_id for w in taken] == ["r1"], "one slot freed: one request placed"
    assert router.admission.depth == 1

    await asyncio.sleep(0.1)  # the placement leaves the router's own count once a heartbeat has seen it
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(router.meta.name, running=1))
    assert isinstance(decode((await second).data), GenerateAccepted)
    assert [w.spec.request_id for w in taken] == ["r1", "r2"] and router.metrics()["refused_overloaded"] == 1
    page = router.prom.text()
    assert "tandem:router_queue_depth 0.0" in page and "tandem:router_queue_wait_seconds_count 2.0" in page
    assert 'tandem:router_rejected_total{code="overloaded"} 1.0' in page


async def test_a_cancel_from_its_client_takes_a_request_out_of_the_routers_queue(saturated):
    bus, router, taken = saturated
    pending = asyncio.ensure_future(bus.request(subjects.router_generate("tandem"), generate("r1"), timeout=10))
    await bus.settle()
    assert router.admission.depth == 1
    wrong_stream = Cancel(request_id="r1", stream_subject="_INBOX.someone.else.r1")
    await bus.publish(subjects.cancel("tandem"), encode(wrong_stream))
    right_stream = Cancel(request_id="r1", stream_subject="_INBOX.tandem.client.r1")
    await bus.publish(subjects.cancel("someone"), encode(right_stream))  # the stream named, but not by its owner
    await bus.settle()
    assert router.admission.depth == 1, "only the owner's cancel (under its key, naming its stream) counts"
    await bus.publish(subjects.cancel("tandem"), encode(right_stream))
    await bus.settle()
    assert router.admission.depth == 0 and router.admission.prompt_tokens == 0
    await bus.publish(subjects.heartbeat("decode", "decode-a"), beat(router.meta.name, running=1))
    await bus.settle()
    assert not taken, "a cancelled request is never placed"
    pending.cancel()  # no reply comes: its client is gone
    await asyncio.gather(pending, return_exceptions=True)
