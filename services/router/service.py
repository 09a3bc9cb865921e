"""The router: entry point for generation requests.

``tandem serve router --nats-url URL``. Endpoint ``tandem.v1.router.generate`` (queue-balanced, so
several routers can share the load) takes a :class:`GenerateRequest`: it validates it, tokenizes
the prompt, picks the least-loaded decode worker and, when one is alive, the least-loaded prefill
worker, forwards the work, and replies :class:`GenerateAccepted` (tokens then flow from the workers
straight to the client's stream subject) or a typed :class:`ErrorReply`. With no prefill worker
alive, or when the chosen one does not answer, the decode worker prefills by itself.

Workers are known from their heartbeats (``tandem.v1.heartbeat.>``); a worker silent for
``worker_timeout_s`` is dropped. Load is running + waiting sequences from the last heartbeat plus
what this router assigned since, so a burst does not all land on one worker. KV-aware scoring
replaces :meth:`Router.pick` in the KV-plane work.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from nats.micro.request import Request

from tandem.services.runtime import ServiceRuntime, run_service
from tandem.shared import subjects
from tandem.shared.config import Settings
from tandem.shared.messages import (
    Ack, DecodeRequest, ErrorCode, ErrorReply, GenerateAccepted, GenerateRequest, Heartbeat, PrefillRequest,
    ProtocolError, decode, encode, error_reply,
)
from tandem.shared.model import load_model_meta

FORWARD_TIMEOUT_S = 10.0


@dataclass
class Worker:
    beat: Heartbeat
    seen: float
    assigned: list[float] = field(default_factory=list)  # times of assignments since the last beat

    def load(self) -> int:
        return self.beat.running + self.beat.waiting + len(self.assigned)


class Router(ServiceRuntime):
    name = "router"
    description = "validates, tokenizes and places generation requests"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.meta = load_model_meta(settings.model, data_dir=settings.data_dir)
        self.workers: dict[str, dict[str, Worker]] = {"prefill": {}, "decode": {}}

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "model": self.meta.name}

    async def setup(self) -> None:
        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.on_heartbeat)
        await self.add_endpoint("generate", subjects.ROUTER_GENERATE, self.on_generate, queue_group="router")

    async def on_heartbeat(self, msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        pool = self.workers.get(beat.service)
        if pool is None:
            return
        now = time.monotonic()
        worker = pool.get(beat.instance_id)
        if worker is None:
            self.log.info("%s worker %s joined (host %s, model %s)", beat.service, beat.instance_id, beat.host, beat.model)
            pool[beat.instance_id] = Worker(beat, now)
        else:
            worker.beat, worker.seen = beat, now
            worker.assigned = [t for t in worker.assigned if t > now - self.settings.heartbeat_interval_s]

    def alive(self, service: str, model: str) -> list[Worker]:
        pool = self.workers[service]
        deadline = time.monotonic() - self.settings.worker_timeout_s
        for instance_id in [i for i, w in pool.items() if w.seen < deadline]:
            self.log.info("%s worker %s left (no heartbeat)", service, instance_id)
            del pool[instance_id]
        return [w for w in pool.values() if w.beat.model == model and not w.beat.draining]

    def pick(self, candidates: list[Worker]) -> Worker | None:
        """Least loaded; ties go to the worker with more free KV blocks."""
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.load(), -w.beat.free_blocks, w.beat.instance_id))

    def forget(self, worker: Worker) -> None:
        self.workers[worker.beat.service].pop(worker.beat.instance_id, None)

    async def on_generate(self, request: Request) -> None:
        # Placement waits on worker round trips: answer from a task so one slow worker never
        # holds up the next request in this subscription.
        self.spawn(self.place(request), "place request")

    async def place(self, request: Request) -> None:
        request_id = None
        try:
            msg: GenerateRequest = decode(request.data, GenerateRequest)
            request_id = msg.request_id
            reply = await self.place_valid(msg)
        except Exception as exc:
            reply = error_reply(exc, request_id)
            self.log.info("rejected %s: %s %s", request_id, reply.code.value, reply.message)
        await request.respond(encode(reply))

    def tokenize(self, msg: GenerateRequest) -> list[int]:
        model = msg.model or self.meta.name
        if model != self.meta.name:
            raise ProtocolError(ErrorCode.UNKNOWN_MODEL, f"unknown model {model!r}; this router serves {self.meta.name!r}")
        if (msg.prompt is None) == (msg.prompt_token_ids is None):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "give exactly one of prompt and prompt_token_ids")
        ids = self.meta.tokenizer.encode(msg.prompt) if msg.prompt is not None else list(msg.prompt_token_ids)
        if not ids:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        if max(ids) >= self.meta.config.vocab_size:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"token id {max(ids)} is outside the vocabulary")
        return ids

    async def place_valid(self, msg: GenerateRequest) -> GenerateAccepted:
        ids = self.tokenize(msg)
        while True:
            decode_worker = self.pick(self.alive("decode", self.meta.name))
            if decode_worker is None:
                raise ProtocolError(ErrorCode.NO_WORKERS, f"no decode worker serves {self.meta.name!r}")
            if len(ids) >= decode_worker.beat.max_model_len:
                raise ProtocolError(
                    ErrorCode.PROMPT_TOO_LONG,
                    f"prompt has {len(ids)} tokens; the context holds {decode_worker.beat.max_model_len}",
                )
            prefill_worker = self.pick(self.alive("prefill", self.meta.name))
            if prefill_worker is not None and await self.forward_prefill(msg, ids, prefill_worker, decode_worker):
                break
            if await self.forward_decode(msg, ids, decode_worker):
                prefill_worker = None
                break
        decode_worker.assigned.append(time.monotonic())
        self.log.info("placed %s: %d prompt tokens, prefill %s, decode %s", msg.request_id, len(ids),
                      prefill_worker.beat.instance_id if prefill_worker else "local", decode_worker.beat.instance_id)
        return GenerateAccepted(
            request_id=msg.request_id, prompt_token_ids=ids, decode_worker=decode_worker.beat.instance_id,
            prefill_worker=prefill_worker.beat.instance_id if prefill_worker else None,
        )

    async def forward_prefill(self, msg: GenerateRequest, ids: list[int], prefill: Worker, dec: Worker) -> bool:
        work = PrefillRequest(request_id=msg.request_id, prompt_token_ids=ids, params=msg.params,
                              stream_subject=msg.stream_subject, decode_worker=dec.beat.instance_id, model=self.meta.name)
        if await self.forward(subjects.prefill(prefill.beat.instance_id), work, prefill):
            prefill.assigned.append(time.monotonic())
            return True
        return False

    async def forward_decode(self, msg: GenerateRequest, ids: list[int], dec: Worker) -> bool:
        work = DecodeRequest(request_id=msg.request_id, prompt_token_ids=ids, params=msg.params,
                             stream_subject=msg.stream_subject, model=self.meta.name)
        return await self.forward(subjects.decode_admit(dec.beat.instance_id), work, dec)

    async def forward(self, subject: str, work, worker: Worker) -> bool:
        """True when the worker took the work; False when it is gone (forgotten, try another);
        raises the worker's typed error when it refused the request itself."""
        try:
            reply = decode((await self.nc.request(subject, encode(work), timeout=FORWARD_TIMEOUT_S)).data)
        except (NoRespondersError, NatsTimeoutError) as exc:
            self.log.warning("%s worker %s did not answer (%s); dropping it",
                             worker.beat.service, worker.beat.instance_id, type(exc).__name__)
            self.forget(worker)
            return False
        if isinstance(reply, ErrorReply):
            raise ProtocolError(reply.code, reply.message)
        if not isinstance(reply, Ack):
            raise ProtocolError(ErrorCode.WORKER_FAILURE, f"worker answered {reply.kind!r}")
        return True


def main(settings: Settings) -> None:
    run_service(Router(settings))
