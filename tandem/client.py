"""tandem's async client library.

    import asyncio
    from tandem.client import connect

    async def main() -> None:
        async with connect() as client:  # the running `tandem up`; or connect("nats://host:4222")
            async for chunk in client.generate("def fib(n):", max_tokens=32):
                print(chunk.text, end="", flush=True)
            result = await client.complete("import os", max_tokens=16, temperature=0)
            print(result.text, result.finish_reason, result.ttft_s)

    asyncio.run(main())

Errors are typed: :class:`NoWorkersError`, :class:`RequestTimeoutError`,
:class:`InvalidRequestError` (and its :class:`UnknownModelError`, :class:`PromptTooLongError`),
:class:`WorkerFailureError`, :class:`ConnectionLostError`, all :class:`TandemError`; nats-py's own
errors never reach the caller. Leaving a ``generate`` loop early (``break``, an exception, Ctrl-C)
sends the request's cancel at once, so the workers free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from tandem.access import BusConnectError, bus_options, connect_command
from tandem.runstate import find_running_url
from tandem.shared.auth.credentials import CredentialsError
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ErrorReply, ProtocolError, first_error
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import (
    Cancel,
    GenerateAccepted,
    GenerateRequest,
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


class WorkerFailureError(TandemError):
    code = ErrorCode.WORKER_FAILURE


class ConnectionLostError(TandemError):
    """The NATS connection dropped, or the server went away (a stopping ``tandem up``)."""

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
}


def _first_error(exc: Exception) -> str:
    """``field: what is wrong`` for a pydantic error (its first one), else the exception's text."""
    return first_error(exc) if isinstance(exc, ValidationError) else str(exc)


def error_from_reply(reply: ErrorReply) -> TandemError:
    return _BY_CODE.get(reply.code, TandemError)(f"{reply.code.value}: {reply.message}", reply.request_id,
                                                 reply.param)


@dataclass
class Chunk:
    """New output tokens and their text, in order; ``finish_reason`` is set on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    # With ``logprobs=N`` asked: one entry per token of ``token_ids`` (its logprob and the top N).
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    request_id: str = ""
    decode_worker: str = ""  # where the router placed it
    prefill_worker: str | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    # With ``logprobs=N`` asked: one entry per output token, and the sum of their logprobs.
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


_LOST = None  # put into a stream's queue when the connection drops: wakes it at once


class RequestStream:
    """One request's output, chunk by chunk: an async iterator (``async for chunk in stream``) and an
    async context manager. The request is placed on the first ``__anext__`` (or ``async with``);
    ``accepted`` then says where it runs and holds the prompt's token ids.

    Leaving early cancels the request at once: :meth:`aclose` (``async with`` exit, or an exception
    inside ``__anext__``) sends the cancel, and a stream dropped mid-way (``break`` out of
    ``async for``) sends it from ``__del__``, which runs as soon as the loop lets go of it. (A plain
    async generator would only be closed whenever the event loop's finalizer gets to it, usually
    after the script has closed its connection.)"""

    def __init__(self, client: Client, request: GenerateRequest, timeout_s: float) -> None:
        self.client = client
        self.request = request
        self.request_id = request.request_id
        self.timeout_s = timeout_s
        self.accepted: GenerateAccepted | None = None
        self.finished = False  # the last chunk came, or the request failed on the workers
        self._sent = False  # the router may have placed it: leaving now needs a cancel
        self._closed = False
        self._sub = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pending: dict[int, StreamChunk] = {}
        self._next_index = 0
        self._placed = self._last_output = 0.0

    def __aiter__(self) -> RequestStream:
        return self

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
            self.finished = True
            await self.aclose()
        return chunk

    async def aclose(self) -> None:
        """Stop listening; cancel the request on the workers unless it already ended."""
        if self._closed:
            return
        self._closed = True
        self.client._open.pop(self.request_id, None)
        await self.client._release(self._sub, self._cancel_id())

    def close_nowait(self) -> None:
        """:meth:`aclose` from synchronous code: the unsubscribe and the cancel go out in a task."""
        if not self._closed:
            self._closed = True
            self.client._open.pop(self.request_id, None)
            self.client._release_soon(self._sub, self._cancel_id())

    def __del__(self) -> None:
        if not self._closed and self._sub is not None:
            self.close_nowait()

    # -- inside ---------------------------------------------------------------------------------
    def _cancel_id(self) -> str | None:
        return self.request_id if self._sent and not self.finished else None

    async def _ensure_open(self) -> None:
        if self.accepted is not None:
            return
        client = self.client
        inbox = self.request.stream_subject
        queue = self._queue  # the callback holds the queue, not the stream: nats-py keeps callbacks alive,
        # and a stream it kept alive would never be dropped, so never cancelled, by a ``break``

        async def on_message(msg) -> None:
            if msg.reply:  # a worker's liveness probe
                await msg.respond(b"ok")
                return
            queue.put_nowait(msg.data)

        try:
            self._sub = await client.nc.subscribe(inbox, cb=on_message)
            client._open[self.request_id] = self._queue
            await client._watch_workers()
        except NatsError as exc:
            raise client._lost(exc, self.request_id) from None
        self._sent = True
        self.accepted = await client._place(self.request, self.timeout_s)
        self._placed = self._last_output = time.monotonic()

    async def _next_chunk(self) -> Chunk:
        client = self.client
        while True:
            if self._next_index in self._pending:
                # Prefill and decode workers publish independently: release chunks in index order.
                ready = self._pending.pop(self._next_index)
                self._next_index += len(ready.token_ids)
                return Chunk(ready.token_ids, ready.text, ready.finish_reason, ready.logprobs)
            try:
                data = await asyncio.wait_for(self._queue.get(), min(self.timeout_s, client.worker_timeout_s / 4))
            except TimeoutError:
                data = False
            if data is _LOST or not client.nc.is_connected:
                raise client._lost(None, self.request_id)
            if data is False:
                if time.monotonic() - self._last_output > self.timeout_s:
                    raise RequestTimeoutError(f"no output for {self.timeout_s:.0f}s", self.request_id)
                # The prefill worker holds the request until the decode worker streams from it.
                holders = [self.accepted.decode_worker]
                if self.accepted.prefill_worker and self._next_index <= 1:
                    holders.append(self.accepted.prefill_worker)
                client._check_alive(self.request_id, holders, self._placed)
                continue
            self._last_output = time.monotonic()
            chunk = decode(data, (StreamChunk, Probe))
            if isinstance(chunk, Probe):
                continue
            if chunk.error is not None:
                self.finished = True  # the workers ended it themselves: nothing to cancel
                raise error_from_reply(chunk.error)
            self._pending[chunk.index] = chunk


class Client:
    """A connection to a tandem deployment. Make one with :func:`connect`."""

    def __init__(self, nc: nats.NATS, request_timeout_s: float = 30.0, worker_timeout_s: float = 3.0,
                 url: str = "") -> None:
        self.nc = nc
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.worker_timeout_s = worker_timeout_s  # a worker silent this long has died with our request
        self.client_id = uuid.uuid4().hex[:12]
        self._inbox_prefix = ""
        self._last_beat: dict[str, float] = {}
        self._beats = None
        self._open: dict[str, asyncio.Queue] = {}  # request id -> its stream's queue, while it streams
        self._cleanup: set[asyncio.Task] = set()  # cancels sent for streams dropped mid-way

    async def _watch_workers(self) -> None:
        """Follow every worker's heartbeats (once per client), so a request whose worker died
        fails at once with :class:`WorkerFailureError` instead of waiting for its timeout."""
        if self._beats is not None:
            return

        async def on_beat(msg) -> None:
            self._last_beat[msg.subject.rsplit(".", 1)[-1]] = time.monotonic()

        self._beats = await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)

    def _check_alive(self, request_id: str, workers: list[str], since: float) -> None:
        now = time.monotonic()
        for worker in workers:
            if now - self._last_beat.get(worker, since) > self.worker_timeout_s:
                raise WorkerFailureError(f"worker {worker} stopped sending heartbeats", request_id)

    def _lost(self, exc: Exception | None, request_id: str | None) -> ConnectionLostError:
        why = f" ({type(exc).__name__})" if exc is not None else ""
        return ConnectionLostError(f"lost the connection to NATS at {self.url or 'the server'}{why}", request_id)

    def connection_lost(self) -> None:
        """Wake every open stream: it fails with :class:`ConnectionLostError` (its chunks are gone)."""
        for queue in self._open.values():
            queue.put_nowait(_LOST)

    @property
    def inbox_prefix(self) -> str:
        """The connection's inbox prefix: ``_INBOX``, or ``_INBOX.<user key>`` on a bus with identities."""
        if not self._inbox_prefix:
            self._inbox_prefix = self.nc.new_inbox().rsplit(".", 1)[0]
        return self._inbox_prefix

    def stream(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
               timeout_s: float | None = None, **params) -> RequestStream:
        """One request as a :class:`RequestStream` (placed on first use). ``params`` are
        :class:`SamplingParams` fields; a bad one raises :class:`InvalidRequestError` here."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        request = self._request(prompt, model, request_id, params)
        inbox = subjects.stream_inbox(self.inbox_prefix, self.client_id, request.request_id)  # made of checked parts
        return RequestStream(self, request.model_copy(update={"stream_subject": inbox}),
                             timeout_s or self.request_timeout_s)

    def generate(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
                 timeout_s: float | None = None, **params) -> RequestStream:
        """Stream the output of one request: ``async for chunk in client.generate(...)``."""
        return self.stream(prompt, model=model, request_id=request_id, timeout_s=timeout_s, **params)

    async def complete(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
                       timeout_s: float | None = None, **params) -> Completion:
        """Run one request to the end and return the whole output with its timings."""
        start = time.perf_counter()
        text, ids, times, reason = [], [], [], None
        logprobs: list[TokenLogprobs] = []
        stream = self.stream(prompt, model=model, request_id=request_id, timeout_s=timeout_s, **params)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                times.extend([now] * len(chunk.token_ids))
                reason = chunk.finish_reason
                logprobs.extend(chunk.logprobs or ())
        accepted = stream.accepted
        ttft = times[0] - start if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        asked = stream.request.params.logprobs is not None
        return Completion("".join(text), ids, accepted.prompt_token_ids, reason, ttft, tpot, accepted.request_id,
                          accepted.decode_worker, accepted.prefill_worker, times,
                          logprobs if asked else None,
                          sum(entry.logprob for entry in logprobs) if asked else None)

    def _request(self, prompt, model, request_id, params: dict) -> GenerateRequest:
        """The request to send, or :class:`InvalidRequestError` naming the first field out of its
        bounds (checked before anything is sent: no value msgpack cannot carry reaches ``encode``)."""
        shown = request_id if isinstance(request_id, str) else None
        try:
            sampling = SamplingParams(**params)
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {_first_error(exc)}", shown) from None
        try:
            return GenerateRequest(
                request_id=request_id, params=sampling, model=model, stream_subject="_INBOX.unset",
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
            )
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid request: {_first_error(exc)}", shown) from None

    async def _place(self, request: GenerateRequest, timeout: float) -> GenerateAccepted:
        if not self.nc.is_connected:  # reconnecting or closed: nats-py would hold the request to its timeout
            raise self._lost(None, request.request_id)
        try:
            msg = await self.nc.request(subjects.ROUTER_GENERATE, encode(request), timeout=timeout)
        except NoRespondersError:
            raise NoWorkersError("no router is running", request.request_id) from None
        except NatsTimeoutError:
            raise RequestTimeoutError(f"the router did not answer in {timeout:.0f}s", request.request_id) from None
        except NatsError as exc:
            raise self._lost(exc, request.request_id) from None
        try:
            reply = decode(msg.data, (GenerateAccepted, ErrorReply))
        except ProtocolError as exc:
            raise WorkerFailureError(f"bad reply from router: {exc}", request.request_id) from None
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply)
        return reply

    async def _release(self, sub, cancel_id: str | None) -> None:
        """Unsubscribe a stream's inbox and, for a request still running, cancel it on the workers."""
        try:
            if sub is not None:
                await sub.unsubscribe()
            if cancel_id is not None and self.nc.is_connected:
                # The stream's subject is the owner's proof (see Cancel).
                inbox = subjects.stream_inbox(self.inbox_prefix, self.client_id, cancel_id)
                await self.nc.publish(subjects.CANCEL, encode(Cancel(request_id=cancel_id, stream_subject=inbox)))
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
                  creds: str | None = None, data_dir: str | None = None, tls_ca: str | None = None,
                  tls_cert: str | None = None, tls_key: str | None = None) -> AsyncIterator[Client]:
    """Connect to the NATS server of a tandem deployment (``url`` unset: see :func:`resolve_url`)
    as a client: with ``creds`` (a role key or NATS user credentials file; else
    ``TANDEM_NATS_CREDS``, else the client key of the ``tandem up`` serving that URL from
    ``data_dir`` or the default one, see :mod:`tandem.access`) and the TLS files given.
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

    try:
        nc = await connect_command(url, options, on_error=on_error, name="tandem-client", max_reconnect_attempts=3,
                                   allow_reconnect=True, reconnect_time_wait=0.5, disconnected_cb=on_disconnect,
                                   closed_cb=on_disconnect)
    except BusConnectError as exc:
        raise TandemError(str(exc)) from None
    client = Client(nc, request_timeout_s, worker_timeout_s, url)
    holder.append(client)
    try:
        yield client
    finally:
        await client.close()
