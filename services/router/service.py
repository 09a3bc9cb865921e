"""The router: entry point for generation and embedding requests.

``tandem serve router --nats-url URL``. Endpoint ``tandem.v1.router.generate.<owner>`` (queue-balanced, so
several routers can share the load) takes a :class:`GenerateRequest`: it validates it, tokenizes
the prompt, scores the decode and prefill workers by cached prefix and load
(:mod:`tandem.services.router.policy`), forwards the work, publishes a :class:`RoutingDecision`,
and replies :class:`GenerateAccepted` (tokens then flow from the workers straight to the client's
stream subject) or a typed :class:`ErrorReply`. With no prefill worker alive, when the chosen one
does not answer, or when little of the prompt is uncached, the decode worker prefills by itself.

Workers are known from their heartbeats (``tandem.v1.heartbeat.>``), kept per service in a
:class:`~tandem.shared.infra.liveness.Liveness`; a worker silent for ``worker_timeout_s`` is dropped.
Load is running + waiting sequences from the last heartbeat plus what this router assigned since,
so a burst does not all land on one worker. Which worker caches which blocks comes from the KV
events stream (:mod:`tandem.services.router.kv_index`), read from its start, so a restarted router
routes as its predecessor did.

Endpoint ``tandem.v1.router.embed.<owner>`` takes an :class:`EmbedRequest` the same way (owner,
tokenizer, context, admission queue) and places it on a decode worker alone, which prefills it in
its running batch beside generation and publishes the vector to the client's stream: no hand-off
to pay for, and the admission rule (decode workers' room) already counts it. The worker is ranked
as for generation (a cached prefix serves last-token pooling; mean pooling computes every position).

A request asking ``ack_placement`` gets :class:`PlacementReceived` (this router's id) the moment
it is taken, and ``tandem.v1.router.<id>.alive`` answers for as long as the router's process is on
the bus: a client holding a placement tells a router that died with it from one still placing it.

While every decode worker is saturated, a request waits in this router's admission queue
(:mod:`tandem.services.router.admission`: the rule, the bounds, FCFS by priority) and is placed as
soon as a heartbeat or a failed placement shows room; past the queue's bounds it gets
``overloaded`` at once. A client's cancel takes a queued request out of the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro.request import Request

from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.services.common.service_metrics import RouterMetrics
from tandem.services.router.adapters import RouterAdapters
from tandem.services.router.admission import AdmissionQueue, QueuedRequestCancelled, WorkerLoad, has_room
from tandem.services.router.kv_index import KVIndex
from tandem.services.router.policy import Candidate, rank, remote_prefill_workers, shares_device
from tandem.shared.infra.config import Settings
from tandem.shared.infra.kvevents import ensure_kv_events_stream
from tandem.shared.infra.liveness import Liveness, on_bus
from tandem.shared.model.meta import load_model_meta
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import AdapterRecord, AdapterRef, LoadAdapter, UnloadAdapter, adapter_hash_root
from tandem.shared.protocol.base import Ack, ErrorCode, ErrorReply, ProtocolError
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.codec import decode, encode, error_reply
from tandem.shared.protocol.embedding import POOLING_METHODS, EmbedRequest, EmbedWork, PoolingParams
from tandem.shared.protocol.fleet import Heartbeat, RouteCandidate, RoutingDecision
from tandem.shared.protocol.kv import KVEvent
from tandem.shared.protocol.serving import (
    Cancel,
    DecodeRequest,
    GenerateAccepted,
    GenerateRequest,
    PlacementReceived,
    PrefillRequest,
    RequestSpec,
    SamplingParams,
)

WORKER_CHECK_S = 0.5  # while a worker has not answered a forwarded request, how often it is asked whether it lives
THREAD_TOKENIZE_CHARS = 32768  # longer prompts tokenize in a thread (7.5M characters stalled the loop ~0.3 s)


def request_spec(msg: GenerateRequest, prompt_token_ids: list[int], model: str, accepted_at: float,
                 max_model_len: int, adapter: AdapterRef | None = None) -> RequestSpec:
    """The request as prefill and decode workers see it: ``msg`` with its prompt tokenized, its model
    resolved, its ``max_tokens`` set (unset: what the context leaves) and its arrival stamped. Built
    once per request; the workers carry it on unchanged. A prompt the context cannot hold, a
    ``max_tokens`` beyond what it leaves, or a ``min_tokens`` beyond the ``max_tokens`` granted, is
    refused (as vLLM does), never silently cut."""
    room = max_model_len - len(prompt_token_ids)
    if room < 1:
        raise ProtocolError(ErrorCode.PROMPT_TOO_LONG,
                            f"prompt has {len(prompt_token_ids)} tokens; the context holds {max_model_len}", "prompt")
    max_tokens = msg.params.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"max_tokens is {max_tokens}, but the context ({max_model_len} tokens) leaves {room} after "
                            f"the {len(prompt_token_ids)}-token prompt: ask for at most {room}", "max_tokens")
    # SamplingParams checks min_tokens against a max_tokens it was given; one granted here (model_copy
    # validates nothing) is checked here, or the spec would carry a pair no worker could decode.
    if msg.params.min_tokens > max_tokens:
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"min_tokens is {msg.params.min_tokens}, but the context ({max_model_len} tokens) leaves "
                            f"{max_tokens} after the {len(prompt_token_ids)}-token prompt: ask for at most "
                            f"{max_tokens}", "min_tokens")
    # A migrated request counts its resumed tokens in max_tokens: what is left to generate,
    # max_tokens - resumed, fits the context after prompt and resumed tokens exactly when the check
    # above passed; with nothing left there is nothing to place.
    resumed = len(msg.resume_output_token_ids)
    if resumed >= max_tokens:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"the request already has all its {max_tokens} output tokens "
                            f"({resumed} resumed)", "resume_output_token_ids")
    params = msg.params if max_tokens == msg.params.max_tokens else msg.params.model_copy(
        update={"max_tokens": max_tokens})
    return RequestSpec(request_id=msg.request_id, prompt_token_ids=prompt_token_ids, params=params,
                       stream_subject=msg.stream_subject, model=model, arrival_time=accepted_at,
                       resume_output_token_ids=msg.resume_output_token_ids, adapter=adapter)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Refuse a ``logit_bias`` naming a token the model does not have (its bias would index past the
    logits' row on the workers)."""
    outside = [token for token, _ in params.logit_bias if token >= vocab_size]
    if outside:
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"logit_bias names token id {outside[0]}, outside the vocabulary of {vocab_size} tokens",
                            "logit_bias")


def check_stream_owner(msg: GenerateRequest, subject: str) -> None:
    """Refuse a request whose stream is not its sender's: ``subject`` is the one it was published on,
    under its sender's owner token (on a bus with identities, the sender's user key, which
    nats-server enforces), and the workers write the request's tokens to its stream subject, so that
    subject must lie under the sender's own inbox. A resume (``resume_output_token_ids``) then writes
    into the sender's own stream only."""
    if not subjects.sent_by_owner(subject, msg.stream_subject):
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"stream_subject must be under this connection's own inbox "
                            f"(_INBOX.{subjects.owner_of(subject)}.), the owner the request was sent as",
                            "stream_subject")


def prefill_request(spec: RequestSpec, dec: Heartbeat, store: str, fetch: int, held: int) -> PrefillRequest:
    """Prefill ``spec`` and hand it to the decode worker ``dec`` (through its ring when on its host);
    ``store``: a KV-store holding ``held`` leading blocks, ``fetch`` of them worth fetching."""
    return PrefillRequest(spec=spec, decode_worker=dec.instance_id, decode_ring=dec.kv_ring, decode_host=dec.host_id,
                          kvstore=store, kvstore_fetch_blocks=fetch, kvstore_held_blocks=held)


def decode_request(spec: RequestSpec, store: str, fetch: int, held: int) -> DecodeRequest:
    """Prefill and decode ``spec`` on the decode worker itself, fetching ``fetch`` leading blocks
    from ``store`` first and offering it the blocks past the ``held`` it has."""
    return DecodeRequest(spec=spec, kvstore=store, kvstore_fetch_blocks=fetch, kvstore_held_blocks=held)


def embed_work(msg: EmbedRequest, prompt_token_ids: list[int], model: str, default_pooling: str, hidden_size: int,
               accepted_at: float) -> EmbedWork:
    """What a decode worker computes for ``msg``: its tokens, its pooling resolved (unset: the
    model's default). ``dimensions`` past the model's hidden size is refused, never cut."""
    method = msg.pooling.method or default_pooling
    if method not in POOLING_METHODS:  # a model directory's declared default tandem has no pooling for
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"pooling {method!r} is not served; ask for one of "
                            f"{', '.join(POOLING_METHODS)}", "pooling")
    dimensions = msg.pooling.dimensions
    if dimensions is not None and dimensions > hidden_size:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"dimensions is {dimensions}, but {model}'s embeddings have "
                            f"{hidden_size}: ask for at most {hidden_size}", "dimensions")
    return EmbedWork(request_id=msg.request_id, prompt_token_ids=prompt_token_ids,
                     pooling=PoolingParams(method=method, dimensions=dimensions), stream_subject=msg.stream_subject,
                     model=model, arrival_time=accepted_at)


def truncated(ids: list[int], keep: int | None, context: int) -> list[int]:
    """The prompt's last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``; -1: as many as
    ``context`` holds; None: all of them)."""
    if keep is None:
        return ids
    keep = context if keep == -1 else keep
    return ids[-keep:] if keep > 0 else ids


def admission_key(request_id: str, stream_subject: str) -> str:
    """A queued request's name: its id with its stream subject (so a cancel must name the very
    stream, as on the workers; that it came from the stream's owner is checked first)."""
    return f"{request_id} {stream_subject}"


@dataclass
class Worker:
    """A worker as its last heartbeat says (when it came: the router's :class:`Liveness` of its
    service), with what this router assigned it since."""

    beat: Heartbeat
    assigned: list[float] = field(default_factory=list)  # times of assignments since the last beat

    def load(self) -> int:
        return self.beat.running + self.beat.waiting + len(self.assigned)

    def admission_load(self, owed: int = 0) -> WorkerLoad:
        """``owed``: requests prefill workers hold for it (their heartbeats' ``owed_requests``),
        which its own running and waiting counts do not show yet: in flight to it, not waiting there."""
        return WorkerLoad(self.beat.running, self.beat.waiting, len(self.assigned) + owed, self.beat.max_num_seqs)

    def reserve(self) -> float:
        stamp = time.monotonic()
        self.assigned.append(stamp)
        return stamp

    def release(self, stamp: float) -> None:
        if stamp in self.assigned:  # a heartbeat may have pruned it already
            self.assigned.remove(stamp)


@dataclass
class PromptBlocks:
    """A prompt's token ids and its chained block hashes, computed once per block size: placement
    asks for them for every candidate worker and store."""

    ids: list[int]
    adapter: AdapterRecord | None = None  # the LoRA adapter it runs with: its blocks chain from the adapter's root
    _hashes: dict[int, list[int]] = field(default_factory=dict)

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            root = adapter_hash_root(None if self.adapter is None else self.adapter.ref())
            self._hashes[block_size] = prefix_hashes(self.ids, block_size, root)
        return self._hashes[block_size]


@dataclass
class Placement:
    """Where a request went: its decode worker (and the process that took it), its prefill worker
    if one, why, and the decode workers as they were ranked for it."""

    spec: RequestSpec | None  # None for an embedding (its EmbedWork carries no sampling)
    decode: Worker
    decode_incarnation: str
    prefill: Worker | None
    prefill_incarnation: str | None
    reason: str
    ranked: list[tuple[Worker, Candidate]]


class Router(ServiceRuntime):
    name = "router"
    description = "validates, tokenizes and places generation requests"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.meta = load_model_meta(settings.model, data_dir=settings.data_dir)
        timeout = settings.bus.worker_timeout_s
        self.workers: dict[str, Liveness[Worker]] = {s: Liveness(timeout) for s in ("prefill", "decode", "kvstore")}
        self.index = KVIndex()
        self._stream_seq = 0
        router = settings.router
        self.admission = AdmissionQueue(router.max_queued_requests, router.max_queued_prompt_tokens,
                                        router.max_queue_wait_s, self.decode_room)
        self.serving = RouterMetrics(self.prom, lambda: {(s,): len(p) for s, p in self.workers.items()},
                                     lambda: self.admission.depth, lambda: self.admission.prompt_tokens)
        self.admission.observe_wait = self.serving.queue_wait.observe
        # Until then, with no live decode worker, requests wait in the admission queue: one died
        # (not drained) that recently, and a supervisor is likely bringing it back.
        self.restart_deadline = 0.0
        self.adapters = RouterAdapters(self.meta.name, self.meta.config, self.log)

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "model": self.meta.name, "vocab_size": str(self.meta.config.vocab_size)}

    def metrics(self) -> dict:
        return {"queue_depth": self.admission.depth, "queue_prompt_tokens": self.admission.prompt_tokens,
                "refused_overloaded": self.admission.refused}

    async def setup(self) -> None:
        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.on_heartbeat)
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self.on_cancel)
        await self.follow_kv_events()
        await self.adapters.start(self.nc, self.settings.router.lora_modules, self.adapter_rank_limit)
        await self.add_endpoint("adapters", subjects.ADAPTERS_CONTROL, self.on_adapter_control, queue_group="router")
        await self.add_endpoint("generate", subjects.ROUTER_GENERATE_ALL, self.on_generate, queue_group="router")
        await self.add_endpoint("embed", subjects.ROUTER_EMBED_ALL, self.on_embed, queue_group="router")

    async def on_adapter_control(self, request: Request) -> None:
        msg = decode(request.data, (LoadAdapter, UnloadAdapter))
        if isinstance(msg, LoadAdapter):
            record = await self.adapters.load(msg, self.adapter_rank_limit())
        else:
            record = await self.adapters.unload(msg)
        await request.respond(encode(record))

    def adapter_rank_limit(self) -> int | None:
        """The highest adapter rank some live decode worker holds (None: no worker with slots is up
        yet, so only the workers can judge the rank, when a request comes)."""
        ranks = [w.beat.max_lora_rank for w in self.alive("decode", self.meta.name) if w.beat.max_loras]
        return max(ranks) if ranks else None

    async def teardown(self) -> None:
        if self.admission.depth:  # queued requests hear why now, not from their clients' timeouts
            self.admission.fail_all(ProtocolError(ErrorCode.NO_WORKERS, "the router is stopping; retry"))
            await asyncio.sleep(0.05)  # their replies go out before the runtime cancels the tasks

    async def follow_kv_events(self, catch_up_timeout_s: float = 30.0) -> None:
        """Replay the KV events stream from its start, then follow it live. Requests are taken
        only once the replay reached the stream's end as of start-up, so a restarted router
        places the way its predecessor did from its first request on."""
        js = self.nc.jetstream()
        try:
            await ensure_kv_events_stream(js)
            last = (await js.stream_info(subjects.KV_EVENTS_STREAM)).state.last_seq
            # The stream named: looking it up by subject would need $JS.API.STREAM.NAMES, which the
            # router's role does not grant (see shared/auth/roles.py).
            await js.subscribe(subjects.KV_EVENTS_ALL, stream=subjects.KV_EVENTS_STREAM, cb=self.on_kv_event,
                               ordered_consumer=True)
        except Exception as exc:  # a server without JetStream: live events only, no rebuild
            self.log.warning("KV events stream unavailable (%s); indexing live events only", exc)
            await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=self.on_kv_event)
            return
        deadline = time.monotonic() + catch_up_timeout_s
        while self._stream_seq < last and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.log.info("KV index rebuilt from %d stream events: %d sources, %d blocks", self._stream_seq,
                      len(self.index.sources), len(self.index.holders))

    async def on_kv_event(self, msg) -> None:
        if msg.reply and msg.reply.startswith("$JS.ACK"):  # a stream message: remember how far the replay got
            self._stream_seq = max(self._stream_seq, msg.metadata.sequence.stream)
        try:
            self.index.apply(decode(msg.data, KVEvent))
        except ProtocolError as exc:
            self.limited.warning("ignored KV events", "ignored bad KV event on %s: %s", msg.subject, exc)

    async def on_heartbeat(self, msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        pool = self.workers.get(beat.service)
        if pool is None:
            return
        now = time.monotonic()
        worker = pool.payload(beat.instance_id)
        if worker is None:
            self.log.info("%s worker %s joined (host %s, model %s)", beat.service, beat.instance_id, beat.host,
                          beat.model)
            worker = Worker(beat)
        else:
            if beat.incarnation != worker.beat.incarnation and worker.beat.incarnation:
                self.log.info("%s worker %s restarted (pid %d, was %d): what the old process held is gone",
                              beat.service, beat.instance_id, beat.pid, worker.beat.pid)
            worker.beat = beat
            worker.assigned = [t for t in worker.assigned if t > now - self.settings.bus.heartbeat_interval_s]
        pool.beat(beat.instance_id, worker, incarnation=beat.incarnation, at=now)
        self.pump_admission()

    async def on_cancel(self, msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except ProtocolError:
            return
        if not subjects.sent_by_owner(msg.subject, cancel.stream_subject):
            return  # not the sender's stream; the workers log it
        if self.admission.cancel(admission_key(cancel.request_id, cancel.stream_subject)):
            self.log.debug("cancelled %s while it was queued", cancel.request_id)

    def decode_room(self) -> bool:
        """Whether some live decode worker can take one more request now (see admission.py)."""
        limit = self.settings.router.max_inflight_per_worker
        return any(has_room(self.admission_load(w), limit) for w in self.alive("decode", self.meta.name))

    def admission_load(self, worker: Worker) -> WorkerLoad:
        instance = worker.beat.instance_id
        owed = sum(p.beat.owed_requests.get(instance, 0) for p in self.workers["prefill"].payloads())
        return worker.admission_load(owed)

    def pump_admission(self) -> None:
        if not self.admission.depth:
            return
        if not self.alive("decode", self.meta.name):
            if self.awaiting_restart():
                return  # they wait for the decode worker being restarted
            self.admission.fail_all(self.no_decode_workers())  # nothing left to wait for
            return
        self.admission.pump()

    def no_decode_workers(self) -> ProtocolError:
        wait = self.settings.router.restart_wait_s
        just_ran_out = self.restart_deadline and time.monotonic() - self.restart_deadline < wait
        return ProtocolError(ErrorCode.NO_WORKERS, f"no decode worker serves {self.meta.name!r}"
                             + (f" (none came back within {wait:g} s)" if just_ran_out else ""))

    def awaiting_restart(self) -> bool:
        """Whether requests wait for a decode worker instead of failing: one was lost without
        draining less than ``--router-restart-wait-s`` ago (a supervisor, compose or Kubernetes
        restarts a crashed worker within seconds)."""
        return time.monotonic() < self.restart_deadline

    def lost(self, worker: Worker) -> None:
        """``worker`` left without draining: a decode worker's requests may wait for its restart."""
        beat = worker.beat
        wait = self.settings.router.restart_wait_s
        if beat.service != "decode" or beat.draining or beat.model != self.meta.name or not wait:
            return
        self.restart_deadline = time.monotonic() + wait
        # Not self.alive(): it sweeps, and a sweep is what may have called this.
        if not any(w.beat.model == self.meta.name and not w.beat.draining for w in self.workers["decode"].payloads()):
            self.log.info("no decode worker left; requests wait up to %g s for one to (re)start", wait)
        # When the wait runs out with none back, the requests still queued hear it then.
        asyncio.get_running_loop().call_later(wait + 0.05, self.pump_admission)

    def sweep(self) -> None:
        """Drop workers and stores silent for ``worker_timeout_s``, and what the index says they hold."""
        for service, pool in self.workers.items():
            for instance_id, last in pool.forget_stale():
                self.log.info("%s %s left (no heartbeat)", service, instance_id)
                self.lost(last.payload)
                self.index.forget(instance_id)

    def alive(self, service: str, model: str, excluded: list[str] = ()) -> list[Worker]:
        """Live workers of ``service`` serving ``model``, without the ``excluded`` ones (a client saw
        them die) unless they beat again since: a worker restarted under the same instance id is back."""
        self.sweep()
        pool, again = self.workers[service], self.settings.bus.heartbeat_interval_s
        return [w for w in pool.payloads()
                if w.beat.model == model and not w.beat.draining
                and not (w.beat.instance_id in excluded and not pool.is_alive(w.beat.instance_id, again))]

    def forget(self, worker: Worker) -> None:
        """Drop a worker found gone (off the bus, or silent past a forward)."""
        if self.workers[worker.beat.service].forget(worker.beat.instance_id) is not None:
            self.lost(worker)
        self.index.forget(worker.beat.instance_id)

    async def on_generate(self, request: Request) -> None:
        # Placement waits on worker round trips: answer from a task so one slow worker never
        # holds up the next request in this subscription.
        self.spawn(self.place(request, time.time()), "place request")

    async def on_embed(self, request: Request) -> None:
        self.spawn(self.place(request, time.time(), EmbedRequest), "place embedding")

    async def place(self, request: Request, accepted_at: float,
                    kind: type[GenerateRequest] | type[EmbedRequest] = GenerateRequest) -> None:
        request_id = None
        try:
            msg: GenerateRequest | EmbedRequest = decode(request.data, kind)
            request_id = msg.request_id
            check_stream_owner(msg, request.subject)
            if msg.ack_placement:
                await request.respond(encode(PlacementReceived(request_id=request_id, router=self.instance_id)))
            if isinstance(msg, EmbedRequest):
                reply = await self.place_embedding(msg, accepted_at)
                self.serving.placed(len(reply.prompt_token_ids), None, accepted_at)
            else:
                reply = await self.place_valid(msg, accepted_at)
                self.serving.placed(len(reply.prompt_token_ids), reply.max_tokens, accepted_at)
        except QueuedRequestCancelled:
            return  # its client is gone: nobody reads a reply
        except Exception as exc:
            reply = error_reply(exc, request_id)
            self.serving.rejected.labels(reply.code.value).inc()
            self.log.debug("rejected %s: %s %s", request_id, reply.code.value, reply.message)
        finally:
            self.pump_admission()  # a placement that failed gave its reservation back
        await request.respond(encode(reply))

    async def tokenize(self, msg: GenerateRequest | EmbedRequest) -> list[int]:
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "give exactly one of prompt and prompt_token_ids", "prompt")
        if msg.prompt is not None and len(msg.prompt) > THREAD_TOKENIZE_CHARS:
            # A long prompt tokenizes off the event loop: the requests behind it must not wait.
            ids = await asyncio.to_thread(self.meta.tokenizer.encode, msg.prompt)
        else:
            ids = self.meta.tokenizer.encode(msg.prompt) if msg.prompt is not None else list(msg.prompt_token_ids)
        if not ids:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "the prompt is empty", "prompt")
        if max(ids) >= self.meta.config.vocab_size:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"token id {max(ids)} is outside the vocabulary", "prompt")
        return ids

    def ranked(self, workers: list[Worker], prompt: PromptBlocks) -> list[tuple[Worker, Candidate]]:
        """Workers cheapest first for this prompt (cached prefix from the index, load from beats, the
        prompt's adapter where they lack it); for an adapter's prompt, only workers that serve it."""
        if prompt.adapter is not None:
            workers = [w for w in workers if self.adapters.serves(w.beat, prompt.adapter)]
        if not workers:
            return []
        adapter = None if prompt.adapter is None else prompt.adapter.ref()
        hashes = prompt.hashes(workers[0].beat.block_size)
        overlaps: dict[str, dict[str, int]] = {}
        rows = []
        for w in workers:
            ns = w.beat.kv_namespace
            if ns not in overlaps:
                overlaps[ns] = self.index.prefix_overlap(ns, hashes) if ns else {}
            rows.append((w.beat.instance_id, overlaps[ns].get(w.beat.instance_id, 0), w.load(), w.beat.free_blocks,
                         self.adapters.extra_cost(w.beat, adapter)))
        by_id = {w.beat.instance_id: w for w in workers}
        return [(by_id[c.instance_id], c) for c in rank(len(hashes), rows, self.settings.router.load_weight)]

    def decode_context(self, msg: GenerateRequest | EmbedRequest) -> int:
        """The longest context of the live decode workers ``msg`` may go to (0: none is live, but one
        is being waited for); :class:`ProtocolError` ``no_workers`` when none is, nor expected."""
        decoders = self.alive("decode", self.meta.name, msg.exclude_workers)
        if not decoders and not self.awaiting_restart():
            raise ProtocolError(ErrorCode.NO_WORKERS, f"no decode worker serves {self.meta.name!r}"
                                + (f" (besides {', '.join(msg.exclude_workers)})" if msg.exclude_workers else ""))
        return max((w.beat.max_model_len for w in decoders), default=0)

    async def place_valid(self, msg: GenerateRequest, accepted_at: float) -> GenerateAccepted:
        adapter = self.adapters.resolve(msg.model)
        ids = await self.tokenize(msg)
        check_logit_bias(msg.params, self.meta.config.vocab_size)
        longest = self.decode_context(msg)
        if longest and len(ids) >= longest:  # before hashing a prompt no worker could hold
            raise ProtocolError(ErrorCode.PROMPT_TOO_LONG,
                                f"prompt has {len(ids)} tokens; the context holds {longest}", "prompt")
        prompt = PromptBlocks(ids, adapter)
        placed, waited = await self.admit_and_place(
            msg, len(ids), lambda gone: self.place_on_decode(msg, ids, prompt, accepted_at, gone))
        await self.publish_decision(msg, ids, placed.ranked, placed.decode, placed.prefill, placed.reason)
        return GenerateAccepted(
            request_id=msg.request_id, prompt_token_ids=ids, decode_worker=placed.decode.beat.instance_id,
            prefill_worker=placed.prefill.beat.instance_id if placed.prefill else None,
            decode_incarnation=placed.decode_incarnation, prefill_incarnation=placed.prefill_incarnation or "",
            max_tokens=placed.spec.params.max_tokens, queue_wait_s=waited,
        )

    async def place_embedding(self, msg: EmbedRequest, accepted_at: float) -> GenerateAccepted:
        """Place an embedding on a decode worker; the answer names it (no prefill worker, no tokens
        to grant: ``max_tokens`` 0)."""
        if self.adapters.resolve(msg.model) is not None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{msg.model!r} is a LoRA adapter, which serves no "
                                f"embeddings: ask {self.meta.name!r}", "model")
        ids = await self.tokenize(msg)
        longest = self.decode_context(msg)
        ids = truncated(ids, msg.truncate_prompt_tokens, longest or len(ids))
        if longest and len(ids) > longest:  # an embedding generates nothing: the whole context is the prompt's
            raise ProtocolError(ErrorCode.PROMPT_TOO_LONG,
                                f"input has {len(ids)} tokens; the context holds {longest}", "prompt")
        work = embed_work(msg, ids, self.meta.name, self.meta.default_pooling, self.meta.config.hidden_size,
                          accepted_at)
        prompt = PromptBlocks(ids)
        placed, waited = await self.admit_and_place(
            msg, len(ids), lambda gone: self.embed_on_decode(msg, work, prompt, gone))
        await self.publish_decision(msg, ids, placed.ranked, placed.decode, None, placed.reason)
        return GenerateAccepted(request_id=msg.request_id, prompt_token_ids=ids,
                                decode_worker=placed.decode.beat.instance_id, prefill_worker=None,
                                decode_incarnation=placed.decode_incarnation, max_tokens=0, queue_wait_s=waited)

    async def admit_and_place(self, msg: GenerateRequest | EmbedRequest, prompt_tokens: int,
                              place: Callable[[set[tuple[str, str]]], Awaitable[Placement | None]],
                              ) -> tuple[Placement, float]:
        """Wait in the admission queue, then ``place(gone)`` the request; again while every decode
        worker it was tried on was gone and one is being waited for. The placement and the seconds
        it waited; raises the refusal."""
        waited = 0.0
        gone: set[tuple[str, str]] = set()  # decode processes (instance, incarnation) found gone placing it
        while True:
            waited += await self.admission.admit(admission_key(msg.request_id, msg.stream_subject), prompt_tokens,
                                                 msg.priority)
            # From here to decode_worker.reserve() nothing awaits: the next queued request is woken only
            # after this one's load is on its worker (see AdmissionQueue.admit).
            placed = await place(gone)
            if placed is not None:
                return placed, waited
            if not self.awaiting_restart():
                raise ProtocolError(ErrorCode.NO_WORKERS, "no decode worker answered")
            # Every decode worker it was tried on was gone: it waits again, for one restarting. Only
            # processes it already found gone may be left (one that beats but takes nothing): then
            # the queue would admit it at once, so it waits a heartbeat for the fleet to change.
            if self.alive("decode", self.meta.name, msg.exclude_workers):
                start = time.monotonic()
                await asyncio.sleep(self.settings.bus.heartbeat_interval_s)
                waited += time.monotonic() - start

    def ranked_decoders(self, exclude: list[str], prompt: PromptBlocks, gone: set[tuple[str, str]]) -> list | None:
        """The live decode workers not in ``gone`` (those with room first), cheapest first; None
        while a restarted worker is awaited; raises when there is none."""
        decoders = [w for w in self.alive("decode", self.meta.name, exclude)  # they may have come or gone
                    if (w.beat.instance_id, w.beat.incarnation) not in gone]
        if not decoders:
            if self.awaiting_restart():
                return None
            raise self.no_decode_workers()
        if prompt.adapter is not None:
            decoders = [w for w in decoders if self.adapters.serves(w.beat, prompt.adapter)]
            if not decoders:
                raise ProtocolError(ErrorCode.NO_WORKERS, f"no live decode worker serves LoRA adapters of rank "
                                    f"{prompt.adapter.rank} ({prompt.adapter.name!r}): start decode workers with "
                                    "--max-loras N and --max-lora-rank R")
        limit = self.settings.router.max_inflight_per_worker
        decoders = [w for w in decoders if has_room(self.admission_load(w), limit)] or decoders
        return self.ranked(decoders, prompt)

    async def place_on_decode(self, msg: GenerateRequest, ids: list[int], prompt: PromptBlocks, accepted_at: float,
                              gone: set[tuple[str, str]]) -> Placement | None:
        """Place an admitted request on the cheapest live decode worker that takes it (with a prefill
        worker, or prefilled there), never on a process in ``gone``; None when every one tried was
        gone (they join ``gone``). Raises a worker's refusal."""
        ranked_decode = self.ranked_decoders(msg.exclude_workers, prompt, gone)
        if ranked_decode is None:
            return None
        for decode_worker, choice in ranked_decode:
            spec = request_spec(msg, ids, self.meta.name, accepted_at, decode_worker.beat.max_model_len,
                                None if prompt.adapter is None else prompt.adapter.ref())
            # Counted before the round trips, so requests placed meanwhile already see this load.
            stamp = decode_worker.reserve()
            try:
                decode_incarnation = prefill_incarnation = prefill_worker = None
                if await self.still_there(decode_worker):
                    prefill_worker, reason, prefill_incarnation = await self.place_prefill(
                        spec, prompt, decode_worker, choice, msg.exclude_workers)
                    if prefill_worker is not None:
                        # The decode worker hears of it only at the hand-off: as its last beat said.
                        decode_incarnation = decode_worker.beat.incarnation
                    else:
                        decode_incarnation = await self.forward_decode(spec, prompt, decode_worker, choice)
            except BaseException:
                decode_worker.release(stamp)
                raise
            if decode_incarnation is not None:
                return Placement(spec, decode_worker, decode_incarnation, prefill_worker, prefill_incarnation, reason,
                                 ranked_decode)
            decode_worker.release(stamp)
        gone.update((w.beat.instance_id, w.beat.incarnation) for w, _ in ranked_decode)
        return None

    async def embed_on_decode(self, msg: EmbedRequest, work: EmbedWork, prompt: PromptBlocks,
                              gone: set[tuple[str, str]]) -> Placement | None:
        """:meth:`place_on_decode` for an embedding: the cheapest live decode worker that takes
        ``work`` computes it alone; None when every one tried was gone (they join ``gone``)."""
        ranked_decode = self.ranked_decoders(msg.exclude_workers, prompt, gone)
        if ranked_decode is None:
            return None
        for decode_worker, choice in ranked_decode:
            if len(work.prompt_token_ids) > decode_worker.beat.max_model_len:
                raise ProtocolError(ErrorCode.PROMPT_TOO_LONG, f"input has {len(work.prompt_token_ids)} tokens; the "
                                    f"context holds {decode_worker.beat.max_model_len}", "prompt")
            stamp = decode_worker.reserve()  # counted before the round trip, as for generation
            try:
                incarnation = None
                if await self.still_there(decode_worker):
                    incarnation = await self.forward(subjects.decode_embed(decode_worker.beat.instance_id), work,
                                                     decode_worker)
            except BaseException:
                decode_worker.release(stamp)
                raise
            if incarnation is not None:
                reason = f"embedding, {work.pooling.method} pooling: {choice.cached_blocks} blocks cached there"
                return Placement(None, decode_worker, incarnation, None, None, reason, ranked_decode)
            decode_worker.release(stamp)
        gone.update((w.beat.instance_id, w.beat.incarnation) for w, _ in ranked_decode)
        return None

    async def place_prefill(self, spec: RequestSpec, prompt: PromptBlocks, dec: Worker, choice: Candidate,
                            excluded: list[str] = ()) -> tuple[Worker | None, str, str | None]:
        """A prefill worker that took the request, or None (the decode worker prefills), why, and
        the incarnation of the prefill process that took it; never one of ``excluded`` (workers its
        client saw die)."""
        ids = prompt.ids
        cached_tokens = min(len(ids), choice.cached_blocks * dec.beat.block_size)
        router = self.settings.router
        alive = self.alive("prefill", self.meta.name, excluded)
        if prompt.adapter is not None:  # a prefill worker without slots cannot compute the adapter's K/V
            alive = [w for w in alive if self.adapters.serves(w.beat, prompt.adapter)]
        devices = [(w.beat.instance_id, w.beat.device) for w in alive]
        usable, why_local = remote_prefill_workers(len(ids) - cached_tokens, router.local_prefill_max_tokens,
                                                   dec.beat.device, devices, router.prefill_on_shared_device)
        if not usable:
            return None, why_local, None
        for prefill_worker, pchoice in self.ranked([w for w in alive if w.beat.instance_id in usable], prompt):
            store, held = self.best_store(prefill_worker, prompt)
            fetch = held if held > pchoice.cached_blocks else 0
            incarnation = await self.forward_prefill(spec, prefill_worker, dec, store, fetch, held)
            if incarnation is not None:
                where = f", {fetch} from kvstore {store}" if fetch else ""
                shared = " (on the decode worker's device, as asked)" if shares_device(
                    prefill_worker.beat.device, dec.beat.device) else ""
                return (prefill_worker, f"prefill remote{shared}: {pchoice.cached_blocks} blocks cached there{where}",
                        incarnation)
        return None, "no prefill worker answered: decode prefills locally", None

    def best_store(self, worker: Worker, prompt: PromptBlocks) -> tuple[str, int]:
        """The live KV-store holding the longest cached prefix in ``worker``'s layout, and its length."""
        self.sweep()
        stores = self.workers["kvstore"].payloads()
        if not stores:
            return "", 0
        overlap = self.index.prefix_overlap(worker.beat.kv_namespace, prompt.hashes(worker.beat.block_size))
        best = max(stores, key=lambda s: (overlap.get(s.beat.instance_id, 0), s.beat.instance_id))
        return best.beat.instance_id, overlap.get(best.beat.instance_id, 0)

    async def publish_decision(self, msg: GenerateRequest | EmbedRequest, ids: list[int],
                               ranked: list[tuple[Worker, Candidate]], dec: Worker, prefill: Worker | None,
                               reason: str) -> None:
        candidates = [RouteCandidate(instance_id=c.instance_id, cached_blocks=c.cached_blocks, load=c.load, cost=c.cost)
                      for _, c in ranked]
        decision = RoutingDecision(
            request_id=msg.request_id, prompt_tokens=len(ids), prompt_blocks=len(ids) // dec.beat.block_size,
            candidates=candidates, decode_worker=dec.beat.instance_id,
            prefill_worker=prefill.beat.instance_id if prefill else None, reason=reason,
        )
        await self.nc.publish(subjects.ROUTER_DECISIONS, encode(decision))
        self.log.debug("placed %s: %d prompt tokens, decode %s, prefill %s (%s)", msg.request_id, len(ids),
                      dec.beat.instance_id, prefill.beat.instance_id if prefill else "local", reason)

    async def forward_prefill(self, spec: RequestSpec, prefill: Worker, dec: Worker, store: str, fetch: int,
                              held: int) -> str | None:
        """The incarnation of the prefill process that took the request; None when it is gone."""
        work = prefill_request(spec, dec.beat, store, fetch, held)
        stamp = prefill.reserve()
        try:
            incarnation = await self.forward(subjects.prefill(prefill.beat.instance_id), work, prefill)
        except BaseException:
            prefill.release(stamp)
            raise
        if incarnation is None:
            prefill.release(stamp)
        return incarnation

    async def forward_decode(self, spec: RequestSpec, prompt: PromptBlocks, dec: Worker,
                             choice: Candidate) -> str | None:
        """The incarnation of the decode process that took the request; None when it is gone."""
        store, held = self.best_store(dec, prompt)
        fetch = held if held > choice.cached_blocks else 0  # as for a prefill worker (place_prefill)
        work = decode_request(spec, store, fetch, held)
        return await self.forward(subjects.decode_admit(dec.beat.instance_id), work, dec)

    async def forward(self, subject: str, work, worker: Worker) -> str | None:
        """The incarnation of the worker process that took the work (its Ack says; else its last
        beat); None when it is gone (forgotten, try another); raises the worker's typed error when
        it refused the request itself."""
        timeout = self.settings.bus.forward_timeout_s
        answer = asyncio.ensure_future(self.nc.request(subject, encode(work), timeout=timeout))
        try:
            # A request that met the worker's death gets no "no responders" (the server handed it
            # to the connection before it saw it close): ask the worker's alive subject meanwhile.
            while not (await asyncio.wait({answer}, timeout=WORKER_CHECK_S))[0]:
                if not await on_bus(self.nc, worker.beat.service, worker.beat.instance_id, WORKER_CHECK_S * 2):
                    self.log.warning("%s worker %s died with a request on its way to it; dropping it",
                                     worker.beat.service, worker.beat.instance_id)
                    self.forget(worker)
                    return None
            reply = decode(answer.result().data)
        except NatsTimeoutError:
            if self.heard_within(worker):
                # Alive (its heartbeats arrive) but slow: it may still take this request, so placing
                # it elsewhere could run it twice. The request fails; the worker stays.
                self.log.warning("%s worker %s is alive but did not answer within %.1f s", worker.beat.service,
                                 worker.beat.instance_id, timeout)
                raise ProtocolError(ErrorCode.TIMEOUT, f"{worker.beat.service} worker {worker.beat.instance_id} "
                                    f"did not take the request within {timeout:.1f} s") from None
            self.log.warning("%s worker %s did not answer and sends no heartbeats; dropping it",
                             worker.beat.service, worker.beat.instance_id)
            self.forget(worker)
            return None
        except NoRespondersError:
            self.log.warning("%s worker %s is gone (no responders); dropping it", worker.beat.service,
                             worker.beat.instance_id)
            self.forget(worker)
            return None
        finally:
            answer.cancel()
        if isinstance(reply, ErrorReply):
            raise ProtocolError(reply.code, reply.message)
        if not isinstance(reply, Ack):
            raise ProtocolError(ErrorCode.WORKER_FAILURE, f"worker answered {reply.kind!r}")
        return reply.incarnation or worker.beat.incarnation

    def heard_within(self, worker: Worker, window_s: float | None = None) -> bool:
        """Whether ``worker`` beat within ``window_s`` (default: ``worker_timeout_s``)."""
        return self.workers[worker.beat.service].is_alive(worker.beat.instance_id, window_s)

    async def still_there(self, worker: Worker) -> bool:
        """False (and the worker forgotten) for one whose heartbeats are late and who is off the bus:
        a request handed to a prefill worker for a dead decode worker would fail only at the hand-off."""
        if self.heard_within(worker, 2 * self.settings.bus.heartbeat_interval_s):
            return True
        if await on_bus(self.nc, worker.beat.service, worker.beat.instance_id, WORKER_CHECK_S * 2):
            return True
        self.log.warning("%s worker %s is gone (off the bus); dropping it", worker.beat.service,
                         worker.beat.instance_id)
        self.forget(worker)
        return False


def main(settings: Settings) -> None:
    run_service(Router(settings))
