"""The in-process bus (tests/fakebus.py) keeps the NATS semantics the service tests rely on:
wildcards, queue groups, request-reply with no-responders and timeouts, ordered callbacks,
nats-py's micro services and a JetStream that is not there."""

from __future__ import annotations

import pytest
from fakebus import FakeBus, subject_matches
from nats.errors import BadSubjectError, MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig


@pytest.mark.parametrize(("pattern", "subject", "matches"), [
    ("a.b.c", "a.b.c", True),
    ("a.b.c", "a.b", False),
    ("a.b", "a.b.c", False),
    ("a.*.c", "a.x.c", True),
    ("a.*.c", "a.x.y.c", False),
    ("a.*", "a", False),
    ("a.>", "a.b", True),
    ("a.>", "a.b.c.d", True),
    ("a.>", "a", False),
    (">", "a.b", True),
    ("*.b.>", "x.b.y", True),
    ("*.b.>", "x.c.y", False),
])
def test_wildcards(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


async def test_fan_out_queue_groups_and_order() -> None:
    bus = FakeBus()
    got: dict[str, list[bytes]] = {"all": [], "q1": [], "q2": []}

    def keep(name):
        async def cb(msg):
            got[name].append(msg.data)
        return cb

    await bus.subscribe("work.>", cb=keep("all"))
    await bus.subscribe("work.*", queue="workers", cb=keep("q1"))
    await bus.subscribe("work.*", queue="workers", cb=keep("q2"))
    plain = await bus.subscribe("work.one")
    for i in range(6):
        await bus.publish("work.one", str(i).encode())
    await bus.settle()
    assert got["all"] == [str(i).encode() for i in range(6)], "every plain subscriber gets every message, in order"
    assert sorted(got["q1"] + got["q2"]) == got["all"] and got["q1"] and got["q2"], "one group member each, in turn"
    assert [(await plain.next_msg()).data for _ in range(6)] == got["all"]
    with pytest.raises(BadSubjectError):
        await bus.publish("work.*", b"")
    with pytest.raises(MaxPayloadError):
        await bus.publish("work.one", bytes(bus.max_payload + 1))
    assert not bus.errors


async def test_request_reply_no_responders_and_timeout() -> None:
    bus = FakeBus()

    async def echo(msg):
        await msg.respond(msg.data.upper())

    await bus.subscribe("svc.echo", cb=echo)
    assert (await bus.request("svc.echo", b"hi", timeout=1)).data == b"HI"
    with pytest.raises(NoRespondersError):
        await bus.request("svc.nobody", b"", timeout=1)
    async def ignore(msg):
        pass

    await bus.subscribe("svc.silent", cb=ignore)
    with pytest.raises(NatsTimeoutError):
        await bus.request("svc.silent", b"", timeout=0.05)
    assert not bus.has_interest("_INBOX.>"), "request inboxes are unsubscribed"


async def test_a_failing_callback_is_recorded_and_the_subscription_goes_on() -> None:
    bus = FakeBus()
    seen = []

    async def picky(msg):
        if msg.data == b"bad":
            raise ValueError("bad message")
        seen.append(msg.data)

    await bus.subscribe("x", cb=picky)
    for data in (b"a", b"bad", b"b"):
        await bus.publish("x", data)
    await bus.settle()
    assert seen == [b"a", b"b"] and [type(e) for e in bus.errors] == [ValueError]


async def test_micro_services_run_on_it_and_jetstream_is_unavailable() -> None:
    bus = FakeBus()

    async def double(request):
        await request.respond(request.data * 2)

    service = await add_service(bus, ServiceConfig(name="doubler", version="1.0.0"))
    await service.add_endpoint(EndpointConfig(name="double", subject="math.double", handler=double))
    assert (await bus.request("math.double", b"ab", timeout=1)).data == b"abab"
    assert (await bus.request("$SRV.PING.doubler", b"", timeout=1)).data, "micro discovery answers"
    with pytest.raises(ServiceUnavailableError):
        await bus.jetstream().stream_info("ANY")
    await service.stop()
    await bus.drain()
    assert bus.is_closed and not bus.has_interest("math.double")
