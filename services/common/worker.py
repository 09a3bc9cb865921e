"""The part the prefill and decode services share: a loaded model, an engine thread, streaming.

An :class:`EngineWorker` loads the model named by the settings, sizes the paged KV pool, runs the
engine in an :class:`EngineThread`, publishes its load as heartbeats, honours cancellations and
streams each step's tokens to the requesting client, one message per request per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.services.common.block_snapshot import publish_transfer, register_blocks_endpoint
from tandem.services.common.drain import Drainer
from tandem.services.common.engine_thread import EngineThread
from tandem.services.common.kv_event_publisher import KVEventPublisher
from tandem.services.common.kvstore_client import KVStoreClient
from tandem.services.common.reload import subscribe_weight_updates
from tandem.services.common.runtime import ServiceRuntime
from tandem.services.common.service_metrics import WorkerMetrics
from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest, RequestOutput
from tandem.shared.engine.tp_ranks import Followers, RankJob, dismiss, lead, rank_devices
from tandem.shared.infra.config import Settings
from tandem.shared.kvcache.cache import kv_namespace, size_kv_pool
from tandem.shared.kvtransfer.channel import KVChannel
from tandem.shared.kvtransfer.devcopy import tensor_bytes, to_host
from tandem.shared.lora.peft_format import AdapterError
from tandem.shared.lora.slots import slot_bytes
from tandem.shared.model.loader import LoadedModel, load_model, resolve_dtype
from tandem.shared.model.meta import load_model_meta
from tandem.shared.parallel.group import TensorParallelError, TensorParallelGroup
from tandem.shared.parallel.sharding import shard_config, sharder
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import adapter_hash_root
from tandem.shared.protocol.base import ErrorCode, ErrorReply, ProtocolError, shortened
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.embedding import EmbeddingResult, vector_bytes
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import Cancel, RequestSpec, StreamChunk, TokenLogprobs


def resolve_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def device_id(device: torch.device) -> str:
    """The heartbeat's ``device``: the GPU's UUID, the same in every process computing on it whatever
    index CUDA_VISIBLE_DEVICES gives it there; empty on CPU (cores are not handed out as one device)."""
    if device.type != "cuda":
        return ""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    return uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"


EXIT_RANK_LOST = 3  # a tensor-parallel rank of this worker died (the supervisor restarts the worker)
MAX_OFFERS_IN_FLIGHT = 2  # KV-store offers a worker has under way at once; more are skipped


def engine_config(settings: Settings, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> EngineConfig:
    """The engine section as the engine gets it: every field as configured, with what is resolved at
    start set explicitly (the KV pool's size, the context capped by the model, device and dtype)."""
    engine = settings.engine
    return dataclasses.replace(
        engine, num_blocks=size_kv_pool(engine, loaded.model.config, device, dtype, reserved_bytes=slot_bytes(
            loaded.config, engine.max_loras, engine.max_lora_rank, dtype) if engine.max_loras else 0),
        max_model_len=min(engine.max_model_len, loaded.config.max_position_embeddings),
        device=str(device), dtype=str(dtype).removeprefix("torch."),
    )


def engine_request(spec: RequestSpec, *, kv: torch.Tensor | None = None, output_token_ids: Sequence[int] = (),
                   output_cumulative_logprob: float = 0.0, prefill_only: bool = False,
                   export_on_finish: bool = False) -> EngineRequest:
    """The engine's request for ``spec``, the one place a worker builds it; the keywords are what
    the hop adds (KV that came along, tokens sampled upstream, what to return at the end). Without
    tokens sampled upstream, a migrated request starts from the tokens its client already streamed
    (a hand-off's tokens begin with those, so they replace them)."""
    return EngineRequest(
        request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids), params=spec.params, kv=kv,
        output_token_ids=list(output_token_ids or spec.resume_output_token_ids),
        output_cumulative_logprob=output_cumulative_logprob,
        prefill_only=prefill_only, export_on_finish=export_on_finish, adapter=spec.adapter,
    )


@dataclass
class Stream:
    """Where one request's tokens go and how many output tokens it has emitted so far."""

    subject: str
    next_index: int = 0  # output 0's next token index (a request's only output, unless it asked for several)
    arrival: float = 0.0  # unix time the router accepted it (0: when it reached this worker)
    first_token: float = 0.0  # unix times of its first and latest output token, for latency metrics
    last_token: float = 0.0
    received: float = field(default_factory=time.time)  # when it reached this worker
    pooling: str = ""  # an embedding request's pooling method ("": generation)
    adapter: str = ""  # its LoRA adapter's name, for per-adapter metrics ("": the base model)

    later_outputs: dict[int, int] = field(default_factory=dict)  # the same for outputs 1.. of a request with several

    def __post_init__(self) -> None:
        self.arrival = self.arrival or self.received

    def index(self, sample_index: int) -> int:
        """The index output ``sample_index``'s next token has in its stream."""
        return self.next_index if sample_index == 0 else self.later_outputs.get(sample_index, 0)

    def advance(self, sample_index: int, num_tokens: int) -> None:
        if sample_index == 0:
            self.next_index += num_tokens
        else:
            self.later_outputs[sample_index] = self.index(sample_index) + num_tokens


class EngineWorker(ServiceRuntime):
    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        if settings.engine.torch_threads:
            torch.set_num_threads(settings.engine.torch_threads)
        self.device = resolve_device(settings.engine.device)
        self.device_id = device_id(self.device)
        self.dtype = resolve_dtype(settings.engine.dtype, self.device)
        quantization = settings.engine.quantization
        self.log.info("loading model %s on %s (%s%s)", settings.model, self.device, self.dtype,
                      "" if quantization == "none" else f", {quantization} weights")
        self.tensor_parallel, self.followers = self.start_ranks(settings)
        # Quantized here, not by the engine: the KV pool is then sized with the smaller weights.
        self.loaded = load_model(settings.model, device=self.device, dtype=self.dtype, data_dir=settings.data_dir,
                                 quantization=quantization, shard=sharder(self.tensor_parallel))
        self.model_name = self.loaded.name
        self.engine_config = engine_config(settings, self.loaded, self.device, self.dtype)
        if self.tensor_parallel is not None:  # the pool every rank can hold
            blocks = self.tensor_parallel.min_over_ranks(self.engine_config.num_blocks)
            self.engine_config = dataclasses.replace(self.engine_config, num_blocks=blocks)
        self.max_model_len = self.engine_config.max_model_len
        self.engine = LLMEngine(self.loaded.model, self.loaded.tokenizer, self.engine_config, self.device, self.dtype)
        self.engine.prepare_structured_outputs()
        self.streams: dict[str, Stream] = {}
        self.offers_in_flight = 0
        self.offers_skipped = 0
        self.draining = False
        self.drainer = Drainer(self)
        self.serving = WorkerMetrics(self.prom, lambda: self.thread.stats if self.thread else self.engine.stats(),
                                     lambda: self.thread.busy_s if self.thread else 0.0,
                                     lambda: self.thread.steps if self.thread else 0, lambda: self.draining,
                                     self.engine_config.max_loras)
        self.thread: EngineThread | None = None
        self.kv_channel: KVChannel | None = None  # opened in setup
        self._outbox: list[tuple[str, str, bytes]] = []  # (request id, its stream subject, a chunk)
        cfg = self.loaded.config
        self.kv_namespace = kv_namespace(f"{self.model_name}@{self.loaded.weights_id}", self.dtype, cfg.num_layers,
                                         cfg.num_kv_heads, cfg.head_dim, settings.engine.block_size)
        self.log.info(
            "model %s ready: %d KV blocks of %d tokens, max_model_len %d",
            self.model_name, self.engine_config.num_blocks, settings.engine.block_size, self.max_model_len,
        )

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "model": self.model_name, "device": str(self.device),
                "tensor_parallel_size": str(self.settings.engine.tensor_parallel_size)}

    def start_ranks(self, settings: Settings) -> tuple[TensorParallelGroup | None, Followers | None]:
        """With ``--tensor-parallel-size`` k > 1: ranks 1..k-1 as processes, and this one as rank 0."""
        size = settings.engine.tensor_parallel_size
        if size == 1:
            return None, None
        try:  # refused here, in one line, before any process starts
            shard_config(load_model_meta(settings.model, settings.data_dir).config, size)
            rank_devices(self.device, size)
        except TensorParallelError as exc:
            raise SystemExit(f"tandem serve {self.name}: {exc}") from None
        job = RankJob(model=str(settings.model), data_dir=None if settings.data_dir is None else str(settings.data_dir),
                      dtype=str(self.dtype).removeprefix("torch."), quantization=settings.engine.quantization,
                      torch_threads=settings.engine.torch_threads, engine=dataclasses.asdict(settings.engine))
        group, followers = lead(job, size, self.device)
        self.log.info("tensor parallel: rank 0 of %d on %s, ranks 1..%d started", size, self.device, size - 1)

        def on_death(rank: int, code: int) -> None:
            # Every collective would now wait for it: the worker cannot go on, and says why.
            self.log.error("tensor-parallel rank %d exited (code %d); this worker stops", rank, code)
            logging.shutdown()
            os._exit(EXIT_RANK_LOST)

        followers.watch(on_death)
        return group, followers

    async def setup(self) -> None:
        # KV frames (hand-offs, KV-store puts and gets) go and come over bulk connections of its own.
        self.kv_channel = await KVChannel.open(self.nc, self.settings.bus, options=self.bus_options,
                                               name=f"tandem-{self.name}-{self.instance_id}", log=self.log,
                                               add_endpoint=functools.partial(self.add_endpoint, bulk=True))
        loop = asyncio.get_running_loop()
        self.kv_events = KVEventPublisher(self.nc, self.name, self.instance_id)
        self.spawn(self.kv_events.run(), "KV event publisher")
        self.thread = EngineThread(self.engine, loop, self.on_outputs, self.on_failure, self.on_kv_events,
                                   on_scheduled=self.on_scheduled)
        self.thread.start()
        await self.nc.subscribe(subjects.CANCEL_ALL, cb=self._on_cancel)
        await self.drainer.register()
        await register_blocks_endpoint(self)  # the console's block-table view
        await subscribe_weight_updates(self)  # hot reload after a trainer's checkpoint

    async def teardown(self) -> None:
        if self.thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.thread.stop)
        if self.followers is not None:  # the engine thread has stopped: nothing else talks to the ranks
            await asyncio.get_running_loop().run_in_executor(None, dismiss, self.tensor_parallel, self.followers)

    async def disconnected(self) -> None:
        if self.kv_channel is not None:
            await self.kv_channel.close()

    async def drain(self) -> None:
        """A stop drains as a scale-down does (:mod:`tandem.services.common.drain`)."""
        await self.drainer.begin()
        await self.drainer.idle()

    async def abandon(self) -> int:
        return self.drainer.abandon()

    def heartbeat(self) -> Heartbeat:
        stats = self.thread.stats if self.thread else self.engine.stats()
        adapters = self.engine.adapters
        return Heartbeat(
            service=self.name, instance_id=self.instance_id, host=self.host, pid=os.getpid(),
            incarnation=self.incarnation, model=self.model_name, running=stats["running"],
            waiting=stats["waiting"] + stats.get("swapped", 0),
            free_blocks=stats["free_blocks"], num_blocks=stats["num_blocks"],
            block_size=self.engine_config.block_size, max_model_len=self.max_model_len, kv_namespace=self.kv_namespace,
            max_num_seqs=self.engine_config.max_num_seqs,
            prefix_cache_queries=stats.get("prefix_cache_queries", 0),
            prefix_cache_hits=stats.get("prefix_cache_hits", 0),
            draining=self.draining, device=self.device_id,
            max_loras=self.engine_config.max_loras, max_lora_rank=self.engine_config.max_lora_rank if adapters else 0,
            adapters_resident=stats.get("adapters_resident", []),
            adapters_host=adapters.in_host() if adapters else [],
        )

    def busy(self) -> bool:
        """Whether this worker still holds requests (a drain waits until it does not)."""
        stats = self.thread.stats if self.thread else self.engine.stats()
        return bool(self.streams) or bool(stats["running"] or stats["waiting"] or stats.get("swapped", 0))

    def on_scheduled(self, request_ids: list[str], started: float) -> None:
        for request_id in request_ids:
            stream = self.streams.get(request_id)
            if stream is not None:
                self.serving.on_scheduled(stream, started)

    def metrics(self) -> dict:
        stats = self.thread.stats if self.thread else self.engine.stats()
        return {**stats, "kv_namespace": self.kv_namespace, "steps": self.thread.steps if self.thread else 0,
                "kvstore_offers_skipped": self.offers_skipped}

    async def offer_blocks(self, store: str, request_id: str, hashes: list[int], blocks: torch.Tensor) -> None:
        """Put ``blocks`` (one per hash, on any device) into a KV-store; a failure is only logged:
        the store is a cache, the request is unaffected."""
        if not hashes:
            return
        if self.offers_in_flight >= MAX_OFFERS_IN_FLIGHT:
            # The store is a cache: under load, skipping an offer costs a possible later hit, while
            # queueing every prompt's KV (134 MB per 1k tokens of an 8B model) would starve hand-offs.
            self.offers_skipped += 1
            self.log.debug("skipped offering %s's blocks to kvstore %s: %d offers in flight", request_id, store,
                           self.offers_in_flight)
            return
        self.offers_in_flight += 1
        start = time.time()
        try:
            blob = await asyncio.to_thread(lambda: tensor_bytes(to_host(blocks)))  # device copy: off the loop
            client = KVStoreClient(self.nc, store, channel=self.kv_channel)
            reply = await client.put(self.kv_namespace, hashes, blob, len(blob) // len(hashes))
        except Exception as exc:
            self.log.warning("offering %s's blocks to kvstore %s failed: %s", request_id, store, exc)
            return
        finally:
            self.offers_in_flight -= 1
        await publish_transfer(self.nc, request_id, self.instance_id, store, "store", len(hashes), len(blob),
                               start, time.time())
        self.log.debug("offered %d blocks of %s to kvstore %s (%d new)", len(hashes), request_id, store, reply.stored)

    async def fetch_prefix(self, spec: RequestSpec, store: str, blocks: int) -> torch.Tensor | None:
        """Up to ``blocks`` of ``spec``'s leading prompt blocks from the KV-store ``store``, or None
        (nothing to fetch, a miss or a failure: the engine computes them). Prompt logprobs score every
        prompt token, so none of such a prompt may come from a store. A migrated request fetches its
        prefix too; its resumed tokens are computed with the rest of the prompt."""
        bs = self.engine_config.block_size
        want = min(blocks, (len(spec.prompt_token_ids) - 1) // bs)  # the last token is computed
        if not store or want <= 0 or spec.params.prompt_logprobs is not None:
            return None
        hashes = prefix_hashes(spec.prompt_token_ids, bs, adapter_hash_root(spec.adapter))[:want]
        start = time.time()
        try:
            client = KVStoreClient(self.nc, store, channel=self.kv_channel)
            found, blob, block_bytes = await client.get(self.kv_namespace, hashes, prefix_only=True)
        except Exception as exc:
            self.log.warning("kvstore %s fetch for %s failed (%s); computing the prefix", store, spec.request_id, exc)
            return None
        if found:
            await publish_transfer(self.nc, spec.request_id, store, self.instance_id, "store", len(found), len(blob),
                                   start, time.time())
        layout = self.engine.kv_layout
        if not found or block_bytes != math.prod(layout) * self.dtype.itemsize:
            return None  # nothing cached, or blocks of another layout under this namespace: compute
        return torch.frombuffer(blob, dtype=torch.uint8).view(self.dtype).view(len(found), *layout)

    def on_kv_events(self, stored: list[int], removed: list[int]) -> None:
        self.kv_events.add(self.kv_namespace, stored, removed)

    def check_request(self, spec: RequestSpec) -> None:
        """Refuse what the engine cannot serve, with the code a client can act on."""
        model, prompt_token_ids = spec.model, spec.prompt_token_ids
        if model != self.model_name:
            raise ProtocolError(ErrorCode.UNKNOWN_MODEL, f"this worker serves {self.model_name!r}, not {model!r}")
        if not prompt_token_ids:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "the prompt is empty")
        if spec.params.max_tokens is None:  # the router grants a number; a worker never guesses one
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "max_tokens is unset (the router sets it)", "max_tokens")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ProtocolError(ErrorCode.PROMPT_TOO_LONG,
                                f"prompt has {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}")
        if max(prompt_token_ids) >= self.loaded.config.vocab_size:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"token id {max(prompt_token_ids)} is outside the vocabulary")

    async def prepare_adapter(self, spec: RequestSpec) -> None:
        """Read the request's adapter into host memory (off the event loop) unless it is there, so
        the engine thread only copies it into a slot; a bad adapter is the request's typed error."""
        if spec.adapter is None:
            return
        cache = self.engine.adapters
        if cache is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"worker {self.instance_id} serves no LoRA adapters "
                                f"(asked for {spec.adapter.name!r}): start it with --max-loras N", "model")
        started = time.perf_counter()
        loads = cache.loads
        try:
            await asyncio.to_thread(cache.load, spec.adapter)
        except AdapterError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc), "model") from None
        if cache.loads > loads:
            self.log.info("adapter %s loaded from %s in %.2fs", spec.adapter.key, spec.adapter.path,
                          time.perf_counter() - started)

    async def _on_cancel(self, msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except ProtocolError as exc:
            self.limited.warning("ignored cancels", "ignored bad cancel: %s", exc)
            return
        stream = self.streams.get(cancel.request_id)
        if stream is None:
            return
        # Two checks: the cancel was sent under the stream's owner (on a bus with identities
        # nats-server vouches for the sender's token), and it names the very stream.
        names_it = hmac.compare_digest(stream.subject.encode(), cancel.stream_subject.encode())
        if not (subjects.sent_by_owner(msg.subject, stream.subject) and names_it):
            self.limited.warning("ignored cancels", "ignored a cancel of %s from %s: not its owner's",
                                 shortened(cancel.request_id, 80), subjects.owner_of(msg.subject))
            return
        self.log.debug("cancel %s", cancel.request_id)
        self.thread.abort(cancel.request_id)

    # -- outputs ----------------------------------------------------------------------------------
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            self.serving.on_output(out, stream, now)
            if out.ends_request:
                del self.streams[out.request_id]
            if self.handle_output(out, stream):
                continue
            if out.error is not None:  # the engine ended this request alone; the others go on
                self.log.debug("%s failed in the engine (logged there): %s", out.request_id, out.error)
                self.send_error(out.request_id, stream, out.error)
                continue
            if out.embedding is not None:
                self.send_embedding(stream, out)
                continue
            self.send_chunk(stream, out.request_id, out.new_token_ids, out.text_delta,
                            out.finish_reason if out.finished else None, logprobs=out.logprobs,
                            prompt_logprobs=out.prompt_logprobs, sample_index=out.sample_index,
                            cumulative_logprob=out.cumulative_logprob)
            if out.ends_request:
                self.log.debug("%s finished: %s after %d tokens", out.request_id, out.finish_reason,
                               stream.index(out.sample_index))

    def handle_output(self, out: RequestOutput, stream: Stream) -> bool:
        """Subclass hook: True when the output was dealt with and needs no plain chunk."""
        return False

    def send_chunk(self, stream: Stream, request_id: str, token_ids: list[int], text: str,
                   finish_reason: str | None, error: ErrorReply | None = None,
                   logprobs: list[TokenLogprobs] | None = None,
                   prompt_logprobs: list[TokenLogprobs | None] | None = None, sample_index: int = 0,
                   cumulative_logprob: float | None = None) -> None:
        """Queue one chunk on the request's stream; ``logprobs``: one entry per token, when asked;
        ``prompt_logprobs``: the request's, on its first chunk, when asked."""
        if not token_ids and not text and finish_reason is None and error is None and prompt_logprobs is None:
            return
        chunk = StreamChunk(request_id=request_id, index=stream.index(sample_index), token_ids=list(token_ids),
                            text=text, finish_reason=finish_reason, error=error, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, sample_index=sample_index,
                            cumulative_logprob=cumulative_logprob)
        stream.advance(sample_index, len(token_ids))
        self._queue_message(request_id, stream.subject, encode(chunk))

    def send_embedding(self, stream: Stream, out: RequestOutput) -> None:
        """Queue an embedding request's one result on its stream: its vector as float32 bytes."""
        result = EmbeddingResult(request_id=out.request_id, embedding=vector_bytes(out.embedding.tolist()),
                                 num_prompt_tokens=out.num_prompt_tokens, pooling=stream.pooling)
        self._queue_message(out.request_id, stream.subject, encode(result))
        self.log.debug("%s embedded: %d prompt tokens", out.request_id, out.num_prompt_tokens)

    def _queue_message(self, request_id: str, subject: str, payload: bytes) -> None:
        # One task per engine step publishes every message of that step, not one task per message.
        self._outbox.append((request_id, subject, payload))
        if len(self._outbox) == 1:
            self.spawn(self._flush_outbox(), "publish chunks")

    async def _flush_outbox(self) -> None:
        batch, self._outbox = self._outbox, []
        for request_id, subject, payload in batch:
            try:
                await self.nc.publish(subject, payload)
            except Exception as exc:  # one request's bad subject must not drop the other requests' chunks
                if request_id in self.streams:
                    self.limited.warning("unpublishable streams", "cannot publish to %s's stream (%s: %s); "
                                         "aborting it", request_id, type(exc).__name__, exc)
                    self.thread.abort(request_id)

    def fail(self, request_id: str, stream: Stream, exc: BaseException) -> None:
        self.send_error(request_id, stream, f"{type(exc).__name__}: {exc}")

    def send_error(self, request_id: str, stream: Stream, message: str,
                   code: ErrorCode = ErrorCode.WORKER_FAILURE) -> None:
        """End the request's stream with an error (a worker failure unless ``code`` says) saying ``message``."""
        error = ErrorReply(code=code, message=shortened(message), request_id=request_id)
        self.send_chunk(stream, request_id, [], "", "error", error)

    def on_failure(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            stream = self.streams.pop(request_id, None)
            if stream is not None:
                self.fail(request_id, stream, exc)
