"""An in-process stand-in for a NATS connection, so a service's message handling runs in a unit test.

:class:`FakeBus` implements the part of nats-py's ``Client`` that tandem's services use, with the
server's semantics where they matter:

- ``publish(subject, payload, reply=, headers=)``; ``subscribe(subject, queue=, cb=, max_msgs=,
  pending_msgs_limit=, pending_bytes_limit=)`` with NATS wildcards (``*`` one token, ``>`` the rest)
  and queue groups (one member of a group gets each message, in turn). A subscription with ``cb``
  runs it for one message at a time, in order, on its own task, as nats-py does; one without takes
  ``next_msg()`` / ``messages``. Messages are the real ``nats.aio.msg.Msg``, payloads copied as on
  a wire. A subscription over its pending limits drops the message (a slow consumer).
- ``request(subject, payload, timeout=)``: ``NoRespondersError`` at once when nothing subscribes
  to the subject (as a server with headers support answers), ``nats.errors.TimeoutError`` when
  nobody replies in time. ``new_inbox()``, ``flush()``, ``drain()``, ``close()``, ``is_connected``,
  ``is_closed``, ``max_payload`` (``MaxPayloadError`` above it; small values force multi-frame
  KV transfers).
- ``jetstream()`` is nats-py's own ``JetStreamContext`` over this bus. No JetStream API answers
  here, so its calls fail as on a server without JetStream (``ServiceUnavailableError``): the
  router and the KV-event publisher fall back to plain subjects, as they do there.
- nats-py's micro services (``nats.micro.add_service``) run on it unchanged.

For tests: ``published`` (every message, in order), ``errors`` (what subscription callbacks raised
and slow-consumer drops; a test should usually end with it empty), ``has_interest(subject)``,
``settle()`` (wait until every delivered message has been handled), :func:`wait_until`, and
:func:`serving`, which runs a whole ``ServiceRuntime`` (its real ``run()``: micro registration,
``setup``, heartbeats, shutdown) with this bus as its connection (:func:`bus_settings` makes its
settings)::

    bus = FakeBus()
    async with serving(Router(bus_settings(tmp_path)), bus) as router:
        reply = await bus.request(subjects.router_generate("tandem"), encode(request), timeout=5)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from unittest import mock

import nats
import nats.js
from nats.aio.msg import Msg
from nats.aio.subscription import DEFAULT_SUB_PENDING_BYTES_LIMIT, DEFAULT_SUB_PENDING_MSGS_LIMIT
from nats.errors import (
    BadSubjectError,
    ConnectionClosedError,
    ConnectionDrainingError,
    Error,
    MaxPayloadError,
    NoRespondersError,
    SlowConsumerError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from nats.nuid import NUID

from tandem.shared.infra.config import Settings

log = logging.getLogger("tests.fakebus")

DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` (no wildcards) falls under ``pattern``: ``*`` stands for one token, a final
    ``>`` for one or more."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


def _check_subject(subject: str, wildcards: bool) -> None:
    tokens = subject.split(".")
    if not subject or any(not t or any(c.isspace() for c in t) for t in tokens):
        raise BadSubjectError
    for i, token in enumerate(tokens):
        if "*" in token or ">" in token:
            misplaced = len(token) > 1 or (token == ">" and i < len(tokens) - 1)
            if not wildcards or misplaced:
                raise BadSubjectError


class FakeSubscription:
    """What ``FakeBus.subscribe`` returns: the methods of ``nats.aio.subscription.Subscription`` tandem uses."""

    def __init__(self, bus: FakeBus, sid: int, subject: str, queue: str,
                 cb: Callable[[Msg], Awaitable[None]] | None, max_msgs: int, pending_msgs_limit: int,
                 pending_bytes_limit: int) -> None:
        self._bus, self._sid, self._subject, self._queue_name, self._cb = bus, sid, subject, queue, cb
        self._max_msgs = max_msgs
        self._pending_msgs_limit, self._pending_bytes_limit = pending_msgs_limit, pending_bytes_limit
        self._pending: asyncio.Queue[Msg] = asyncio.Queue()
        self._pending_bytes = 0
        self._handling = False
        self._closed = False
        self.delivered = 0
        self._task = asyncio.get_running_loop().create_task(self._run()) if cb is not None else None

    @property
    def subject(self) -> str:
        return self._subject

    @property
    def queue(self) -> str:
        return self._queue_name

    @property
    def pending_msgs(self) -> int:
        return self._pending.qsize()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def idle(self) -> bool:
        """No message waits here and none is being handled."""
        return self._pending.empty() and not self._handling

    def _deliver(self, msg: Msg) -> None:
        if self._closed:
            return
        if (0 < self._pending_msgs_limit <= self._pending.qsize()
                or 0 < self._pending_bytes_limit < self._pending_bytes + len(msg.data)):
            self._bus.errors.append(SlowConsumerError(subject=msg.subject, reply=msg.reply, sid=self._sid, sub=self))
            log.warning("slow consumer on %s: dropped a message for %s", self._subject, msg.subject)
            return
        self._pending.put_nowait(msg)
        self._pending_bytes += len(msg.data)
        self.delivered += 1
        if self._max_msgs and self.delivered >= self._max_msgs:
            self._bus._remove(self)  # auto-unsubscribed: what is queued is still handed out

    def _take(self, msg: Msg) -> Msg:
        self._pending_bytes -= len(msg.data)
        return msg

    async def _run(self) -> None:
        while True:
            msg = self._take(await self._pending.get())
            self._handling = True
            try:
                await self._cb(msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nats-py hands these to error_cb; here a test can see them
                self._bus.errors.append(exc)
                log.exception("callback of a subscription to %s failed on %s", self._subject, msg.subject)
            finally:
                self._handling = False

    async def next_msg(self, timeout: float | None = 1.0) -> Msg:
        if self._cb is not None:
            raise Error("nats: next_msg cannot be used in async subscriptions")
        try:
            return self._take(await asyncio.wait_for(self._pending.get(), timeout))
        except TimeoutError:
            raise NatsTimeoutError from None

    @property
    def messages(self) -> AsyncIterator[Msg]:
        async def iterate() -> AsyncIterator[Msg]:
            while not (self._closed and self._pending.empty()):
                yield self._take(await self._pending.get())
        return iterate()

    async def unsubscribe(self, limit: int = 0) -> None:
        if limit and self.delivered < limit:
            self._max_msgs = limit
            return
        self._bus._remove(self)
        self._stop()

    async def drain(self) -> None:
        """Take no more messages, handle the ones already here, then go."""
        self._bus._remove(self)
        own = self._task is asyncio.current_task()  # drained from its own callback: the rest of the queue goes
        while self._task is not None and not own and not self.idle and not self._task.done():
            await asyncio.sleep(0.001)
        self._stop()

    def _stop(self) -> None:
        self._closed = True
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()


class FakeBus:
    """An in-process NATS: one bus shared by every party of a test (see the module docstring)."""

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self._nuid = NUID()  # nats.micro.Service takes its id from the client's NUID
        self._sids = itertools.count(1)
        self._subs: dict[int, FakeSubscription] = {}
        self._turns: dict[str, int] = {}  # queue group -> messages it was handed, for taking turns
        self._closed = False
        self._draining = False
        self.published: list[Msg] = []
        self.errors: list[BaseException] = []

    # -- the nats-py Client API ---------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return not self._closed

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_draining(self) -> bool:
        return self._draining

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if self._closed:
            raise ConnectionClosedError
        _check_subject(subject, wildcards=False)
        if len(payload) > self.max_payload:
            raise MaxPayloadError
        data = bytes(payload)  # the sender may reuse its buffer once publish returns
        self.published.append(Msg(_client=self, subject=subject, reply=reply, data=data, headers=headers))
        groups: dict[str, list[FakeSubscription]] = {}
        for sub in list(self._subs.values()):
            if subject_matches(sub.subject, subject):
                if sub.queue:
                    groups.setdefault(sub.queue, []).append(sub)
                else:
                    sub._deliver(self._msg(sub, subject, reply, data, headers))
        for queue, members in groups.items():
            turn = self._turns.get(queue, 0)
            self._turns[queue] = turn + 1
            chosen = members[turn % len(members)]
            chosen._deliver(self._msg(chosen, subject, reply, data, headers))

    def _msg(self, sub: FakeSubscription, subject: str, reply: str, data: bytes, headers: dict | None) -> Msg:
        return Msg(_client=self, subject=subject, reply=reply, data=data, headers=dict(headers) if headers else None,
                   _sid=sub._sid)

    async def subscribe(self, subject: str, queue: str = "", cb: Callable[[Msg], Awaitable[None]] | None = None,
                        future: asyncio.Future | None = None, max_msgs: int = 0,
                        pending_msgs_limit: int = DEFAULT_SUB_PENDING_MSGS_LIMIT,
                        pending_bytes_limit: int = DEFAULT_SUB_PENDING_BYTES_LIMIT) -> FakeSubscription:
        if future is not None:
            raise NotImplementedError("FakeBus.subscribe: future= is not supported (deprecated in nats-py)")
        _check_subject(subject, wildcards=True)
        if queue:
            _check_subject(queue, wildcards=False)
        if self._closed:
            raise ConnectionClosedError
        if self._draining:
            raise ConnectionDrainingError
        if cb is not None and not asyncio.iscoroutinefunction(cb):
            raise Error("nats: must use coroutine for subscriptions")
        sub = FakeSubscription(self, next(self._sids), subject, queue, cb, max_msgs, pending_msgs_limit,
                               pending_bytes_limit)
        self._subs[sub._sid] = sub
        return sub

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5, old_style: bool = False,
                      headers: dict[str, str] | None = None) -> Msg:
        if self._closed:
            raise ConnectionClosedError
        if not self.has_interest(subject):
            raise NoRespondersError
        reply: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Msg) -> None:
            if not reply.done():
                reply.set_result(msg)

        inbox = await self.subscribe(self.new_inbox(), cb=on_reply, max_msgs=1)
        try:
            await self.publish(subject, payload, reply=inbox.subject, headers=headers)
            return await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            raise NatsTimeoutError from None
        finally:
            await inbox.unsubscribe()

    def new_inbox(self) -> str:
        return f"_INBOX.{self._nuid.next().decode()}"

    async def flush(self, timeout: float = 10) -> None:
        if self._closed:
            raise ConnectionClosedError
        await asyncio.sleep(0)

    def jetstream(self, **opts) -> nats.js.JetStreamContext:
        return nats.js.JetStreamContext(self, **opts)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionClosedError
        self._draining = True
        for sub in list(self._subs.values()):
            await sub.drain()
        await self.close()

    async def close(self) -> None:
        self._closed = True
        self._draining = False
        for sub in list(self._subs.values()):
            self._remove(sub)
            sub._stop()

    # -- for tests ----------------------------------------------------------------------------------
    def _remove(self, sub: FakeSubscription) -> None:
        self._subs.pop(sub._sid, None)

    def has_interest(self, subject: str) -> bool:
        """Whether anything subscribes to ``subject`` (what decides no-responders)."""
        return any(subject_matches(sub.subject, subject) for sub in self._subs.values())

    def messages_on(self, pattern: str) -> list[Msg]:
        """Every message published so far on a subject ``pattern`` covers, in order."""
        return [m for m in self.published if subject_matches(pattern, m.subject)]

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until every message delivered to a callback so far (and any its handlers published)
        was handled. Only from a test: a callback awaiting it would wait for itself."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        quiet = 0
        while quiet < 3:  # a few idle rounds: a handler's own tasks get to publish too
            await asyncio.sleep(0)
            handlers = [sub for sub in self._subs.values() if sub._cb is not None]  # the rest wait for next_msg
            quiet = quiet + 1 if all(sub.idle for sub in handlers) else 0
            if loop.time() > deadline:
                busy = [s.subject for s in handlers if not s.idle]
                raise AssertionError(f"the bus did not settle in {timeout_s}s: still busy: {busy}")


async def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition"):
    """Poll ``predicate`` on the running loop until it returns something truthy, and return that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (value := predicate()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)
    return value


async def take_work(bus: FakeBus, subject: str, kind: type, into: list) -> None:
    """A worker played by the test on ``subject``: every request is decoded as ``kind`` (a
    ``PrefillRequest`` or ``DecodeRequest``), kept in ``into`` and acknowledged, as a worker takes work."""
    from tandem.shared.protocol.base import Ack
    from tandem.shared.protocol.codec import decode, encode

    async def take(msg: Msg) -> None:
        work = decode(msg.data, kind)
        into.append(work)
        await msg.respond(encode(Ack(request_id=work.spec.request_id)))

    await bus.subscribe(subject, cb=take)


def bus_settings(data_dir, **flat) -> Settings:
    """Settings for a service on a :class:`FakeBus`: a placeholder NATS URL, no /metrics server, CPU,
    ``data_dir`` (give it an empty one: the tiny model is then the shipped checkpoint), and ``flat``
    (settings by flat name: ``num_blocks=64``, ``kv_ring_mib=0``, ``instance_id="prefill-t"``, ...)."""
    return Settings(**{"nats_url": "nats://fakebus", "metrics_port": -1, "device": "cpu", "data_dir": data_dir,
                       **flat})


@contextlib.asynccontextmanager
async def serving(service, bus: FakeBus, timeout_s: float = 60.0):
    """Run ``service`` (a ``ServiceRuntime``; its settings need a ``nats_url``, any will do) with
    ``bus`` as its connection: its real ``run()``, from micro registration through ``setup`` to the
    heartbeats. Yields the service once ``setup`` has finished; asks it to stop at the end and waits
    until its shutdown (teardown, draining the bus) is over."""
    if not service.settings.bus.nats_url:  # run() would raise SystemExit, which no task contains
        raise ValueError("serving: the service's settings need a nats_url (any string; see bus_settings)")
    ready = asyncio.Event()
    setup = service.setup

    async def setup_then_signal() -> None:
        await setup()
        ready.set()

    async def connect(*args, **kwargs) -> FakeBus:
        return bus

    service.setup = setup_then_signal
    with mock.patch.object(nats, "connect", connect):  # only until run() has connected
        task = asyncio.get_running_loop().create_task(service.run())
        started = asyncio.get_running_loop().create_task(ready.wait())
        await asyncio.wait({task, started}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if not ready.is_set():
        started.cancel()
        if task.done():
            task.result()  # raises what stopped run() before it was ready
        task.cancel()
        raise AssertionError(f"{service.name} was not ready within {timeout_s}s")
    try:
        yield service
    finally:
        service.stop_at_once()  # a test's end: no drain, what is still in flight ends with an error
        await asyncio.wait_for(task, timeout_s)
