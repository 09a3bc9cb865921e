"""Embeddings over the bus, the client's side: :meth:`Client.embed <tandem.client.Client.embed>`.

Each input is one :class:`EmbedRequest` to the routers (``tandem.v1.router.embed.<owner>``), placed
like a generation request (the same admission queue, the same typed refusals) on a decode worker,
which publishes one :class:`EmbeddingResult` on the request's own stream subject: its vector as
little-endian float32 bytes, returned here as an ``array('f')`` (no numpy needed). While it waits,
the placement's worker is watched as a stream's is (heartbeats, its alive subject, its probes
answered); a worker that died, a ``worker_failure`` or ``shutting_down`` error, a router lost before
it answered, or a connection that dropped and came back places the input again under a placement id
of its own, at most ``max_migrations`` times. An embedding has no tokens to resume: it is computed
again from its prompt. Leaving early (an error of another input, a cancelled task) cancels it on
the worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError
from pydantic import ValidationError

from tandem.client.errors import (
    InvalidRequestError,
    NoWorkersError,
    RequestTimeoutError,
    ShuttingDownError,
    TandemError,
    WorkerFailureError,
    error_field,
    error_from_reply,
    first_error_text,
)
from tandem.client.migration import MAX_EXCLUDED, placement_request_id
from tandem.client.stream import (
    EMPTY,
    LOST,
    MIGRATION_RETRY_S,
    ROUTER_CHECK_S,
    Reconnected,
    RouterLost,
    WorkerGone,
    get_within,
    holders_of,
)
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.embedding import EmbeddingResult, EmbedRequest, PoolingParams, vector_of
from tandem.shared.protocol.serving import GenerateAccepted, Probe, StreamChunk

if TYPE_CHECKING:
    from tandem.client.session import Client

# What ``embed`` takes: one string, one list of token ids, or a list of either.
EmbeddingInputs = str | Sequence[int] | Sequence[str | Sequence[int]]


@dataclass
class Embedding:
    """One input's embedding: ``vector`` (float32, unit L2 norm) and what it cost."""

    vector: array
    prompt_tokens: int  # the input's tokens, as the router counted them (after any truncation)
    index: int  # the input's position in the call
    pooling: str  # how it was pooled: "last" or "mean" (the model's default when none was asked)
    request_id: str = ""
    decode_worker: str = ""  # where it ran (after a migration: the last placement)
    migrations: int = 0


def split_inputs(inputs: EmbeddingInputs) -> list[str | list[int]]:
    """The inputs of one ``embed`` call: a string or a list of ints is one input, a list of strings
    or of token-id lists is several. :class:`InvalidRequestError` (param ``prompt``) for none, an
    empty one, or anything else."""
    if isinstance(inputs, str):
        items: list = [inputs]
    elif isinstance(inputs, Sequence) and inputs and all(_is_token_id(t) for t in inputs):
        items = [list(inputs)]
    elif isinstance(inputs, Sequence):
        items = [x if isinstance(x, str) else list(x) for x in inputs
                 if isinstance(x, str) or (isinstance(x, Sequence) and all(_is_token_id(t) for t in x))]
        if len(items) != len(inputs):
            raise InvalidRequestError("prompt: each input must be a string or a list of token ids", None, "prompt")
    else:
        raise InvalidRequestError(f"prompt: inputs must be a string, token ids or a list of either, not "
                                  f"{type(inputs).__name__}", None, "prompt")
    if not items:
        raise InvalidRequestError("prompt: no input to embed", None, "prompt")
    if any(len(item) == 0 for item in items):
        raise InvalidRequestError("prompt: an input is empty", None, "prompt")
    return items


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pooling_params(pooling: str | None, dimensions: int | None) -> PoolingParams:
    """The pooling asked for, or :class:`InvalidRequestError` naming ``pooling`` or ``dimensions``."""
    try:
        return PoolingParams(method=pooling, dimensions=dimensions)
    except ValidationError as exc:
        field = "pooling" if exc.errors()[0]["loc"][:1] == ("method",) else "dimensions"
        raise InvalidRequestError(f"{field}: {exc.errors()[0]['msg']}", None, field) from None


def embed_request(prompt: str | list[int], request_id: str, pooling: PoolingParams, model: str | None,
                  priority: int, truncate_prompt_tokens: int | None) -> EmbedRequest:
    """One input's request (its stream subject set per placement), or :class:`InvalidRequestError`
    naming the first field out of its bounds."""
    try:
        return EmbedRequest(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                            prompt_token_ids=None if isinstance(prompt, str) else prompt, pooling=pooling,
                            model=model, stream_subject="_INBOX.unset", priority=priority,
                            truncate_prompt_tokens=truncate_prompt_tokens)
    except (ValidationError, TypeError) as exc:
        raise InvalidRequestError(f"invalid request: {first_error_text(exc)}", request_id, error_field(exc)) from None


async def embed_all(client: Client, inputs: EmbeddingInputs, *, pooling: str | None, dimensions: int | None,
                    model: str | None, timeout_s: float, priority: int, truncate_prompt_tokens: int | None,
                    max_in_flight: int) -> list[Embedding]:
    """Every input's :class:`Embedding`, in order (see ``Client.embed``)."""
    asked = pooling_params(pooling, dimensions)
    batch = uuid.uuid4().hex[:16]
    requests = [embed_request(prompt, f"{batch}-{i}", asked, model, priority, truncate_prompt_tokens)
                for i, prompt in enumerate(split_inputs(inputs))]
    gate = asyncio.Semaphore(max(1, max_in_flight))

    async def one(index: int, request: EmbedRequest) -> Embedding:
        async with gate:
            return await embed_one(client, request, index, timeout_s)

    tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # the caller left: every input stops (and is cancelled on its worker)
        for task in tasks:
            task.cancel()
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is None:
        return [task.result() for task in tasks]
    for task in tasks:  # one input failed: the others stop, and their cancels are on their way when this raises
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    raise failed.exception()


async def embed_one(client: Client, request: EmbedRequest, index: int, timeout_s: float) -> Embedding:
    """One input's embedding, placed again (under a new placement id) when its placement failed."""
    deadline = time.monotonic() + timeout_s
    excluded: list[str] = []
    reasons: list[str] = []
    placement, patient = 0, True
    while True:
        placement_id = placement_request_id(request.request_id, placement)
        inbox = subjects.stream_inbox(client.inbox_prefix, client.client_id, placement_id)
        attempt = request.model_copy(update={"request_id": placement_id, "stream_subject": inbox,
                                             "exclude_workers": list(excluded)})
        try:
            result, accepted = await one_placement(client, attempt, max(0.1, deadline - time.monotonic()), patient)
            return Embedding(vector_of(result.embedding), result.num_prompt_tokens, index, result.pooling,
                             request.request_id, accepted.decode_worker, len(reasons))
        except NoWorkersError as exc:
            if not reasons:
                raise  # a first placement finding no decode worker: as generation's
            if not patient:
                raise ShuttingDownError(f"{reasons[-1]}; no other worker took it on ({exc})",
                                        request.request_id) from None
            if time.monotonic() >= deadline:
                raise NoWorkersError(f"{exc}; the request was migrating after: {reasons[-1]}", request.request_id,
                                     exc.param) from None
            await asyncio.sleep(MIGRATION_RETRY_S)
        except (WorkerFailureError, RouterLost, Reconnected) as exc:
            reason = str(exc) if not isinstance(exc, Reconnected) else "the connection to NATS dropped and came back"
            if isinstance(exc, Reconnected):
                await client._until_connected(request.request_id)
            if client.max_migrations <= 0:
                if isinstance(exc, TandemError):
                    raise
                raise WorkerFailureError(reason, request.request_id) from None
            if len(reasons) >= client.max_migrations:
                raise WorkerFailureError(f"migrated {len(reasons)} times; last: {reason}", request.request_id) from None
            if isinstance(exc, WorkerGone):
                excluded = [*excluded, exc.instance][-MAX_EXCLUDED:]
            patient = not isinstance(exc, ShuttingDownError)
            reasons.append(reason)
        placement += 1


async def one_placement(client: Client, request: EmbedRequest, timeout_s: float,
                        patient: bool) -> tuple[EmbeddingResult, GenerateAccepted]:
    """Place ``request`` and wait for its result on its stream subject, watching its worker."""
    queue: asyncio.Queue = asyncio.Queue()

    async def on_message(msg) -> None:  # noqa: ANN001 - a nats-py message
        if msg.reply:  # the worker's liveness probe: this client still waits
            await msg.respond(b"ok")
            return
        queue.put_nowait(msg.data)

    try:
        sub = await client.nc.subscribe(request.stream_subject, cb=on_message)
        client._open[request.request_id] = queue
        await client._watch_workers()
    except NatsError as exc:
        raise client._lost(exc, request.request_id) from None
    ended = False  # the worker is done with it (a result or its error): nothing to cancel
    try:
        accepted = await client._place(request, timeout_s, patient)
        placed = time.monotonic()
        while True:
            data = await get_within(queue, min(timeout_s, client.worker_timeout_s / 4, ROUTER_CHECK_S))
            if data is LOST or not client.nc.is_connected:
                raise Reconnected
            if data is EMPTY:
                if time.monotonic() - placed > timeout_s:
                    raise RequestTimeoutError(f"no embedding within {timeout_s:.0f}s", request.request_id)
                await client._check_alive(request.request_id, holders_of(accepted, prefill=False), placed)
                continue
            try:
                message = decode(data, (EmbeddingResult, StreamChunk, Probe))
            except ProtocolError as exc:
                raise WorkerFailureError(f"bad message on the embedding's stream: {exc}", request.request_id) from None
            if isinstance(message, Probe):
                continue
            if message.request_id != request.request_id:
                client.foreign_chunks += 1
                continue
            if isinstance(message, StreamChunk):
                if message.error is not None:
                    ended = True
                    raise error_from_reply(message.error)
                continue  # nothing else comes on an embedding's stream
            ended = True
            return message, accepted
    finally:
        client._open.pop(request.request_id, None)
        # From a task: a cancelled caller must still unsubscribe and send the cancel.
        client._release_soon(sub, None if ended else request.request_id)
