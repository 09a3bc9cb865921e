"""The decode service: continuous batching over a paged KV cache, tokens streamed to clients.

``tandem serve decode --nats-url URL``. Endpoints (per instance):

- ``tandem.v1.decode.<id>.kv``: binary KV frames from prefill workers (see :mod:`tandem.shared.kvtransfer.frames`),
  landed and checksummed by the reader threads of this worker's bulk connections (``--kv-connections``);
- ``tandem.v1.decode.<id>.admit``: a :class:`DecodeRequest`, prefilled elsewhere (its KV arrived as
  frames and is verified here, or lies in this worker's shared-memory ring when the prefill worker
  is on the same host) or to prefill locally;
- ``tandem.v1.decode.<id>.embed``: an :class:`EmbedWork`, an embedding: its prompt joins the
  running batch as a prefill (chunked like any), is pooled, and its vector goes to the client's
  stream as one :class:`EmbeddingResult` (see :mod:`tandem.shared.engine.pooling`).

Both paths end in the worker's :class:`HandoffReceiver` (:mod:`tandem.shared.kvtransfer.handoff`), which
creates the ring (``--kv-ring-mib``, 0 disables it) at start; heartbeats advertise it with this host's
id, and the router passes both on to prefill workers.

The scheduler (:mod:`tandem.shared.engine.scheduler`) queues sequences when blocks run out and
preempts by recompute when the running batch outgrows the pool. Every ``probe_interval_s`` the
worker asks each client stream whether anyone still listens; a vanished client's sequence is
aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro.request import Request

from tandem.services.common.runtime import run_service
from tandem.services.common.worker import EngineWorker, Stream, engine_request
from tandem.shared.engine.sequence import EngineRequest, RequestOutput
from tandem.shared.infra.config import Settings
from tandem.shared.kvtransfer.handoff import HandoffReceiver
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode, error_reply
from tandem.shared.protocol.embedding import EmbedWork
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import DecodeRequest, Probe


class DecodeService(EngineWorker):
    name = "decode"
    description = "continuous-batching decode worker over a paged KV cache"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        cfg, engine = self.loaded.config, settings.engine
        self.kv_receiver = HandoffReceiver(
            self.instance_id, kv_namespace=self.kv_namespace,
            kv_shape=(cfg.num_layers, 2, engine.block_size, cfg.num_kv_heads, cfg.head_dim), dtype=self.dtype,
            device=self.device,
            # Room for prompts in flight: a quarter of the pool, at least one full-length prompt.
            frames_blocks=max(self.engine_config.num_blocks // 4, -(-self.max_model_len // engine.block_size)),
            step_blocks=-(-engine.max_num_batched_tokens // engine.block_size), ring=settings.kv_ring, log=self.log)
        self.offers: dict[str, tuple[str, int]] = {}  # request -> (kvstore, leading blocks it holds)
        self.admitting: set[str] = set()  # requests whose KV is being read, not yet in self.streams

    def heartbeat(self) -> Heartbeat:
        transfers = self.kv_receiver.transfers
        return super().heartbeat().model_copy(update={
            "host_id": self.kv_receiver.host, "kv_ring": self.kv_receiver.ring_name,
            "kv_transfers_ring": transfers["ring"], "kv_transfers_nats": transfers["nats"],
        })

    def metrics(self) -> dict:
        transfers = self.kv_receiver.transfers
        return {**super().metrics(), "kv_transfers_ring": transfers["ring"], "kv_transfers_nats": transfers["nats"]}

    async def teardown(self) -> None:
        await super().teardown()
        self.kv_receiver.close()

    async def setup(self) -> None:
        await super().setup()
        await self.kv_receiver.serve(self.kv_channel, subjects.decode_kv(self.instance_id))
        await self.add_endpoint("admit", subjects.decode_admit(self.instance_id), self.on_admit)
        await self.add_endpoint("embed", subjects.decode_embed(self.instance_id), self.on_embed)
        self.spawn(self.probe_loop(), "probe loop")
        self.spawn(self.kv_receiver.reclaim_every(self.settings.bus.probe_interval_s), "ring reclaim")

    async def on_admit(self, request: Request) -> None:
        # Admission waits for the ring copy and the engine thread (up to a step): from a task, or
        # every hand-off behind this one in the subscription waits too.
        self.spawn(self.replying("admit", self.admit, request), "admit")

    async def replying(self, what: str, take: Callable[[Request], Awaitable[None]], request: Request) -> None:
        """``take(request)``, which answers it; what it raises is answered as a typed error."""
        try:
            await take(request)
        except Exception as exc:
            reply = error_reply(exc)
            self.limited.warning(f"{what} replies {reply.code.value}", "%s: replied %s (%s)", what, reply.code.value,
                                 reply.message)
            await request.respond(encode(reply))

    async def on_embed(self, request: Request) -> None:
        # The engine thread takes it between two steps: from a task, as admits.
        self.spawn(self.replying("embed", self.embed, request), "embed")

    async def embed(self, request: Request) -> None:
        msg: EmbedWork = decode(request.data, EmbedWork)
        self.check_embedding(msg)
        if msg.request_id in self.streams or msg.request_id in self.admitting:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request {msg.request_id} is already running here")
        self.streams[msg.request_id] = Stream(msg.stream_subject, arrival=msg.arrival_time,
                                              pooling=msg.pooling.method)
        try:
            await self.thread.add(EngineRequest(msg.request_id, list(msg.prompt_token_ids), pooling=msg.pooling))
        except ValueError as exc:
            del self.streams[msg.request_id]
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        self.log.debug("embed %s: %d prompt tokens, %s pooling", msg.request_id, len(msg.prompt_token_ids),
                       msg.pooling.method)
        await request.respond(encode(Ack(request_id=msg.request_id, incarnation=self.incarnation)))

    def check_embedding(self, msg: EmbedWork) -> None:
        """Refuse an embedding this worker cannot compute, with the code a client can act on (the
        router checks the same first; a worker checks again, as it does a generation request)."""
        if msg.model != self.model_name:
            raise ProtocolError(ErrorCode.UNKNOWN_MODEL, f"this worker serves {self.model_name!r}, not {msg.model!r}")
        if len(msg.prompt_token_ids) > self.max_model_len:
            raise ProtocolError(ErrorCode.PROMPT_TOO_LONG, f"input has {len(msg.prompt_token_ids)} tokens; the "
                                f"context holds {self.max_model_len}", "prompt")
        if max(msg.prompt_token_ids) >= self.loaded.config.vocab_size:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"token id {max(msg.prompt_token_ids)} is outside the vocabulary", "prompt")
        hidden = self.loaded.config.hidden_size
        if msg.pooling.dimensions is not None and msg.pooling.dimensions > hidden:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"dimensions is {msg.pooling.dimensions}; this model's "
                                f"embeddings have {hidden}", "dimensions")

    async def admit(self, request: Request) -> None:
        msg: DecodeRequest = decode(request.data, DecodeRequest)
        spec = msg.spec
        try:
            self.check_request(spec)
            if spec.request_id in self.streams or spec.request_id in self.admitting:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request {spec.request_id} is already running here")
            await self.prepare_adapter(spec)
        except ProtocolError:
            self.kv_receiver.discard(msg)  # refused before its blocks are copied; their slots go back at once
            raise
        self.admitting.add(spec.request_id)  # a duplicate arriving during the copy is refused too
        try:
            kv = await self.kv_receiver.take(msg)  # a ring copy runs on a thread: admits and streams go on
            if kv is None:  # prefilled here: the store's cached prefix first, as a prefill worker would
                kv = await self.fetch_prefix(spec, msg.kvstore, msg.kvstore_fetch_blocks)
        finally:
            self.admitting.discard(spec.request_id)
        work = engine_request(spec, kv=kv, output_token_ids=msg.output_token_ids,
                              output_cumulative_logprob=msg.output_cumulative_logprob,
                              export_on_finish=bool(msg.kvstore))
        self.streams[spec.request_id] = Stream(spec.stream_subject, next_index=len(work.output_token_ids),
                                               arrival=spec.arrival_time, first_token=msg.first_token_time,
                                               last_token=msg.first_token_time,
                                               adapter=spec.adapter.name if spec.adapter else "")
        if msg.kvstore:
            self.offers[spec.request_id] = (msg.kvstore, msg.kvstore_held_blocks)
        try:
            await self.thread.add(work)
        except ValueError as exc:
            del self.streams[spec.request_id]
            self.offers.pop(spec.request_id, None)
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        if kv is None:
            how = "prefilling locally"
        elif msg.ring or msg.transfer:
            how = f"{kv.shape[0]} KV blocks received {'through the ring' if msg.ring else 'as NATS frames'}"
        else:
            how = f"{kv.shape[0]} KV blocks from kvstore {msg.kvstore}, prefilling the rest locally"
        self.log.debug("admit %s: %d prompt tokens, %s", spec.request_id, len(spec.prompt_token_ids), how)
        await request.respond(encode(Ack(request_id=spec.request_id, incarnation=self.incarnation)))

    def handle_output(self, out: RequestOutput, stream: Stream) -> bool:
        offer = self.offers.pop(out.request_id, None) if out.ends_request else None
        if offer is not None and out.kv is not None:
            # The full blocks past what the store holds: mostly the generated ones (the prefill
            # worker offered the prompt's), so a next turn repeating this conversation finds them.
            store, held = offer
            self.spawn(self.offer_blocks(store, out.request_id, out.kv_hashes[held:], out.kv[held:]),
                       f"offer {out.request_id}'s blocks")
        return False  # the chunk goes out as usual

    def on_failure(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            self.offers.pop(request_id, None)
        super().on_failure(request_ids, exc)

    async def probe_loop(self) -> None:
        """Abort sequences whose client stopped listening (closed, crashed, or cancelled silently)."""
        while True:
            await asyncio.sleep(self.settings.bus.probe_interval_s)
            streams = list(self.streams.items())
            results = await asyncio.gather(*(self._listening(rid, s) for rid, s in streams))
            for (request_id, _), alive in zip(streams, results):
                if not alive and request_id in self.streams:
                    self.log.debug("client of %s is gone; aborting", request_id)
                    self.thread.abort(request_id)

    async def _listening(self, request_id: str, stream: Stream) -> bool:
        try:
            await self.nc.request(stream.subject, encode(Probe(request_id=request_id)), timeout=5.0)
        except NoRespondersError:
            return False
        except NatsTimeoutError:
            return True  # a busy client is still a client
        return True


def main(settings: Settings) -> None:
    run_service(DecodeService(settings))
