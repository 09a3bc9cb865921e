"""One request in flight: :class:`RequestStream` follows its chunks, notices a worker or router
that is gone, and places the request again with what was delivered so far."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

from tandem.client.errors import (
    NoWorkersError,
    RequestTimeoutError,
    ShuttingDownError,
    WorkerFailureError,
    error_from_reply,
)
from tandem.client.migration import ResumeState, placement_request_id
from tandem.client.output import Chunk
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import shortened
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.serving import (
    GenerateAccepted,
    GenerateRequest,
    Probe,
    StreamChunk,
)

if TYPE_CHECKING:
    from tandem.client.session import Client

log = logging.getLogger("tandem.client")



EMPTY = object()


async def get_within(queue: asyncio.Queue, timeout_s: float):
    """The queue's next item, or ``EMPTY`` after ``timeout_s``. Not ``asyncio.wait_for``: on
    Python 3.11 it swallows a cancellation that lands while the item is ready (it returns the item
    instead), and a stream's items come that often, so Ctrl-C of ``tandem generate`` went unheard."""
    try:
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    except TimeoutError:
        return EMPTY



LOST = None  # put into a stream's queue when the connection drops: wakes it at once
PROBED = object()  # put into a held-output stream's queue when the decode worker probes it: the request is there
PLACEMENT_TRIES = 4  # sends of a request that finds no router, PLACEMENT_RETRY_S apart (about a second)
PLACEMENT_RETRY_S = 0.3
# Finding none after a router answered this client: one is likely restarting (a supervisor brings
# a killed one back in seconds), so the request waits this long for it, not about a second.
ROUTER_RESTART_WAIT_S = 15.0
PLACEMENT_ACK_S = 1.5  # a router says PlacementReceived as it takes a request: none this long, none took it
ROUTER_CHECK_S = 0.5  # while a router places a request, how often it is asked whether it is still there
LATE_BEAT_S = 1.0  # a worker holding a stream silent this long (two heartbeats) is asked whether it is there
ALIVE_CHECK_TIMEOUT_S = 2.0  # an answer slower than this counts as alive: only an instance gone is taken for dead
MIGRATION_RETRY_S = 0.25  # between re-placements of a migrating request that find no worker
RECONNECT_WAIT_S = 0.5  # nats-py's pause between reconnection attempts


@dataclass(frozen=True)
class Holder:
    """A worker process holding a placement: its service, instance id and incarnation ("" not said)."""

    service: str
    instance: str
    incarnation: str = ""


def holders_of(accepted: GenerateAccepted, prefill: bool = True) -> list[Holder]:
    """The decode worker holding a placement and, when ``prefill``, its prefill worker."""
    holders = [Holder("decode", accepted.decode_worker, accepted.decode_incarnation)]
    if prefill and accepted.prefill_worker:
        holders.append(Holder("prefill", accepted.prefill_worker, accepted.prefill_incarnation))
    return holders


class WorkerGone(WorkerFailureError):
    """The worker holding a stream is gone (off the bus, or silent): its request migrates, never to it again."""

    def __init__(self, message: str, request_id: str, instance: str) -> None:
        super().__init__(message, request_id)
        self.instance = instance


class RouterLost(Exception):
    """The router holding a placement left the bus before answering (or no router took it): the
    request is placed again, never left to the client's timeout."""


class Reconnected(Exception):
    """The connection dropped under a stream and came back: chunks sent meanwhile may be lost, so the
    request is placed again after the tokens delivered."""


class RequestStream:
    """One request's output, chunk by chunk: an async iterator (``async for chunk in stream``) and an
    async context manager. The request is placed on the first ``__anext__`` (or ``async with``);
    ``accepted`` then says where it runs and holds the prompt's token ids. With several outputs
    (``n``) their chunks come interleaved, each in order within its output (``sample_index``); the
    iteration ends when every output has ended. Held outputs (beam search, ``best_of`` > ``n``)
    come only at the end: until then the decode worker's liveness probes, not output, show the
    request is alive, so a long search does not time out.

    Leaving early cancels the request at once: :meth:`aclose` (``async with`` exit, or an exception
    inside ``__anext__``) sends the cancel; so does leaving an ``async for`` with ``break`` (the
    loop's iterator, :class:`_Iteration`, is dropped then, even while the caller still holds the
    stream), and so does a stream dropped unfinished (``__del__``). (A plain async generator would
    only be closed whenever the event loop's finalizer gets to it, usually after the script has
    closed its connection.)

    A worker that dies mid-way (heartbeats stop, or a worker-failure error ends the stream) does not
    end a one-output request: it is placed again (:meth:`_migrate`) under its own placement id, going
    on after the tokens already delivered, at most ``client.max_migrations`` times."""

    def __init__(self, client: Client, request: GenerateRequest, timeout_s: float) -> None:
        self.client = client
        self.request = request
        self.request_id = request.request_id  # the caller's id; each placement after a migration has its own
        self.placement_id = request.request_id
        self.resume = ResumeState(client.max_migrations)
        self._placements = 0  # sent after the first (see tandem.client.migration.placement_request_id)
        self.timeout_s = timeout_s
        self.accepted: GenerateAccepted | None = None
        self.finished = False  # the last chunk came, or the request failed on the workers
        self._sent = False  # the router may have placed it: leaving now needs a cancel
        self._closed = False
        self._sub = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self.num_outputs = request.params.n
        self._pending: dict[tuple[int, int], StreamChunk] = {}  # (sample index, token index) -> chunk
        self._next_index: dict[int, int] = {}  # per output: the index of its next token
        self._ended: set[int] = set()  # outputs whose last chunk has been yielded
        self._probed = False  # the decode worker has probed this held-output stream: it holds the request
        self._placed = self._last_output = 0.0

    def __aiter__(self) -> _Iteration:
        return _Iteration(self)

    async def __aenter__(self) -> RequestStream:
        await self._ensure_open()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def __anext__(self) -> Chunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            await self._ensure_open()
            chunk = await self._next_chunk()
        except BaseException:  # a typed error, a timeout, Ctrl-C or a task cancelled: the request ends here
            # Without awaiting: a cancelled task (anyio cancels every later await too) still sends the cancel.
            self.close_nowait()
            raise
        if chunk.finish_reason is not None:
            self._ended.add(chunk.sample_index)
            if len(self._ended) >= self.num_outputs:
                self.finished = True
                await self.aclose()
        return chunk

    async def aclose(self) -> None:
        """Stop listening; cancel the request on the workers unless it already ended."""
        if self._closed:
            return
        self._closed = True
        self.client._open.pop(self.placement_id, None)
        await self.client._release(self._sub, self._cancel_id())

    def close_nowait(self) -> None:
        """:meth:`aclose` from synchronous code: the unsubscribe and the cancel go out in a task."""
        if not self._closed:
            self._closed = True
            self.client._open.pop(self.placement_id, None)
            self.client._release_soon(self._sub, self._cancel_id())

    def __del__(self) -> None:
        self.abandon()

    def abandon(self) -> None:
        """Nobody reads this stream any more: cancel its request unless it ended."""
        if not self._closed and self._sub is not None:
            self.close_nowait()

    # -- inside ---------------------------------------------------------------------------------
    @property
    def migrations(self) -> int:
        """Times this request was placed again after its worker died."""
        return self.resume.migrations

    def _cancel_id(self) -> str | None:
        return self.placement_id if self._sent and not self.finished else None

    async def _ensure_open(self) -> None:
        if self.accepted is not None:
            return
        await self._listen(self.request.stream_subject)
        self._sent = True
        try:
            self.accepted = await self.client._place(self.request, self.timeout_s)
        except RouterLost as exc:
            if not self._may_migrate():
                raise WorkerFailureError(str(exc), self.request_id) from None
            await self._migrate(str(exc))
            return
        self._placed = self._last_output = time.monotonic()

    async def _listen(self, inbox: str) -> None:
        """Subscribe the current placement's inbox, into a queue of its own (what an earlier
        placement left in its queue is dropped with it)."""
        client = self.client
        # The callback holds the queue, not the stream: nats-py keeps callbacks alive, and a stream
        # it kept alive would never be dropped, so never cancelled, by a ``break``.
        queue = self._queue = asyncio.Queue()
        held = self.request.params.holds_outputs

        async def on_message(msg) -> None:
            if msg.reply:  # a worker's liveness probe
                await msg.respond(b"ok")
                if held:
                    queue.put_nowait(PROBED)
                return
            queue.put_nowait(msg.data)

        try:
            self._sub = await client.nc.subscribe(inbox, cb=on_message)
            client._open[self.placement_id] = queue
            await client._watch_workers()
        except NatsError as exc:
            raise client._lost(exc, self.request_id) from None

    def _may_migrate(self) -> bool:
        # Several outputs (n, best_of, beams) migrate only before any of them delivered a token:
        # later, every candidate's tokens would have to be resumed.
        one = self.request.params.num_candidates == 1 or not self._next_index
        return self.client.max_migrations > 0 and one and not self._closed

    async def _migrate(self, reason: str, patient: bool = True) -> None:
        """Place the request again, going on after the tokens delivered so far: the placement that
        failed is let go (unsubscribed, and cancelled, in case its worker is only slow), the next one
        gets its own id and stream subject. A re-placement finding no router or no decode worker
        tries again until ``timeout_s`` (a crashed worker's replacement may be starting), unless
        not ``patient``: a worker that stopped on purpose is replaced by nobody when the whole
        deployment stops, so then the request fails with ``reason`` at once."""
        client, resume = self.client, self.resume
        if resume.limit_reached():
            raise WorkerFailureError(resume.limit_message(reason), self.request_id)
        log.info("%s: migrating after %d tokens (%s)", self.request_id, len(resume.token_ids), reason)
        resume.migrate(reason)
        self._pending.clear()  # chunks past a gap: the new placement streams them again
        self._probed = False
        deadline = time.monotonic() + self.timeout_s
        while True:
            client._open.pop(self.placement_id, None)
            await client._release(self._sub, self._cancel_id())
            self._placements += 1
            self.placement_id = placement_request_id(self.request_id, self._placements)
            inbox = subjects.stream_inbox(client.inbox_prefix, client.client_id, self.placement_id)
            request = resume.resumed_request(self.request, self.accepted, self.placement_id, inbox)
            self.finished = False
            await self._listen(inbox)
            try:
                accepted = await client._place(request, self.timeout_s, patient)
            except NoWorkersError as exc:
                if not patient:
                    raise ShuttingDownError(f"{reason}; no other worker took it on ({exc})", self.request_id) from None
                if time.monotonic() >= deadline:
                    raise NoWorkersError(f"{exc}; the request was migrating after: {reason}", self.request_id,
                                         exc.param) from None
                await asyncio.sleep(MIGRATION_RETRY_S)
                continue
            except RouterLost as exc:  # a migration of its own: the limit bounds a bus where no router answers
                if resume.limit_reached():
                    raise WorkerFailureError(resume.limit_message(str(exc)), self.request_id) from None
                log.info("%s: %s; placing it again", self.request_id, exc)
                resume.migrate(str(exc))
                continue
            self.accepted = accepted
            # A router that has not yet noticed the death (its own heartbeat timeout may be longer
            # than this client's) can place the request on the dead worker again: place it again
            # then, without counting a migration.
            dead = await client._first_dead(holders_of(accepted), None)
            if dead is None or time.monotonic() >= deadline:
                break
            resume.exclude(dead[0])
            log.debug("%s: placed on %s, which is gone: placing it again", self.request_id, dead[0])
            await asyncio.sleep(MIGRATION_RETRY_S)
        self._placed = self._last_output = time.monotonic()

    async def _next_chunk(self) -> Chunk:
        while True:
            try:
                return await self._next_chunk_of_placement()
            except Reconnected:
                await self.client._until_connected(self.request_id)
                if not self._may_migrate():
                    raise self.client._lost(None, self.request_id) from None
                await self._migrate("the connection to NATS dropped and came back")
            except WorkerFailureError as exc:
                if not self._may_migrate():
                    raise
                if isinstance(exc, WorkerGone):
                    self.resume.exclude(exc.instance)
                await self._migrate(str(exc), patient=not isinstance(exc, ShuttingDownError))

    async def _next_chunk_of_placement(self) -> Chunk:
        client = self.client
        while True:
            ready = self._pop_in_order()
            if ready is not None:
                if ready.sample_index == 0:
                    ready = self.resume.deliver(ready)
                return Chunk(ready.token_ids, ready.text, ready.finish_reason, ready.logprobs, ready.sample_index,
                             ready.cumulative_logprob, ready.prompt_logprobs)
            data = await get_within(self._queue, min(self.timeout_s, client.worker_timeout_s / 4, ROUTER_CHECK_S))
            if data is EMPTY:
                data = False
            if data is LOST or not client.nc.is_connected:
                raise Reconnected
            if data is False:
                if time.monotonic() - self._last_output > self.timeout_s:
                    raise RequestTimeoutError(f"no output for {self.timeout_s:.0f}s", self.request_id)
                # The prefill worker holds the request until the decode worker streams from it (or,
                # for held outputs, probes it): until the placement's second token.
                prefill_holds = (not self._probed
                                 and max(self._next_index.values(), default=0) <= self.resume.resumed + 1)
                await client._check_alive(self.request_id, holders_of(self.accepted, prefill_holds), self._placed)
                continue
            self._last_output = time.monotonic()
            if data is PROBED:
                self._probed = True
                continue
            chunk = decode(data, (StreamChunk, Probe))
            if isinstance(chunk, Probe):
                continue
            if chunk.request_id != self.placement_id:
                client.foreign_chunks += 1
                log.debug("%s: dropped a chunk naming request %r", self.request_id, shortened(chunk.request_id, 80))
                continue
            if chunk.error is not None:
                self.finished = True  # the workers ended it themselves (every output): nothing to cancel
                raise error_from_reply(chunk.error)
            if chunk.sample_index >= self.num_outputs or chunk.sample_index in self._ended:
                log.debug("%s: dropped a chunk of output %d (n=%d, ended: %s)", self.request_id, chunk.sample_index,
                          self.num_outputs, sorted(self._ended))
                continue
            self._pending[(chunk.sample_index, chunk.index)] = chunk

    def _pop_in_order(self) -> StreamChunk | None:
        """A pending chunk that continues its output, or None. Prefill and decode workers publish
        independently, so each output's chunks are released in token-index order."""
        for key in self._pending:
            sample, index = key
            if index == self._next_index.get(sample, 0):
                ready = self._pending.pop(key)
                self._next_index[sample] = index + len(ready.token_ids)
                return ready
        return None


class _Iteration:
    """One ``async for`` over a :class:`RequestStream`. Python drops a loop's iterator when
    ``break`` leaves the loop and tells it nothing; this one then cancels the request, so a caller
    that keeps the stream (``stream = client.generate(...)``) still frees the workers at once."""

    __slots__ = ("stream",)

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def __aiter__(self) -> _Iteration:
        return self

    async def __anext__(self) -> Chunk:
        return await self.stream.__anext__()

    def __del__(self) -> None:
        self.stream.abandon()
