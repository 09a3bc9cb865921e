"""The decode service: continuous batching over a paged KV cache, tokens streamed to clients.

``tandem serve decode --nats-url URL``. Endpoints (per instance):

- ``tandem.v1.decode.<id>.kv``: binary KV frames from prefill workers (see :mod:`tandem.shared.frames`);
- ``tandem.v1.decode.<id>.admit``: a :class:`DecodeRequest`, prefilled elsewhere (its KV arrived as
  frames and is verified here) or to prefill locally when no prefill worker is alive.

The scheduler (:mod:`tandem.shared.engine.scheduler`) queues sequences when blocks run out and
preempts by recompute when the running batch outgrows the pool. Every ``probe_interval_s`` the
worker asks each client stream whether anyone still listens; a vanished client's sequence is
aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio

import torch
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from nats.micro.request import Request

from tandem.services.runtime import run_service
from tandem.services.worker import EngineWorker, Stream
from tandem.shared import subjects
from tandem.shared.config import Settings
from tandem.shared.engine import EngineRequest
from tandem.shared.frames import KVReceiver
from tandem.shared.messages import DecodeRequest, ErrorCode, Probe, ProtocolError, decode, encode, Ack
from tandem.shared.engine import SamplingParams as EngineSampling


def engine_sampling(params) -> EngineSampling:
    """Bus-level sampling parameters as the engine's dataclass."""
    return EngineSampling(**params.model_dump())


class DecodeService(EngineWorker):
    name = "decode"
    description = "continuous-batching decode worker over a paged KV cache"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        cfg = self.loaded.config
        self.kv_shape = (cfg.num_layers, 2, settings.block_size, cfg.num_kv_heads, cfg.head_dim)
        per_block = torch.Size(self.kv_shape).numel() * torch.empty((), dtype=self.dtype).element_size()
        # Room for prompts in flight: a quarter of the pool, at least one full-length prompt.
        blocks_for_one = -(-self.max_model_len // settings.block_size)
        budget = max(self.engine_config.num_blocks // 4, blocks_for_one) * per_block
        self.receiver = KVReceiver(max_bytes_in_flight=budget)

    async def setup(self) -> None:
        await super().setup()
        await self.add_endpoint("kv", subjects.decode_kv(self.instance_id), self.on_kv_frame)
        await self.add_endpoint("admit", subjects.decode_admit(self.instance_id), self.on_admit)
        self.spawn(self.probe_loop(), "probe loop")

    async def on_kv_frame(self, request: Request) -> None:
        self.receiver.on_frame(request.data)
        await request.respond(b"ok")

    async def on_admit(self, request: Request) -> None:
        msg: DecodeRequest = decode(request.data, DecodeRequest)
        self.check_request(msg.model, msg.prompt_token_ids)
        kv = None
        if msg.transfer is not None:
            blob = self.receiver.take(msg.transfer)
            kv = torch.frombuffer(blob, dtype=self.dtype).view(msg.transfer.num_blocks, *self.kv_shape)
            if msg.transfer.block_bytes != kv[0].numel() * kv.element_size():
                raise ProtocolError(ErrorCode.INVALID_REQUEST, "KV block layout differs from this worker's")
        engine_request = EngineRequest(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            params=engine_sampling(msg.params),
            kv=kv,
            output_token_ids=list(msg.output_token_ids),
        )
        if msg.request_id in self.streams:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request {msg.request_id} is already running here")
        self.streams[msg.request_id] = Stream(msg.stream_subject, next_index=len(msg.output_token_ids))
        try:
            await self.thread.add(engine_request)
        except ValueError as exc:
            del self.streams[msg.request_id]
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        self.log.info(
            "admit %s: %d prompt tokens, %s", msg.request_id, len(msg.prompt_token_ids),
            f"{msg.transfer.num_blocks} KV blocks received" if msg.transfer else "prefilling locally",
        )
        await request.respond(encode(Ack(request_id=msg.request_id)))

    async def probe_loop(self) -> None:
        """Abort sequences whose client stopped listening (closed, crashed, or cancelled silently)."""
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            streams = list(self.streams.items())
            results = await asyncio.gather(*(self._listening(rid, s) for rid, s in streams))
            for (request_id, _), alive in zip(streams, results):
                if not alive and request_id in self.streams:
                    self.log.info("client of %s is gone; aborting", request_id)
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
