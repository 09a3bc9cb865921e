"""tandem's async client library.

    from tandem.client import connect

    async with connect("nats://127.0.0.1:4222") as client:
        async for chunk in client.generate("def fib(n):", max_tokens=32):
            print(chunk.text, end="", flush=True)
        result = await client.complete("import os", max_tokens=16, temperature=0)
        print(result.text, result.finish_reason, result.ttft_s)

Errors are typed: :class:`NoWorkersError`, :class:`RequestTimeoutError`,
:class:`InvalidRequestError` (and its :class:`UnknownModelError`, :class:`PromptTooLongError`),
:class:`WorkerFailureError`, all :class:`TandemError`. Leaving a ``generate`` loop early cancels the
request on the workers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from pydantic import ValidationError

from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ErrorReply, ProtocolError, first_error
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import Cancel, GenerateAccepted, GenerateRequest, Probe, SamplingParams, StreamChunk


class TandemError(Exception):
    """Base of every error the client raises."""

    code = ErrorCode.WORKER_FAILURE

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


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
    return _BY_CODE.get(reply.code, TandemError)(f"{reply.code.value}: {reply.message}", reply.request_id)


@dataclass
class Chunk:
    """New output tokens and their text, in order; ``finish_reason`` is set on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


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


class Client:
    """A connection to a tandem deployment. Make one with :func:`connect`."""

    def __init__(self, nc: nats.NATS, request_timeout_s: float = 30.0, worker_timeout_s: float = 3.0) -> None:
        self.nc = nc
        self.request_timeout_s = request_timeout_s
        self.worker_timeout_s = worker_timeout_s  # a worker silent this long has died with our request
        self.client_id = uuid.uuid4().hex[:12]
        self._last_beat: dict[str, float] = {}
        self._beats = None

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

    async def generate(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
                       timeout_s: float | None = None, **params) -> AsyncIterator[Chunk]:
        """Stream the output of one request. ``params`` are :class:`SamplingParams` fields."""
        async for chunk, _accepted in self._stream(prompt, model, request_id, timeout_s, params):
            yield chunk

    async def complete(self, prompt: str | list[int], *, model: str | None = None, request_id: str | None = None,
                       timeout_s: float | None = None, **params) -> Completion:
        """Run one request to the end and return the whole output with its timings."""
        start = time.perf_counter()
        text, ids, times, reason, accepted = [], [], [], None, None
        async for chunk, accepted in self._stream(prompt, model, request_id, timeout_s, params):  # noqa: B007
            now = time.perf_counter()
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            times.extend([now] * len(chunk.token_ids))
            reason = chunk.finish_reason
        ttft = times[0] - start if times else None
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return Completion("".join(text), ids, accepted.prompt_token_ids if accepted else [], reason, ttft, tpot,
                          accepted.request_id if accepted else "", accepted.decode_worker if accepted else "",
                          accepted.prefill_worker if accepted else None, times)

    def _request(self, prompt, model, request_id: str, inbox: str, params: dict) -> GenerateRequest:
        """The request to send, or :class:`InvalidRequestError` naming the first field out of its
        bounds (checked before anything is sent: no value msgpack cannot carry reaches ``encode``)."""
        try:
            sampling = SamplingParams(**params)
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {_first_error(exc)}", request_id) from None
        try:
            return GenerateRequest(
                request_id=request_id, params=sampling, model=model, stream_subject=inbox,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
            )
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid request: {_first_error(exc)}", request_id) from None

    async def _stream(self, prompt, model, request_id, timeout_s, params):
        timeout = timeout_s or self.request_timeout_s
        request_id = request_id or uuid.uuid4().hex
        inbox = subjects.stream_inbox(self.client_id, request_id)
        request = self._request(prompt, model, request_id, inbox, params)
        queue: asyncio.Queue = asyncio.Queue()

        async def on_message(msg) -> None:
            if msg.reply:  # a worker's liveness probe
                await msg.respond(b"ok")
                return
            queue.put_nowait(msg.data)

        sub = await self.nc.subscribe(inbox, cb=on_message)
        finished = False
        try:
            await self._watch_workers()
            accepted = await self._place(request, timeout)
            placed = last_output = time.monotonic()
            pending: dict[int, StreamChunk] = {}
            next_index = 0
            while not finished:
                try:
                    data = await asyncio.wait_for(queue.get(), min(timeout, self.worker_timeout_s / 4))
                except TimeoutError:
                    if time.monotonic() - last_output > timeout:
                        raise RequestTimeoutError(f"no output for {timeout:.0f}s", request_id) from None
                    # The prefill worker holds the request until the decode worker streams from it.
                    holders = [accepted.decode_worker]
                    if accepted.prefill_worker and next_index <= 1:
                        holders.append(accepted.prefill_worker)
                    self._check_alive(request_id, holders, placed)
                    continue
                last_output = time.monotonic()
                chunk = decode(data, (StreamChunk, Probe))
                if isinstance(chunk, Probe):
                    continue
                if chunk.error is not None:
                    finished = True
                    raise error_from_reply(chunk.error)
                pending[chunk.index] = chunk
                # Prefill and decode workers publish independently: release chunks in index order.
                while next_index in pending and not finished:
                    ready = pending.pop(next_index)
                    next_index += len(ready.token_ids)
                    finished = ready.finish_reason is not None
                    yield Chunk(ready.token_ids, ready.text, ready.finish_reason), accepted
        finally:
            try:
                await sub.unsubscribe()
                if not finished:
                    await self.nc.publish(subjects.CANCEL, encode(Cancel(request_id=request_id)))
            except nats.errors.ConnectionClosedError:
                pass  # closing anyway; workers find the client gone by their liveness probe

    async def _place(self, request: GenerateRequest, timeout: float) -> GenerateAccepted:
        try:
            msg = await self.nc.request(subjects.ROUTER_GENERATE, encode(request), timeout=timeout)
        except NoRespondersError:
            raise NoWorkersError("no router is running", request.request_id) from None
        except NatsTimeoutError:
            raise RequestTimeoutError(f"the router did not answer in {timeout:.0f}s", request.request_id) from None
        try:
            reply = decode(msg.data, (GenerateAccepted, ErrorReply))
        except ProtocolError as exc:
            raise WorkerFailureError(f"bad reply from router: {exc}", request.request_id) from None
        if isinstance(reply, ErrorReply):
            raise error_from_reply(reply)
        return reply


@asynccontextmanager
async def connect(url: str = "nats://127.0.0.1:4222", *, request_timeout_s: float = 30.0,
                  worker_timeout_s: float = 3.0) -> AsyncIterator[Client]:
    """Connect to the NATS server of a tandem deployment."""
    try:
        nc = await nats.connect(url, name="tandem-client", connect_timeout=5, max_reconnect_attempts=3,
                                allow_reconnect=True)
    except Exception as exc:
        raise TandemError(f"cannot reach NATS at {url}: {exc}") from None
    try:
        yield Client(nc, request_timeout_s, worker_timeout_s)
    finally:
        await nc.drain()
