"""tandem's async client library.

    import asyncio
    from tandem.client import connect

    async def main() -> None:
        async with connect() as client:  # the running `tandem up`; or connect("nats://host:4222")
            async for chunk in client.generate("def fib(n):", max_tokens=32):
                print(chunk.text, end="", flush=True)
            result = await client.complete("import os", max_tokens=16, temperature=0)
            print(result.text, result.finish_reason, result.ttft_s)
            several = await client.complete("def add(a, b):", n=3, temperature=0.8, max_tokens=16)
            for output in several.outputs:  # best first
                print(output.cumulative_logprob, output.text)
            beams = await client.beam_search("import", beam_width=4, max_tokens=8)

    asyncio.run(main())

Every :class:`SamplingParams` field is a keyword of ``generate``/``complete`` (``logit_bias`` may
also be a mapping of token id to bias). A request with ``n`` outputs (or ``best_of`` candidates, or
beams) streams chunks that name their output (:attr:`Chunk.sample_index`); the stream ends once
every output has its ``finish_reason``. ``complete`` returns them all in
:attr:`Completion.outputs`, best first, its own ``text``/``token_ids``/... being the best one's.

A request with one output survives its worker's death: when the worker streaming it stops
sending heartbeats (the prefill worker's count until the first token of the placement), or its
stream ends with a worker failure, the client places it again with the tokens delivered so far,
and the stream goes on with no gap and no duplicate (``max_migrations`` per request, default 3;
see :mod:`tandem.migration`).

Errors are typed: :class:`NoWorkersError`, :class:`RequestTimeoutError`,
:class:`InvalidRequestError` (and its :class:`UnknownModelError`, :class:`PromptTooLongError`),
:class:`WorkerFailureError`, :class:`ConnectionLostError`, all :class:`TandemError`; nats-py's own
errors never reach the caller. Leaving a ``generate`` loop early (``break``, an exception, Ctrl-C)
sends the request's cancel at once, so the workers free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from pydantic import ValidationError

from tandem.access import BusConnectError, bus_options, connect_command
from tandem.migration import ResumeState, placement_request_id
from tandem.runstate import find_running_url
from tandem.shared.auth.credentials import CredentialsError
from tandem.shared.infra.liveness import on_bus
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ErrorReply, ProtocolError, first_error, shortened
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import (
    Cancel,
    GenerateAccepted,
    GenerateRequest,
    PlacementReceived,
    Probe,
    SamplingParams,
    StreamChunk,
    TokenLogprobs,
)

log = logging.getLogger("tandem.client")


class TandemError(Exception):
    """Base of every error the client raises."""

    code = ErrorCode.WORKER_FAILURE

    def __init__(self, message: str, request_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.param = param  # the request field at fault, when the error names one ("max_tokens", "prompt")


class NoWorkersError(TandemError):
    code = ErrorCode.NO_WORKERS


class RequestTimeoutError(TandemError):
    code = ErrorCode.TIMEOUT


class InvalidRequestError(TandemError):
    code = ErrorCode.INVALID_REQUEST


class UnknownModelError(InvalidRequestError):
    code = ErrorCode.UNKNOWN_MODEL


class PromptTooLongError(InvalidRequestError):
    code = ErrorCode.PROMPT_TOO_LONG


class RequestTooLargeError(InvalidRequestError):
    """The request does not fit in one bus message (the server's ``max_payload``): refused before it
    is sent, so the connection is untouched. Send a shorter prompt (or its token ids)."""

    code = ErrorCode.REQUEST_TOO_LARGE


class WorkerFailureError(TandemError):
    code = ErrorCode.WORKER_FAILURE


class ShuttingDownError(WorkerFailureError):
    """The worker holding the request stopped before it finished (its shutdown timeout ran out)
    and no other worker could take it on: the deployment is stopping."""

    code = ErrorCode.SHUTTING_DOWN


class OverloadedError(TandemError):
    """Every decode worker is busy and the router's admission queue is full, or the request waited
    there its longest (``--router-max-queue-wait-s``): refused at once, so retry later."""

    code = ErrorCode.OVERLOADED


class ConnectionLostError(TandemError):
    """The NATS connection dropped and did not come back within ``reconnect_s`` (a stopping
    ``tandem up``, a server gone for good)."""

    code = ErrorCode.NO_WORKERS


_BY_CODE: dict[ErrorCode, type[TandemError]] = {
    ErrorCode.NO_WORKERS: NoWorkersError,
    ErrorCode.TIMEOUT: RequestTimeoutError,
    ErrorCode.UNKNOWN_MODEL: UnknownModelError,
    ErrorCode.PROMPT_TOO_LONG: PromptTooLongError,
    ErrorCode.INVALID_REQUEST: InvalidRequestError,
    ErrorCode.BAD_SCHEMA: InvalidRequestError,
    ErrorCode.BAD_FRAME: InvalidRequestError,
    ErrorCode.UNSUPPORTED_VERSION: InvalidRequestError,
    ErrorCode.WORKER_FAILURE: WorkerFailureError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.SHUTTING_DOWN: ShuttingDownError,
    ErrorCode.REQUEST_TOO_LARGE: RequestTooLargeError,
}


_EMPTY = object()


async def _get_within(queue: asyncio.Queue, timeout_s: float):
    """The queue's next item, or ``_EMPTY`` after ``timeout_s``. Not ``asyncio.wait_for``: on
    Python 3.11 it swallows a cancellation that lands while the item is ready (it returns the item
    instead), and a stream's items come that often, so Ctrl-C of ``tandem generate`` went unheard."""
    try:
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    except TimeoutError:
        return _EMPTY


def _first_error(exc: Exception) -> str:
    """``field: what is wrong`` for a pydantic error (its first one), else the exception's text."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    if not exc.errors()[0]["loc"]:  # a check across fields: its message names them itself
        return exc.errors()[0]["msg"].removeprefix("Value error, ")
    return first_error(exc)


def error_field(exc: Exception) -> str | None:
    """The request field a pydantic error's first finding is about: where it was found, or for a
    check across fields (``best_of (2) must be at least n (3)``) the field its message begins with,
    as :class:`SamplingParams`' cross-field checks name the field at fault first."""
    if not isinstance(exc, ValidationError) or not exc.errors():
        return None
    first = exc.errors()[0]
    if first["loc"]:
        return str(first["loc"][0])
    words = first["msg"].removeprefix("Value error, ").split()
    return words[0] if words and words[0] in SamplingParams.model_fields else None


def error_from_reply(reply: ErrorReply) -> TandemError:
    return _BY_CODE.get(reply.code, TandemError)(f"{reply.code.value}: {reply.message}", reply.request_id,
                                                 reply.param)


@dataclass
class Chunk:
    """New tokens of one output and their text, in order within that output; ``finish_reason`` is
    set on that output's last one. A request with several outputs interleaves their chunks."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    # With ``logprobs=N`` asked: one entry per token of ``token_ids`` (its logprob and the top N).
    logprobs: list[TokenLogprobs] | None = None
    # Which output (0..n-1); for held outputs (beam search, best_of > n) its rank, best first.
    sample_index: int = 0
    cumulative_logprob: float | None = None  # on an output's last chunk, when the workers sent it
    # With ``prompt_logprobs=N`` asked, on the request's first chunk: one entry per prompt token (None first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class CompletionOutput:
    """One output of a request, whole."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    # The sum of its tokens' logprobs: of ``logprobs`` when asked, else the workers' figure (None if none came).
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None  # with ``logprobs=N`` asked: one entry per token
    sample_index: int = 0  # as the workers numbered it (held outputs: their rank)
    token_times: list[float] = field(default_factory=list, repr=False)


@dataclass
class Completion:
    """A finished request. ``outputs`` holds every output, best first; the fields beside it
    (``text``, ``token_ids``, ``finish_reason``, ``logprobs``, ``cumulative_logprob``,
    ``token_times``, ``tpot_s``) are the best output's, so a one-output request reads as it always did."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None  # to the request's first token, of any output
    tpot_s: float | None  # mean time per output token after the first (the best output's)
    request_id: str = ""
    decode_worker: str = ""  # where the router placed it (after a migration: the last placement)
    prefill_worker: str | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    # With ``logprobs=N`` asked: one entry per output token, and the sum of their logprobs.
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # With ``prompt_logprobs=N`` asked: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    migrations: int = 0  # times it was placed again after its worker died


@dataclass
class _OutputParts:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None


class OutputAssembly:
    """The chunks of one request, as :class:`RequestStream` yields them, put together into its outputs."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.parts: dict[int, _OutputParts] = {}  # by sample index
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.first_token_at: float | None = None

    def add(self, chunk: Chunk, now: float) -> None:
        part = self.parts.setdefault(chunk.sample_index, _OutputParts())
        part.text.append(chunk.text)
        part.token_ids.extend(chunk.token_ids)
        part.token_times.extend([now] * len(chunk.token_ids))
        part.logprobs.extend(chunk.logprobs or ())
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = now
        if chunk.finish_reason is not None:
            part.finish_reason = chunk.finish_reason
        if chunk.cumulative_logprob is not None:
            part.cumulative_logprob = chunk.cumulative_logprob
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def outputs(self) -> list[CompletionOutput]:
        """Every output, best first: held outputs in the order the workers ranked them (a beam's
        rank comes from its length-penalised score, not from its sum of logprobs); streamed samples
        by cumulative logprob, highest first, any without one after them in sample order."""
        asked = self.params.logprobs is not None
        outputs = []
        for index, part in sorted(self.parts.items()):
            # With logprobs asked, their sum: it agrees with the entries returned whatever worker
            # sampled which token (a prefill worker samples the first); else the workers' figure.
            cumulative = sum(entry.logprob for entry in part.logprobs) if asked else part.cumulative_logprob
            outputs.append(CompletionOutput("".join(part.text), part.token_ids, part.finish_reason, cumulative,
                                            part.logprobs if asked else None, index, part.token_times))
        if not self.params.holds_outputs:
            outputs.sort(key=lambda o: (o.cumulative_logprob is None, -(o.cumulative_logprob or 0.0), o.sample_index))
        return outputs


_LOST = None  # put into a stream's queue when the connection drops: wakes it at once
_PROBED = object()  # put into a held-output stream's queue when the decode worker probes it: the request is there
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


class _WorkerGone(WorkerFailureError):
    """The worker holding a stream is gone (off the bus, or silent): its request migrates, never to it again."""

    def __init__(self, message: str, request_id: str, instance: str) -> None:
        super().__init__(message, request_id)
        self.instance = instance


class _RouterLost(Exception):
    """The router holding a placement left the bus before answering (or no router took it): the
    request is placed again, never left to the client's timeout."""


class _Reconnected(Exception):
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
        self._placements = 0  # sent after the first (see tandem.migration.placement_request_id)
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
        except _RouterLost as exc:
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
                    queue.put_nowait(_PROBED)
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
            except _RouterLost as exc:  # a migration of its own: the limit bounds a bus where no router answers
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
            except _Reconnected:
                await self.client._until_connected(self.request_id)
                if not self._may_migrate():
                    raise self.client._lost(None, self.request_id) from None
                await self._migrate("the connection to NATS dropped and came back")
            except WorkerFailureError as exc:
                if not self._may_migrate():
                    raise
                if isinstance(exc, _WorkerGone):
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
            data = await _get_within(self._queue, min(self.timeout_s, client.worker_timeout_s / 4, ROUTER_CHECK_S))
            if data is _EMPTY:
                data = False
            if data is _LOST or not client.nc.is_connected:
                raise _Reconnected
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
            if data is _PROBED:
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


class Client:
    """A connection to a tandem deployment. Make one with :func:`connect`."""

    def __init__(self, nc: nats.NATS, request_timeout_s: float = 30.0, worker_timeout_s: float = 3.0,
                 url: str = "", max_migrations: int = 3, reconnect_s: float = 10.0,
                 router_restart_wait_s: float = ROUTER_RESTART_WAIT_S) -> None:
        self.nc = nc
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.worker_timeout_s = worker_timeout_s  # a worker silent this long has died with our request
        self.max_migrations = max_migrations  # placements again after a worker died, per request (0: none)
        self.reconnect_s = reconnect_s  # how long a dropped connection may take to come back
        # How long a request waits for a router to come back once one answered this client (0: about a second).
        self.router_restart_wait_s = router_restart_wait_s
        self._router_answered = False  # a router has answered this client: one found missing is restarting
        self._connected = asyncio.Event()  # cleared while the connection is down
        self._connected.set()
        self._alive_checks: dict[str, tuple[float, asyncio.Future]] = {}  # instance -> (asked at, its answer)
        self.client_id = uuid.uuid4().hex[:12]
        self._inbox_prefix = ""
        self._last_beat: dict[str, float] = {}
        # instance -> the incarnation its latest beat named, and when a beat first named that one
        self._incarnation: dict[str, tuple[str, float]] = {}
        self._beats = None
        self._open: dict[str, asyncio.Queue] = {}  # placement id -> its stream's queue, while it streams
        self._cleanup: set[asyncio.Task] = set()  # cancels sent for streams dropped mid-way
        # Chunks that came on a stream's subject naming another request: dropped, never delivered.
        self.foreign_chunks = 0

    async def _watch_workers(self) -> None:
        """Follow every worker's heartbeats (once per client), so a request whose worker died
        migrates (or fails with :class:`WorkerFailureError`) at once instead of waiting for its timeout."""
        if self._beats is not None:
            return

        async def on_beat(msg) -> None:
            instance, now = msg.subject.rsplit(".", 1)[-1], time.monotonic()
            self._last_beat[instance] = now
            try:
                incarnation = decode(msg.data, Heartbeat).incarnation
            except ProtocolError:
                return
            if incarnation and incarnation != self._incarnation.get(instance, ("", 0.0))[0]:
                self._incarnation[instance] = (incarnation, now)

        self._beats = await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)

    async def _first_dead(self, holders: list[Holder], since: float | None) -> tuple[str, str] | None:
        """The instance id of the first of ``holders`` that died and why it is taken for dead, or
        None. With ``since`` (when the placement was made) a holder is dead when a restart replaced
        its process: a beat under its id first named another incarnation after ``since`` (the one
        that took the request had acknowledged it by then, so that beat is from a later process).
        Else when its heartbeats stopped for ``worker_timeout_s`` (counted from ``since`` for one
        never heard from; None: such a one is not judged), or, late by ``LATE_BEAT_S``, when it is
        off the bus (the server knows a kill -9 at once, so this finds one in about a second)."""
        now = time.monotonic()
        for holder in holders:
            service, worker = holder.service, holder.instance
            incarnation, first_seen = self._incarnation.get(worker, ("", 0.0))
            if (since is not None and holder.incarnation and incarnation and incarnation != holder.incarnation
                    and first_seen > since):
                return worker, f"worker {worker} restarted (its new process does not hold the request)"
            last = self._last_beat.get(worker, since)
            if last is None:
                continue
            if now - last > self.worker_timeout_s:
                return worker, f"worker {worker} stopped sending heartbeats"
            # Only one heard from: an instance that never beat (a test's stand-in) has no alive subject either.
            if now - last > LATE_BEAT_S and worker in self._last_beat and not await self._instance_alive(service,
                                                                                                         worker):
                return worker, f"worker {worker} left the bus"
        return None

    async def _check_alive(self, request_id: str, holders: list[Holder], since: float) -> None:
        """Raise :class:`WorkerFailureError` when one of ``holders`` died (see :meth:`_first_dead`)."""
        dead = await self._first_dead(holders, since)
        if dead is not None:
            raise _WorkerGone(dead[1], request_id, dead[0])

    def _lost(self, exc: Exception | None, request_id: str | None) -> ConnectionLostError:
        why = f" ({type(exc).__name__})" if exc is not None else ""
        return ConnectionLostError(f"lost the connection to NATS at {self.url or 'the server'}{why}", request_id)

    def connection_lost(self) -> None:
        """Wake every open stream: it waits for the connection to come back (``reconnect_s``), then
        is placed again after the tokens it delivered, since chunks sent meanwhile may be gone; or
        it fails with :class:`ConnectionLostError`."""
        if not self.nc.is_closed:
            self._connected.clear()
        else:
            self._connected.set()  # closed for good: wake whoever waits, to find it closed
        for queue in self._open.values():
            queue.put_nowait(_LOST)

    def connection_back(self) -> None:
        """The connection came back: heartbeats missed meanwhile say nothing about the workers."""
        now = time.monotonic()
        self._last_beat = dict.fromkeys(self._last_beat, now)
        self._connected.set()

    async def _until_connected(self, request_id: str | None) -> None:
        """Return once connected, waiting out a reconnection (``reconnect_s`` at most); else
        :class:`ConnectionLostError`."""
        deadline = time.monotonic() + self.reconnect_s
        while not self.nc.is_connected and not self.nc.is_closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # The event only wakes us early. nats-py marks the connection down, then waits for the old
            # socket to close before its disconnected callback clears the event: on a loaded machine a
            # stream can find the connection down with the event still set from before.
            self._connected.clear()
            try:
                async with asyncio.timeout(min(left, RECONNECT_WAIT_S)):  # not wait_for: see _get_within
                    await self._connected.wait()
            except TimeoutError:
                pass
        if not self.nc.is_connected:
            raise self._lost(None, request_id)

    @property
    def inbox_prefix(self) -> str:
        """The connection's inbox prefix: ``_INBOX``, or ``_INBOX.<user key>`` on a bus with identities."""
        if not self._inbox_prefix:
            self._inbox_prefix = self.nc.new_inbox().rsplit(".", 1)[0]
        return self._inbox_prefix

    @property
    def owner(self) -> str:
        """The token this client's requests and cancels are sent under, and its streams lie under:
        the user key on a bus with identities (nats-server enforces both), else the client id."""
        return subjects.stream_owner(subjects.stream_inbox(self.inbox_prefix, self.client_id, "any"))

    def stream(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
               timeout_s: float | None = None, priority: int = 0, **params) -> RequestStream:
        """One request as a :class:`RequestStream` (placed on first use). ``params`` are
        :class:`SamplingParams` fields; a bad one raises :class:`InvalidRequestError` here.
        ``priority`` orders the request in the router's admission queue while every decode worker
        is saturated: lower first (-100..100), equal ones first come first served."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        request = self._request(prompt, model, request_id, priority, params)
        inbox = subjects.stream_inbox(self.inbox_prefix, self.client_id, request.request_id)  # made of checked parts
        return RequestStream(self, request.model_copy(update={"stream_subject": inbox}),
                             timeout_s or self.request_timeout_s)

    def generate(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
                 timeout_s: float | None = None, priority: int = 0, **params) -> RequestStream:
        """Stream the output of one request: ``async for chunk in client.generate(...)``."""
        return self.stream(prompt, model=model, request_id=request_id, timeout_s=timeout_s, priority=priority,
                           **params)

    async def complete(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
                       timeout_s: float | None = None, priority: int = 0, **params) -> Completion:
        """Run one request to the end and return every output (best first) with its timings."""
        start = time.perf_counter()
        stream = self.stream(prompt, model=model, request_id=request_id, timeout_s=timeout_s, priority=priority,
                             **params)
        assembly = OutputAssembly(stream.request.params)
        async with stream:
            async for chunk in stream:
                assembly.add(chunk, time.perf_counter())
        accepted = stream.accepted
        outputs = assembly.outputs()
        best = outputs[0] if outputs else CompletionOutput("", [], None, None, None)
        times = best.token_times
        ttft = assembly.first_token_at - start if assembly.first_token_at is not None else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return Completion(best.text, best.token_ids, accepted.prompt_token_ids, best.finish_reason, ttft, tpot,
                          stream.request_id, accepted.decode_worker, accepted.prefill_worker, times, best.logprobs,
                          best.cumulative_logprob, outputs, assembly.prompt_logprobs, stream.migrations)

    async def beam_search(self, prompt: str | list[int], *, beam_width: int, n: int | None = None,
                          length_penalty: float = 1.0, early_stopping: bool | str = False, model: str | None = None,
                          request_id: str | None = None, timeout_s: float | None = None, **params) -> Completion:
        """Beam search with ``beam_width`` beams: the ``n`` best finished beams (default: all of
        them), best first, as transformers' ``generate(num_beams=beam_width, do_sample=False)``
        ranks them (sum of logprobs / length ** ``length_penalty``). ``params``: other
        :class:`SamplingParams` fields (``max_tokens``, ``stop_token_ids``, ``logprobs``, ...)."""
        return await self.complete(prompt, model=model, request_id=request_id, timeout_s=timeout_s,
                                   beam_width=beam_width, n=beam_width if n is None else n,
                                   length_penalty=length_penalty, early_stopping=early_stopping, **params)

    def _request(self, prompt, model, request_id, priority: int, params: dict) -> GenerateRequest:
        """The request to send, or :class:`InvalidRequestError` naming the first field out of its
        bounds (checked before anything is sent: no value msgpack cannot carry reaches ``encode``)."""
        shown = request_id if isinstance(request_id, str) else None
        if isinstance(params.get("logit_bias"), Mapping):  # {token id: bias}, as OpenAI writes it
            params = {**params, "logit_bias": list(params["logit_bias"].items())}
        try:
            sampling = SamplingParams(**params)
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {_first_error(exc)}", shown,
                                      error_field(exc)) from None
        try:
            return GenerateRequest(
                request_id=request_id, params=sampling, model=model, stream_subject="_INBOX.unset", priority=priority,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
            )
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid request: {_first_error(exc)}", shown, error_field(exc)) from None

    async def _place(self, request: GenerateRequest, timeout: float, patient: bool = True) -> GenerateAccepted:
        """Send ``request`` to a router and return where it placed it, or raise its typed error.
        Raises :class:`_RouterLost` when the router that took it left the bus before answering
        (the caller places it again under a new id, so the first placement, if it was made after
        all, is cancelled rather than run twice). Finding no router, it asks again for about a
        second, or, ``patient`` and a router having answered this client before, for
        ``router_restart_wait_s`` (one is likely restarting); then :class:`NoWorkersError`."""
        payload = encode(request.model_copy(update={"ack_placement": True}))
        if len(payload) > self.nc.max_payload:
            # nats-py would raise MaxPayloadError; refused here, as the request's own fault, with the
            # connection untouched.
            raise RequestTooLargeError(f"the request is {len(payload):,} bytes on the bus, over the server's "
                                       f"max_payload of {self.nc.max_payload:,}: send a shorter prompt",
                                       request.request_id, "prompt")
        restarting = patient and self._router_answered and self.router_restart_wait_s > 0
        patience = self.router_restart_wait_s if restarting else PLACEMENT_TRIES * PLACEMENT_RETRY_S
        give_up = time.monotonic() + min(timeout, patience)
        while True:
            if not patient and not self.nc.is_connected:
                # A worker stopped on purpose and then the bus went too: the deployment is stopping,
                # so waiting ``reconnect_s`` for a server nobody restarts would only delay the error.
                raise NoWorkersError("the connection to NATS dropped while the deployment stops",
                                     request.request_id)
            await self._until_connected(request.request_id)
            replies: asyncio.Queue = asyncio.Queue()

            async def on_reply(msg, replies=replies) -> None:
                replies.put_nowait(msg)

            try:
                sub = await self.nc.subscribe(self.nc.new_inbox(), cb=on_reply)
                await self.nc.publish(subjects.router_generate(self.owner), payload, reply=sub.subject)
            except NatsError as exc:
                raise self._lost(exc, request.request_id) from None
            try:
                return await self._placement_reply(request.request_id, replies, timeout, patient)
            except NoRespondersError:
                # Answered at once by the server: no router subscribes right now (one restarting, or
                # none deployed). Asked again meanwhile, so a router's restart does not fail the request.
                if time.monotonic() + PLACEMENT_RETRY_S < give_up:
                    await asyncio.sleep(PLACEMENT_RETRY_S)
                    continue
                raise NoWorkersError("no router is running" + (f" (none came back within {patience:.0f}s)"
                                                               if restarting else ""),
                                     request.request_id) from None
            finally:
                try:
                    await sub.unsubscribe()
                except NatsError:
                    pass

    async def _placement_reply(self, request_id: str, replies: asyncio.Queue, timeout: float,
                               patient: bool = True) -> GenerateAccepted:
        """The router's answer on ``replies``: first :class:`PlacementReceived` (which router holds
        the request), then the outcome. While waiting, the holder is asked whether it is still on
        the bus; a missing acknowledgement, a holder gone or a connection that dropped meanwhile
        (the answer may be lost) raise :class:`_RouterLost`."""
        deadline = time.monotonic() + timeout
        router = None
        while True:
            left = deadline - time.monotonic()
            msg = await _get_within(replies, max(0.0, min(PLACEMENT_ACK_S if router is None else ROUTER_CHECK_S, left)))
            if msg is _EMPTY:
                if not self.nc.is_connected:
                    if patient:
                        await self._until_connected(request_id)
                    raise _RouterLost("the connection to NATS dropped while the request was being placed")
                if time.monotonic() >= deadline:
                    raise RequestTimeoutError(f"the router did not answer in {timeout:.0f}s", request_id)
                if router is None:
                    raise _RouterLost(f"no router took the request within {PLACEMENT_ACK_S:.1f}s")
                if not await self._instance_alive("router", router):
                    raise _RouterLost(f"router {router} left the bus while it placed the request")
                continue
            if msg.headers and msg.headers.get("Status") == "503":
                raise NoRespondersError
            try:
                reply = decode(msg.data, (PlacementReceived, GenerateAccepted, ErrorReply))
            except ProtocolError as exc:
                raise WorkerFailureError(f"bad reply from router: {exc}", request_id) from None
            self._router_answered = True
            if isinstance(reply, PlacementReceived):
                router = reply.router
            elif isinstance(reply, ErrorReply):
                raise error_from_reply(reply)
            else:
                return reply

    async def _instance_alive(self, service: str, instance_id: str) -> bool:
        """Whether the instance's process is still on the bus. Asked once per ``ROUTER_CHECK_S``
        however many requests it holds; a slow answer counts as alive, only an instance gone
        (no responders) as dead."""
        now = time.monotonic()
        checked = self._alive_checks.get(instance_id)
        if checked is None or now - checked[0] > ROUTER_CHECK_S:
            checked = (now, asyncio.ensure_future(on_bus(self.nc, service, instance_id, ALIVE_CHECK_TIMEOUT_S)))
            self._alive_checks[instance_id] = checked
        return await asyncio.shield(checked[1])


    async def _release(self, sub, cancel_id: str | None) -> None:
        """Unsubscribe a stream's inbox and, for a request still running, cancel it on the workers."""
        try:
            if sub is not None:
                await sub.unsubscribe()
            if cancel_id is not None and self.nc.is_connected:
                # Sent under this client's owner token, naming the stream (see Cancel).
                inbox = subjects.stream_inbox(self.inbox_prefix, self.client_id, cancel_id)
                await self.nc.publish(subjects.cancel(self.owner),
                                      encode(Cancel(request_id=cancel_id, stream_subject=inbox)))
        except NatsError:
            pass  # the connection is gone: the workers find the client gone by their liveness probe

    def _release_soon(self, sub, cancel_id: str | None) -> None:
        """:meth:`_release` from synchronous code (a dropped stream's ``__del__``)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop any more (interpreter exit): nothing can be sent
        task = loop.create_task(self._release(sub, cancel_id))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def cancel_open(self) -> None:
        """Cancel every request still streaming, and wait for the cancels already on their way."""
        for request_id in list(self._open):
            self._open.pop(request_id)
            await self._release(None, request_id)
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    async def close(self) -> None:
        """Cancel whatever still streams, send pending cancels, then drain the connection."""
        await self.cancel_open()
        try:
            if self.nc.is_connected:
                await self.nc.drain()
            elif not self.nc.is_closed:
                await self.nc.close()
        except (NatsError, OSError):  # closing mid-reconnect: the socket may already be gone
            pass


def resolve_url(url: str | None) -> str:
    """``url``, else ``TANDEM_NATS_URL``, else the running ``tandem up``'s (its state file in the data
    dir, ``TANDEM_DATA_DIR`` or the default); :class:`TandemError` when there is none."""
    found = url or os.environ.get("TANDEM_NATS_URL") or find_running_url()
    if not found:
        raise TandemError("no running tandem found: start one with `tandem up`, or pass its NATS URL to connect()")
    return found


@asynccontextmanager
async def connect(url: str | None = None, *, request_timeout_s: float = 30.0, worker_timeout_s: float = 3.0,
                  max_migrations: int = 3, reconnect_s: float = 10.0, creds: str | None = None,
                  data_dir: str | None = None,
                  tls_ca: str | None = None, tls_cert: str | None = None,
                  tls_key: str | None = None) -> AsyncIterator[Client]:
    """Connect to the NATS server of a tandem deployment (``url`` unset: see :func:`resolve_url`)
    as a client: with ``creds`` (a role key or NATS user credentials file; else
    ``TANDEM_NATS_CREDS``, else the client key of the ``tandem up`` serving that URL from
    ``data_dir`` or the default one, see :mod:`tandem.access`) and the TLS files given.
    ``max_migrations``: how many times a request is placed again after its worker died (0: never).
    ``reconnect_s``: how long a dropped connection may take to come back (a nats-server restarted
    by ``tandem up``); streams wait it out, then go on where they were.
    nats-py's own error reports go to the ``tandem.client`` logger at DEBUG, not as tracebacks."""
    url = resolve_url(url)
    try:
        options = bus_options("client", "tandem-client", url, creds=creds, data_dir=data_dir, tls_ca=tls_ca,
                              tls_cert=tls_cert, tls_key=tls_key)
    except CredentialsError as exc:
        raise TandemError(str(exc)) from None
    holder: list[Client] = []

    async def on_error(exc: Exception) -> None:
        log.debug("nats: %s: %s", type(exc).__name__, exc)

    async def on_disconnect() -> None:
        for client in holder:
            client.connection_lost()

    async def on_reconnect() -> None:
        for client in holder:
            client.connection_back()

    try:
        nc = await connect_command(url, options, on_error=on_error, name="tandem-client", max_reconnect_attempts=3,
                                   allow_reconnect=True, reconnect_time_wait=RECONNECT_WAIT_S,
                                   disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                                   closed_cb=on_disconnect)
        # nats-py counts the first connection's tries against the same limit: a server that is not
        # there fails in about a second, and only a connection once made waits ``reconnect_s``.
        nc.options["max_reconnect_attempts"] = max(1, math.ceil(reconnect_s / RECONNECT_WAIT_S))
    except BusConnectError as exc:
        raise TandemError(str(exc)) from None
    client = Client(nc, request_timeout_s, worker_timeout_s, url, max_migrations, reconnect_s)
    holder.append(client)
    try:
        yield client
    finally:
        await client.close()
