"""The :class:`Client`: one NATS connection that sends requests to the routers and follows their
streams (:mod:`tandem.client.stream`), with the fleet's heartbeats to tell a live worker from a
gone one."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Mapping

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from pydantic import ValidationError

from tandem.client.adapters import ask_routers, list_adapters
from tandem.client.embedding import Embedding, EmbeddingInputs, embed_all
from tandem.client.errors import (
    ConnectionLostError,
    InvalidRequestError,
    NoWorkersError,
    RequestTimeoutError,
    RequestTooLargeError,
    WorkerFailureError,
    error_field,
    error_from_reply,
    first_error_text,
)
from tandem.client.output import Completion, CompletionOutput, OutputAssembly
from tandem.client.stream import (
    ALIVE_CHECK_TIMEOUT_S,
    EMPTY,
    LATE_BEAT_S,
    LOST,
    PLACEMENT_ACK_S,
    PLACEMENT_RETRY_S,
    PLACEMENT_TRIES,
    RECONNECT_WAIT_S,
    ROUTER_CHECK_S,
    ROUTER_RESTART_WAIT_S,
    Holder,
    RequestStream,
    RouterLost,
    WorkerGone,
    get_within,
)
from tandem.shared.infra.liveness import Liveness, on_bus
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import AdapterRecord, LoadAdapter, UnloadAdapter
from tandem.shared.protocol.base import ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.embedding import EmbedRequest
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import (
    Cancel,
    GenerateAccepted,
    GenerateRequest,
    PlacementReceived,
    SamplingParams,
)

log = logging.getLogger("tandem.client")



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
        # Every worker's last heartbeat: when it came, and the incarnation it named since when. Judged
        # against ``worker_timeout_s`` as it is at the time (a caller may change it).
        self._workers: Liveness[None] = Liveness(worker_timeout_s)
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
            instance = msg.subject.rsplit(".", 1)[-1]
            try:
                incarnation = decode(msg.data, Heartbeat).incarnation
            except ProtocolError:  # a beat all the same: the worker is there
                incarnation = ""
            self._workers.beat(instance, incarnation=incarnation)

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
            heard = self._workers.get(worker)
            if (since is not None and heard is not None and holder.incarnation and heard.incarnation
                    and heard.incarnation != holder.incarnation and heard.incarnation_at > since):
                return worker, f"worker {worker} restarted (its new process does not hold the request)"
            if heard is None:
                if since is not None and now - since > self.worker_timeout_s:
                    return worker, f"worker {worker} stopped sending heartbeats"
                continue
            if self._workers.is_stale(worker, self.worker_timeout_s, now):
                return worker, f"worker {worker} stopped sending heartbeats"
            # Only one heard from: an instance that never beat (a test's stand-in) has no alive subject either.
            if self._workers.is_stale(worker, LATE_BEAT_S, now) and not await self._instance_alive(service, worker):
                return worker, f"worker {worker} left the bus"
        return None

    async def _check_alive(self, request_id: str, holders: list[Holder], since: float) -> None:
        """Raise :class:`WorkerFailureError` when one of ``holders`` died (see :meth:`_first_dead`)."""
        dead = await self._first_dead(holders, since)
        if dead is not None:
            raise WorkerGone(dead[1], request_id, dead[0])

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
            queue.put_nowait(LOST)

    def connection_back(self) -> None:
        """The connection came back: heartbeats missed meanwhile say nothing about the workers."""
        self._workers.refresh()
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
                async with asyncio.timeout(min(left, RECONNECT_WAIT_S)):  # not wait_for: see get_within
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

    async def embed(self, inputs: EmbeddingInputs, *, pooling: str | None = None, dimensions: int | None = None,
                    model: str | None = None, timeout_s: float | None = None, priority: int = 0,
                    truncate_prompt_tokens: int | None = None, max_in_flight: int = 64) -> list[Embedding]:
        """The embedding of each input, in order: a string, token ids, or a list of either (each one
        request on the bus, at most ``max_in_flight`` at once). ``pooling``: "last" or "mean" (None:
        the model's default); ``dimensions``: keep that many leading components, normalised again;
        ``truncate_prompt_tokens``: embed only each input's last N tokens (-1: as many as the context
        holds). Each :class:`Embedding`'s ``vector`` is an ``array('f')`` of unit L2 norm. A bad value
        raises :class:`InvalidRequestError` before anything is sent; a failure of any input raises
        its typed error and cancels the others."""
        return await embed_all(self, inputs, pooling=pooling, dimensions=dimensions, model=model,
                               timeout_s=timeout_s or self.request_timeout_s, priority=priority,
                               truncate_prompt_tokens=truncate_prompt_tokens, max_in_flight=max_in_flight)

    async def load_adapter(self, name: str, path: str | os.PathLike, version: str = "", *,
                           timeout_s: float | None = None, source: str = "api") -> AdapterRecord:
        """Serve the PEFT LoRA adapter in directory ``path`` (read on the routers' and workers' hosts)
        as ``name``, which requests then give as their ``model``; returns its registry record.
        ``version`` empty: a hash of its files (loading the same files again changes nothing; a new
        version replaces the old for new requests). A bad directory raises
        :class:`InvalidRequestError`; see :mod:`tandem.client.adapters` for who may. ``source``: who
        publishes it, as the registry records it ("api", or "trainer" for a training run's checkpoints)."""
        try:
            message = LoadAdapter(name=name, path=os.fspath(path), version=version, source=source)
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid adapter: {first_error_text(exc)}", None, error_field(exc)) from None
        return await ask_routers(self, message, timeout_s or self.request_timeout_s)

    async def unload_adapter(self, name: str, *, timeout_s: float | None = None) -> AdapterRecord:
        """Stop serving adapter ``name`` (requests already running finish with it); returns its last
        record (``removed``). One not served raises :class:`UnknownModelError`."""
        try:
            message = UnloadAdapter(name=name)
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid adapter: {first_error_text(exc)}", None, error_field(exc)) from None
        return await ask_routers(self, message, timeout_s or self.request_timeout_s)

    async def adapters(self, model: str | None = None) -> list[AdapterRecord]:
        """The LoRA adapters served now, by name (of base model ``model`` only, if given)."""
        return await list_adapters(self, model)

    def _request(self, prompt, model, request_id, priority: int, params: dict) -> GenerateRequest:
        """The request to send, or :class:`InvalidRequestError` naming the first field out of its
        bounds (checked before anything is sent: no value msgpack cannot carry reaches ``encode``)."""
        shown = request_id if isinstance(request_id, str) else None
        if isinstance(params.get("logit_bias"), Mapping):  # {token id: bias}, as OpenAI writes it
            params = {**params, "logit_bias": list(params["logit_bias"].items())}
        try:
            sampling = SamplingParams(**params)
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid sampling parameters: {first_error_text(exc)}", shown,
                                      error_field(exc)) from None
        try:
            return GenerateRequest(
                request_id=request_id, params=sampling, model=model, stream_subject="_INBOX.unset", priority=priority,
                prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
            )
        except (ValidationError, TypeError) as exc:
            raise InvalidRequestError(f"invalid request: {first_error_text(exc)}", shown, error_field(exc)) from None

    async def _place(self, request: GenerateRequest | EmbedRequest, timeout: float,
                     patient: bool = True) -> GenerateAccepted:
        """Send ``request`` to a router and return where it placed it, or raise its typed error.
        Raises :class:`RouterLost` when the router that took it left the bus before answering
        (the caller places it again under a new id, so the first placement, if it was made after
        all, is cancelled rather than run twice). Finding no router, it asks again for about a
        second, or, ``patient`` and a router having answered this client before, for
        ``router_restart_wait_s`` (one is likely restarting); then :class:`NoWorkersError`."""
        payload = encode(request.model_copy(update={"ack_placement": True}))
        subject = (subjects.router_embed if isinstance(request, EmbedRequest) else subjects.router_generate)(self.owner)
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
                await self.nc.publish(subject, payload, reply=sub.subject)
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
        (the answer may be lost) raise :class:`RouterLost`."""
        deadline = time.monotonic() + timeout
        router = None
        while True:
            left = deadline - time.monotonic()
            msg = await get_within(replies, max(0.0, min(PLACEMENT_ACK_S if router is None else ROUTER_CHECK_S, left)))
            if msg is EMPTY:
                if not self.nc.is_connected:
                    if patient:
                        await self._until_connected(request_id)
                    raise RouterLost("the connection to NATS dropped while the request was being placed")
                if time.monotonic() >= deadline:
                    raise RequestTimeoutError(f"the router did not answer in {timeout:.0f}s", request_id)
                if router is None:
                    raise RouterLost(f"no router took the request within {PLACEMENT_ACK_S:.1f}s")
                if not await self._instance_alive("router", router):
                    raise RouterLost(f"router {router} left the bus while it placed the request")
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
