"""The decode service: continuous batching over a paged KV cache, tokens streamed to clients.

``tandem serve decode --nats-url URL``. Endpoints (per instance):

- ``tandem.v1.decode.<id>.kv``: binary KV frames from prefill workers (see :mod:`tandem.shared.kvtransfer.frames`),
  landed and checksummed by the reader threads of this worker's bulk connections (``--kv-connections``);
- ``tandem.v1.decode.<id>.admit``: a :class:`DecodeRequest`, prefilled elsewhere (its KV arrived as
  frames and is verified here, or lies in this worker's shared-memory ring when the prefill worker
  is on the same host) or to prefill locally.

The ring (:mod:`tandem.shared.kvtransfer.ring`, ``--kv-ring-mib``, 0 disables it) is created at start and
advertised in heartbeats with this host's id; the router passes both on to prefill workers.

The scheduler (:mod:`tandem.shared.engine.scheduler`) queues sequences when blocks run out and
preempts by recompute when the running batch outgrows the pool. Every ``probe_interval_s`` the
worker asks each client stream whether anyone still listens; a vanished client's sequence is
aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import re
import threading

import torch
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro.request import Request

from tandem.services.common.runtime import run_service
from tandem.services.common.worker import EngineWorker, Stream, engine_request
from tandem.shared.engine.sequence import RequestOutput
from tandem.shared.infra.config import Settings
from tandem.shared.kvtransfer.frames import KVReceiver
from tandem.shared.kvtransfer.ring import RingError, ShmRing, SlotDescriptor, host_id
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode, error_reply
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import DecodeRequest, Probe

RING_STALE_S = 120.0  # a READY slot whose admit never came: far beyond any admit timeout


RING_AUTO_MAX_BYTES = 4 << 30  # the largest ring a CUDA decode worker sizes for itself (pinned host memory)


class DecodeService(EngineWorker):
    name = "decode"
    description = "continuous-batching decode worker over a paged KV cache"
    moves_kv = True

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        cfg = self.loaded.config
        self.kv_shape = (cfg.num_layers, 2, settings.engine.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.block_bytes = torch.Size(self.kv_shape).numel() * torch.empty((), dtype=self.dtype).element_size()
        # Room for prompts in flight: a quarter of the pool, at least one full-length prompt.
        blocks_for_one = -(-self.max_model_len // settings.engine.block_size)
        budget = max(self.engine_config.num_blocks // 4, blocks_for_one) * self.block_bytes
        self.receiver = KVReceiver(max_bytes_in_flight=budget)
        self.ring: ShmRing | None = None
        self.ring_copies = threading.Semaphore(settings.kv_ring.copies)
        self.transfers = {"ring": 0, "nats": 0}
        self.offers: dict[str, tuple[str, int]] = {}  # request -> (kvstore, leading blocks it holds)
        self.admitting: set[str] = set()  # requests whose KV is being read, not yet in self.streams
        if settings.kv_ring.mib:
            slot = settings.kv_ring.slot_kib * 1024
            ring_bytes = settings.kv_ring.mib << 20
            if self.device.type == "cuda":
                # Room for two full prefill steps of hand-offs: an 8B model's 1k-token prompt is 134 MB,
                # and a hand-off that finds the ring full waits, then falls back to NATS frames.
                step_bytes = -(-settings.engine.max_num_batched_tokens // settings.engine.block_size) * self.block_bytes
                ring_bytes = max(ring_bytes, min(RING_AUTO_MAX_BYTES, 2 * step_bytes))
            label = re.sub(r"[^A-Za-z0-9_.]", "_", self.instance_id)[:64]  # ring labels allow fewer characters
            self.ring = ShmRing.create(label, slot_bytes=slot, num_slots=max(1, ring_bytes // slot))
            self.log.info("KV ring %s: %d MiB in %d KiB slots", self.ring.name, ring_bytes >> 20,
                          settings.kv_ring.slot_kib)

    def heartbeat(self) -> Heartbeat:
        return super().heartbeat().model_copy(update={
            "host_id": host_id(), "kv_ring": self.ring.name if self.ring else "",
            "kv_transfers_ring": self.transfers["ring"], "kv_transfers_nats": self.transfers["nats"],
        })

    def metrics(self) -> dict:
        return {**super().metrics(), "kv_transfers_ring": self.transfers["ring"],
                "kv_transfers_nats": self.transfers["nats"]}

    async def teardown(self) -> None:
        await super().teardown()
        if self.ring is not None:
            self.ring.close()  # the process leaves by os._exit: atexit would not unlink it

    async def setup(self) -> None:
        await super().setup()
        await self.add_kv_endpoint("kv", subjects.decode_kv(self.instance_id), self.receiver)
        await self.add_endpoint("admit", subjects.decode_admit(self.instance_id), self.on_admit)
        self.spawn(self.probe_loop(), "probe loop")

    async def on_admit(self, request: Request) -> None:
        # Admission waits for the ring copy and the engine thread (up to a step): from a task, or
        # every hand-off behind this one in the subscription waits too.
        self.spawn(self.admit_replying(request), "admit")

    async def admit_replying(self, request: Request) -> None:
        try:
            await self.admit(request)
        except Exception as exc:
            reply = error_reply(exc)
            self.limited.warning(f"admit replies {reply.code.value}", "admit: replied %s (%s)", reply.code.value,
                                 reply.message)
            await request.respond(encode(reply))

    async def admit(self, request: Request) -> None:
        msg: DecodeRequest = decode(request.data, DecodeRequest)
        spec = msg.spec
        self.check_request(spec)
        if spec.request_id in self.streams or spec.request_id in self.admitting:
            self.discard_kv(msg)  # refused before its blocks are copied; their slots go back at once
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request {spec.request_id} is already running here")
        self.admitting.add(spec.request_id)  # a duplicate arriving during the copy is refused too
        try:
            # A 1k-token prompt of an 8B model is 134 MB: the ring is read on a thread, or every admit
            # and token stream of this worker waits behind the copy (frames were reassembled and
            # checksummed as they landed: taking them only compares the checksums).
            kv = await asyncio.to_thread(self.received_kv, msg) if msg.ring is not None else self.received_kv(msg)
            if kv is None:  # prefilled here: the store's cached prefix first, as a prefill worker would
                kv = await self.fetch_prefix(spec, msg.kvstore, msg.kvstore_fetch_blocks)
        finally:
            self.admitting.discard(spec.request_id)
        work = engine_request(spec, kv=kv, output_token_ids=msg.output_token_ids,
                              output_cumulative_logprob=msg.output_cumulative_logprob,
                              export_on_finish=bool(msg.kvstore))
        self.streams[spec.request_id] = Stream(spec.stream_subject, next_index=len(work.output_token_ids),
                                               arrival=spec.arrival_time, first_token=msg.first_token_time,
                                               last_token=msg.first_token_time)
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

    def discard_kv(self, msg: DecodeRequest) -> None:
        """Give back what a refused admit's KV holds here (its ring slots, its reassembled frames)."""
        try:
            if msg.ring is not None and self.ring is not None and msg.ring.ring == self.ring.name:
                desc = SlotDescriptor.from_wire(msg.ring.model_dump())
                self.ring.claim(desc)
                self.ring.release(desc)
            elif msg.transfer is not None:
                self.receiver.take(msg.transfer)
        except Exception as exc:  # already gone, stale or incomplete: nothing left to give back
            self.log.debug("discarding %s's KV: %s", msg.spec.request_id, exc)

    def received_kv(self, msg: DecodeRequest) -> torch.Tensor | None:
        """The prompt's KV blocks that came with ``msg``, from NATS frames or the ring; None if none."""
        if (msg.ring or msg.transfer) and msg.kv_namespace != self.kv_namespace:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"KV blocks of layout {msg.kv_namespace!r} cannot enter a {self.kv_namespace!r} cache")
        if msg.ring is not None:
            if self.ring is None or msg.ring.ring != self.ring.name:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"ring {msg.ring.ring!r} is not this worker's")
            try:
                # On a GPU worker the slots go straight into device memory (pinned -> GPU DMA).
                staging = torch.empty(msg.ring.length, dtype=torch.uint8, device=self.device)
                # The ring is thread-safe; kv_ring_copies copies out of it at once keep the link busy.
                with self.ring_copies:
                    raw = self.ring.read(SlotDescriptor.from_wire(msg.ring.model_dump()), out=staging)
            except RingError as exc:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"ring slots unusable: {exc}") from None
            self.transfers["ring"] += 1
        elif msg.transfer is not None:
            raw = torch.frombuffer(self.receiver.take(msg.transfer), dtype=torch.uint8)
            self.transfers["nats"] += 1
        else:
            return None
        if raw.numel() % self.block_bytes:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "KV bytes are not a whole number of this worker's blocks")
        return raw.view(self.dtype).view(raw.numel() // self.block_bytes, *self.kv_shape)

    async def probe_loop(self) -> None:
        """Abort sequences whose client stopped listening (closed, crashed, or cancelled silently)."""
        while True:
            await asyncio.sleep(self.settings.bus.probe_interval_s)
            if self.ring is not None:
                self.ring.reclaim(stale_after_s=RING_STALE_S)
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
