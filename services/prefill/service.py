"""The prefill service: runs prompts through the model in chunks and hands their KV to decode.

``tandem serve prefill --nats-url URL``. Endpoint ``tandem.v1.prefill.<id>.prefill`` takes a
:class:`PrefillRequest`. The engine prefills it (chunked: ``max_num_batched_tokens`` per step,
batched with other prompts), samples the first token, which goes straight to the client, then
the prompt's KV blocks travel to the chosen decode worker — through its shared-memory ring when
both are on one host, otherwise as checksummed binary frames over NATS, striped across this
worker's bulk connections (``--kv-connections``; :mod:`tandem.shared.kvtransfer.handoff` picks the
path) — followed by a
:class:`DecodeRequest` that admits the sequence there. If the first token already ends the
request (EOS, a stop string, ``max_tokens=1``) nothing is handed off.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from nats.micro.request import Request

from tandem.services.common.block_snapshot import publish_transfer
from tandem.services.common.runtime import run_service
from tandem.services.common.worker import EngineWorker, Stream, engine_request
from tandem.shared.engine.sequence import RequestOutput
from tandem.shared.infra.config import Settings
from tandem.shared.kvtransfer.handoff import Destination, HandoffSender
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import adapter_hash_root
from tandem.shared.protocol.base import Ack, ErrorCode, ErrorReply, ProtocolError
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.codec import decode, encode, error_reply
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.kv import RingSlots
from tandem.shared.protocol.serving import DecodeRequest, PrefillRequest

PREFILLED = "prefilled"  # the engine's finish reason for a prefill-only sequence it handed back


def handoff_request(msg: PrefillRequest, output_token_ids: list[int], kv_namespace: str, block_size: int,
                    first_token_time: float, output_cumulative_logprob: float = 0.0) -> DecodeRequest:
    """What admits ``msg``'s sequence at its decode worker once prefilled here: the same spec,
    the tokens sampled here (and their logprobs' sum), and the hop's own fields (the KV's transfer
    or ring slots go in later)."""
    return DecodeRequest(
        spec=msg.spec, output_token_ids=list(output_token_ids), kv_namespace=kv_namespace, kvstore=msg.kvstore,
        output_cumulative_logprob=output_cumulative_logprob,
        # The full prompt blocks go to the store from here; decode offers the blocks after them.
        kvstore_held_blocks=len(msg.spec.prompt_token_ids) // block_size, first_token_time=first_token_time,
    )


class PrefillService(EngineWorker):
    name = "prefill"
    description = "chunked prefill worker; hands KV blocks to decode workers"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.pending: dict[str, PrefillRequest] = {}
        self.handoffs: dict[str, str] = {}  # request -> decode worker, while its hand-off is under way
        self.kv_sender: HandoffSender | None = None  # made in setup, on the KV channel

    async def setup(self) -> None:
        await super().setup()
        self.kv_sender = HandoffSender(self.kv_channel, self.settings.kv_ring, log=self.log)
        await self.add_endpoint("prefill", subjects.prefill(self.instance_id), self.on_prefill)

    async def on_prefill(self, request: Request) -> None:
        msg: PrefillRequest = decode(request.data, PrefillRequest)
        spec = msg.spec
        self.check_request(spec)
        if spec.request_id in self.streams:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request {spec.request_id} is already running here")
        # A migrated request's stream goes on after the tokens its client already has.
        self.streams[spec.request_id] = Stream(spec.stream_subject, next_index=len(spec.resume_output_token_ids),
                                               arrival=spec.arrival_time,
                                               adapter=spec.adapter.name if spec.adapter else "")
        self.pending[spec.request_id] = msg
        # Admission waits for the engine thread (up to a step) and maybe a store round trip: from a
        # task, or every request behind this one in the subscription waits too.
        self.spawn(self.admit(msg, request), f"admit {spec.request_id}")

    async def admit(self, msg: PrefillRequest, request: Request) -> None:
        spec = msg.spec
        prefix = None
        try:
            await self.prepare_adapter(spec)
            prefix = await self.fetch_prefix(spec, msg.kvstore, msg.kvstore_fetch_blocks)
            await self.thread.add(engine_request(spec, kv=prefix, prefill_only=True))
        except Exception as exc:  # refused by the engine (ValueError) or failed: the router hears why
            self.streams.pop(spec.request_id, None)
            self.pending.pop(spec.request_id, None)
            error = ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) if isinstance(exc, ValueError) else exc
            await request.respond(encode(error_reply(error, spec.request_id)))
            return
        self.log.debug("prefill %s: %d tokens (%d from kvstore) for decode %s", spec.request_id,
                      len(spec.prompt_token_ids),
                      0 if prefix is None else prefix.shape[0] * self.settings.engine.block_size,
                      msg.decode_worker)
        await request.respond(encode(Ack(request_id=spec.request_id, incarnation=self.incarnation)))

    def handle_output(self, out: RequestOutput, stream: Stream) -> bool:
        msg = self.pending.pop(out.request_id, None) if out.ends_request else None
        if msg is None or out.finish_reason != PREFILLED:
            return False
        # The first token goes to the client now (a request with several outputs has none: its
        # decode worker samples them all); the hand-off happens in the background.
        self.send_chunk(stream, out.request_id, out.new_token_ids, out.text_delta, None, logprobs=out.logprobs,
                        prompt_logprobs=out.prompt_logprobs)
        self.handoffs[out.request_id] = msg.decode_worker  # a drain waits for it
        self.spawn(self.tracked_hand_off(msg, out, stream), f"hand-off of {out.request_id}")
        return True

    async def tracked_hand_off(self, msg: PrefillRequest, out: RequestOutput, stream: Stream) -> None:
        try:
            await self.hand_off(msg, out, stream)
        finally:
            self.handoffs.pop(msg.spec.request_id, None)

    def busy(self) -> bool:
        return super().busy() or bool(self.handoffs)

    def heartbeat(self) -> Heartbeat:
        # A request moves from pending to handoffs when its prefill ends: each counts once.
        counts = Counter(m.decode_worker for m in self.pending.values())
        counts.update(worker for request_id, worker in self.handoffs.items() if request_id not in self.pending)
        return super().heartbeat().model_copy(update={"pending_decode": sorted(counts),
                                                      "owed_requests": dict(counts)})

    async def hand_off(self, msg: PrefillRequest, out: RequestOutput, stream: Stream) -> None:
        """Move the prompt's KV to the decode worker (its ring on this host, else NATS frames),
        then admit the sequence there."""
        start = time.time()
        request_id, prompt = msg.spec.request_id, msg.spec.prompt_token_ids
        kv: torch.Tensor = out.kv.contiguous()
        # The decode worker's sequence holds every output token so far: a migrated request's resumed
        # ones (the KV covers them too) and the one sampled here.
        admit = handoff_request(msg, [*msg.spec.resume_output_token_ids, *out.new_token_ids], self.kv_namespace,
                                self.settings.engine.block_size, stream.first_token, out.cumulative_logprob or 0.0)
        to = Destination(worker=msg.decode_worker, subject=subjects.decode_kv(msg.decode_worker),
                         ring=msg.decode_ring, host=msg.decode_host)
        try:
            sent = await self.kv_sender.send(kv, to, request_id)
            admit = admit.model_copy(update={"ring": sent} if isinstance(sent, RingSlots) else {"transfer": sent})
            reply = decode((await self.nc.request(subjects.decode_admit(msg.decode_worker), encode(admit),
                                                  timeout=self.settings.bus.request_timeout_s)).data)
        except Exception as exc:
            self.log.warning("hand-off of %s to %s failed: %s", request_id, msg.decode_worker, exc)
            self.fail(request_id, stream, exc)
            return
        if isinstance(reply, ErrorReply):
            # The client's request was fine (it passed the router and this worker): a refused hand-off
            # is the workers' failure, which the client answers by placing the request again.
            self.log.warning("decode %s refused %s: %s", msg.decode_worker, request_id, reply.message)
            self.send_error(request_id, stream, f"decode worker {msg.decode_worker} refused the hand-off: "
                                                f"{reply.code.value}: {reply.message}")
            return
        self.log.debug("handed %s to decode %s: %d blocks, %d bytes, %s", request_id, msg.decode_worker,
                      kv.shape[0], kv.numel() * kv.element_size(), "shared memory" if admit.ring else "NATS frames")
        await publish_transfer(self.nc, request_id, self.instance_id, msg.decode_worker,
                               "ring" if admit.ring else "nats", kv.shape[0], kv.numel() * kv.element_size(),
                               start, time.time())
        if msg.kvstore:  # the prompt's full blocks the store does not hold yet
            held, full = msg.kvstore_held_blocks, len(prompt) // self.settings.engine.block_size
            hashes = prefix_hashes(prompt, self.settings.engine.block_size, adapter_hash_root(msg.spec.adapter))
            await self.offer_blocks(msg.kvstore, request_id, hashes[held:full], kv[held:full])

    async def teardown(self) -> None:
        await super().teardown()
        if self.kv_sender is not None:
            self.kv_sender.close()

    def on_failure(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            self.pending.pop(request_id, None)
        super().on_failure(request_ids, exc)


def main(settings: Settings) -> None:
    run_service(PrefillService(settings))
