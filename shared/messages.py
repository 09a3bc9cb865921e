"""Typed messages on the bus: pydantic v2 models, a ``kind`` discriminator, a schema version, msgpack.

Every control message is one of the models below, encoded with :func:`encode` (msgpack of the
model's Python-mode dump, so ``bytes`` stay bytes) and read back with :func:`decode`, which turns
every way a payload can be wrong into a :class:`ProtocolError` carrying an :class:`ErrorCode`. A
service replies to a bad message with :class:`ErrorReply` and keeps running.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

SCHEMA_VERSION = 1
MAX_STOP_STRINGS = 16


class ErrorCode(str, Enum):
    BAD_FRAME = "bad_frame"  # not msgpack, or not a map
    UNSUPPORTED_VERSION = "unsupported_version"
    BAD_SCHEMA = "bad_schema"  # unknown kind or wrong fields
    INVALID_REQUEST = "invalid_request"  # well-formed but not servable as asked
    PROMPT_TOO_LONG = "prompt_too_long"
    UNKNOWN_MODEL = "unknown_model"
    NO_WORKERS = "no_workers"
    TIMEOUT = "timeout"
    WORKER_FAILURE = "worker_failure"


class ProtocolError(Exception):
    """A message could not be accepted; ``code`` says why in a form clients can branch on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = SCHEMA_VERSION


class SamplingParams(BaseModel):
    """What the client asks of generation; field bounds are the validation (vLLM's defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False


class GenerateRequest(_Message):
    """Client to router. Exactly one of ``prompt`` and ``prompt_token_ids``."""

    kind: Literal["generate"] = "generate"
    request_id: str = Field(min_length=1, max_length=128)
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    stream_subject: str = Field(min_length=1)


class GenerateAccepted(_Message):
    """Router to client: the request is placed; tokens follow on the stream subject."""

    kind: Literal["accepted"] = "accepted"
    request_id: str
    prompt_token_ids: list[int]
    prefill_worker: str | None
    decode_worker: str


class ErrorReply(_Message):
    kind: Literal["error"] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None


class Ack(_Message):
    kind: Literal["ack"] = "ack"
    request_id: str | None = None


class PrefillRequest(_Message):
    """Router to a prefill worker: prefill, emit the first token, hand the KV to ``decode_worker``
    (through its shared-memory ring ``decode_ring`` when the prefill worker is on ``decode_host``)."""

    kind: Literal["prefill"] = "prefill"
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream_subject: str
    decode_worker: str
    model: str
    decode_ring: str = ""
    decode_host: str = ""
    kvstore: str = ""  # a KV-store to fetch the prompt's cached prefix from and offer its new blocks to
    kvstore_fetch_blocks: int = Field(0, ge=0)  # leading blocks worth fetching (the store has more than the worker)
    kvstore_held_blocks: int = Field(0, ge=0)  # leading blocks the store already holds (offer only the rest)
    arrival_time: float = 0.0  # unix time the router accepted the request (TTFT is measured from it)


class RingSlots(BaseModel):
    """Where a hand-off's KV bytes lie in the decode worker's ring (a SlotDescriptor on the wire)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ring: str
    slots: list[Annotated[int, Field(ge=0)]]
    length: int = Field(ge=1)
    generation: int = Field(ge=0)


class KVTransfer(BaseModel):
    """Describes the KV bytes sent ahead of a :class:`DecodeRequest` as binary frames."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    transfer_id: str
    num_blocks: int = Field(ge=1)
    block_bytes: int = Field(ge=1)
    checksums: list[int]  # crc32 of each block, in order


class DecodeRequest(_Message):
    """To a decode worker: admit a sequence, already prefilled (``transfer``) or to prefill locally."""

    kind: Literal["decode"] = "decode"
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = Field(default_factory=list)
    params: SamplingParams
    stream_subject: str
    model: str
    transfer: KVTransfer | None = None  # KV sent ahead as NATS frames ...
    ring: RingSlots | None = None  # ... or left in the decode worker's shared-memory ring
    kv_namespace: str = ""  # the sender's KV layout: must equal the receiver's when KV comes along
    kvstore: str = ""  # a KV-store to offer the sequence's full blocks to when it ends ...
    kvstore_held_blocks: int = Field(0, ge=0)  # ... past the leading blocks it already holds
    arrival_time: float = 0.0  # unix time the router accepted the request (for latency metrics)
    first_token_time: float = 0.0  # unix time the prefill worker sent the first token (for inter-token latency)


class StreamChunk(_Message):
    """Worker to client: output tokens ``index .. index+len(token_ids)-1`` and their text."""

    kind: Literal["chunk"] = "chunk"
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: ErrorReply | None = None


class Probe(_Message):
    """Worker to client stream, with a reply subject: is anybody still listening?"""

    kind: Literal["probe"] = "probe"
    request_id: str


class Cancel(_Message):
    kind: Literal["cancel"] = "cancel"
    request_id: str


class Heartbeat(_Message):
    """Each worker's load and identity, published a few times a second."""

    kind: Literal["heartbeat"] = "heartbeat"
    service: str
    instance_id: str
    host: str
    pid: int
    model: str
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 16
    max_model_len: int = 0
    draining: bool = False
    kv_namespace: str = ""  # blocks are comparable only within one (see tandem.shared.kvcache.cache)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    host_id: str = ""  # workers with equal host ids share /dev/shm (tandem.shared.shmring.host_id)
    kv_ring: str = ""  # a decode worker's shared-memory ring for KV hand-offs on this host
    kv_transfers_ring: int = 0  # hand-offs received through the ring ...
    kv_transfers_nats: int = 0  # ... and as NATS frames
    pending_decode: list[str] = Field(default_factory=list)  # prefill: decode workers it still owes a hand-off


class KVEvent(_Message):
    """Blocks a worker or store now holds (``stored``) or no longer holds (``removed``), by chained
    block hash within ``namespace``; ``cleared`` drops everything ``source`` held before. Published to
    the JetStream stream ``TANDEM_KV_EVENTS`` so a restarted router can rebuild its index."""

    kind: Literal["kv_event"] = "kv_event"
    source: str  # instance id
    service: str  # "decode", "prefill" or "kvstore"
    namespace: str  # model, dtype and KV layout: blocks are only comparable within one
    seq: int = Field(ge=0)  # per-source counter: a gap means events were lost
    stored: list[Annotated[int, Field(ge=0, lt=2**64)]] = Field(default_factory=list)
    removed: list[Annotated[int, Field(ge=0, lt=2**64)]] = Field(default_factory=list)
    cleared: bool = False


# -- KV store (services/kvstore): lookup, get and put of KV blocks by chained block hash -------------
BlockHash = Annotated[int, Field(ge=0, lt=2**64)]
MAX_KV_HASHES = 65536  # hashes per request: a 1M-token prompt at block size 16
# A subject a store may send frames to: dot-separated tokens, no spaces, no wildcards.
SUBJECT_PATTERN = r"^[^\s.*>]+(\.[^\s.*>]+)*$"


class KVLookupRequest(_Message):
    """To a KV store: which of ``hashes`` (a chain, in order) do you hold in ``namespace``?"""

    kind: Literal["kv_lookup"] = "kv_lookup"
    namespace: str = Field(min_length=1, max_length=256)
    hashes: list[BlockHash] = Field(max_length=MAX_KV_HASHES)


class KVLookupReply(_Message):
    """``leading``: how many of the first hashes are all present; ``present``: one flag per hash."""

    kind: Literal["kv_lookup_reply"] = "kv_lookup_reply"
    store: str  # instance id of the answering store
    namespace: str
    leading: int
    present: list[bool]


class KVGetRequest(_Message):
    """To a KV store: send the blocks of ``hashes`` you hold as KV frames to ``inbox`` (the requester
    acks each frame, see :mod:`tandem.shared.frames`), then reply with a :class:`KVGetReply`.
    ``prefix_only`` stops at the first missing hash."""

    kind: Literal["kv_get"] = "kv_get"
    request_id: str = Field(min_length=1, max_length=128)
    namespace: str = Field(min_length=1, max_length=256)
    hashes: list[BlockHash] = Field(min_length=1, max_length=MAX_KV_HASHES)
    inbox: str = Field(min_length=1, max_length=256, pattern=SUBJECT_PATTERN)
    prefix_only: bool = False


class KVGetReply(_Message):
    """The blocks sent: ``found[i]`` is the hash of block ``i`` of ``transfer`` (None: none found)."""

    kind: Literal["kv_get_reply"] = "kv_get_reply"
    request_id: str
    found: list[int]
    transfer: KVTransfer | None = None


class KVPutRequest(_Message):
    """To a KV store, after the transfer's frames went to its ``kv`` subject: keep these blocks,
    block ``i`` of ``transfer`` under ``hashes[i]``."""

    kind: Literal["kv_put"] = "kv_put"
    request_id: str = Field(min_length=1, max_length=128)
    namespace: str = Field(min_length=1, max_length=256)
    hashes: list[BlockHash] = Field(min_length=1, max_length=MAX_KV_HASHES)
    transfer: KVTransfer


class KVPutReply(_Message):
    """``stored``: blocks new to the store; the rest were already there or larger than both tiers."""

    kind: Literal["kv_put_reply"] = "kv_put_reply"
    request_id: str
    stored: int


class RouteCandidate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    instance_id: str
    cached_blocks: int
    load: int
    cost: float


class RoutingDecision(_Message):
    """What the router decided for one request and why, published for the console."""

    kind: Literal["routing_decision"] = "routing_decision"
    request_id: str
    prompt_tokens: int
    prompt_blocks: int
    candidates: list[RouteCandidate]
    decode_worker: str
    prefill_worker: str | None
    reason: str


# -- trainer (services/trainer): jobs, per-step metrics, the stream timeline, hot reload ------------
class TrainJob(BaseModel):
    """One training run: what to train, on what, for how long, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = "tiny"  # "tiny", a preset name (see tandem.shared.train), or a Hugging Face directory
    dataset: str = "stdlib"  # "stdlib" (the Python standard library's sources) or a text file/folder
    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(256, ge=2)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)  # global-norm clipping; 0 turns it off
    warmup_steps: int = Field(0, ge=0)
    seed: int = Field(0, ge=0)
    device: str = "auto"
    checkpoint_every: int = Field(0, ge=0)  # steps between checkpoints; 0: only at the end
    output_dir: str | None = None  # default: <data_dir>/train/<job_id>
    resume: bool = False  # continue from the latest checkpoint in output_dir
    gpu_memory_gib: float | None = Field(None, gt=0)  # cap through set_per_process_memory_fraction
    device_update_layers: int = Field(0, ge=0)  # first layers whose AdamW math runs on the GPU (0: all on the CPU)
    device_update_sets: int = Field(2, ge=1, le=16)  # GPU buffer sets for those updates (state loads ahead)
    compile_layers: bool | None = None  # torch.compile the layer blocks; None: on CUDA only
    split_update: bool | None = None  # host AdamW as preview + commit (optimizer.py); None: on CUDA only


class TrainStart(_Message):
    kind: Literal["train_start"] = "train_start"
    job_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    job: TrainJob = Field(default_factory=TrainJob)


class TrainStop(_Message):
    kind: Literal["train_stop"] = "train_stop"
    job_id: str


class TrainStatusRequest(_Message):
    kind: Literal["train_status"] = "train_status"
    job_id: str | None = None  # None: every job this trainer knows


class TrainJobStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    job_id: str
    state: Literal["queued", "running", "stopping", "stopped", "finished", "failed"]
    step: int
    steps: int
    loss: float | None = None
    message: str = ""


class TrainStatusReply(_Message):
    kind: Literal["train_status_reply"] = "train_status_reply"
    trainer: str  # instance id
    jobs: list[TrainJobStatus]


class TrainStepMetrics(_Message):
    """Published after every optimizer step of a job."""

    kind: Literal["train_step"] = "train_step"
    job_id: str
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    model_tflops: float  # (6N + 6 L d seq) * tokens / step time, as in DESIGN.md
    step_time_s: float
    gpu_memory_bytes: int = 0  # allocated now
    gpu_memory_peak_bytes: int = 0


class TimelineOp(BaseModel):
    """One operation of a training step on one lane, times in seconds from the step's start."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    lane: Literal["h2d", "compute", "d2h", "optimizer"]
    layer: int  # -1: not a decoder layer (embedding, head, loss)
    phase: Literal["fwd", "bwd", "opt", "recompute"]
    start_s: float
    end_s: float
    bytes: int = 0


class TrainTimeline(_Message):
    """The per-layer timeline of one step, at a bounded rate, for the console's stream-overlap view."""

    kind: Literal["train_timeline"] = "train_timeline"
    job_id: str
    step: int
    ops: list[TimelineOp]
    hidden_fraction: float  # of host<->device transfer time, the part under compute


class WeightsUpdated(_Message):
    """A trainer saved new weights for ``model``: workers serving it reload from ``path``."""

    kind: Literal["weights_updated"] = "weights_updated"
    model: str  # the served model name ("tiny" or the directory's name)
    path: str
    step: int
    version: str  # changes with every checkpoint; part of the KV namespace after a reload


# -- metrics and planner (services/planner, the supervisor) -----------------------------------------
class HistogramSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    bounds: list[float]  # bucket upper bounds, increasing (the +Inf bucket is implied)
    counts: list[int]  # per bucket, not cumulative; len(bounds) + 1 (last: above every bound)
    sum: float
    count: int


class MetricsSnapshot(_Message):
    """One service instance's metrics, published every few seconds (the Prometheus figures, by name)."""

    kind: Literal["metrics"] = "metrics"
    service: str
    instance_id: str
    host: str
    time: float  # unix seconds
    counters: dict[str, float] = Field(default_factory=dict)
    gauges: dict[str, float] = Field(default_factory=dict)
    histograms: dict[str, HistogramSnapshot] = Field(default_factory=dict)


class ScalingDecision(_Message):
    """What the planner wants and why; the supervisor carries it out within its limits."""

    kind: Literal["scaling_decision"] = "scaling_decision"
    time: float
    prefill_current: int
    decode_current: int
    prefill_wanted: int
    decode_wanted: int
    reason: str  # one line for a human
    inputs: dict[str, float] = Field(default_factory=dict)  # the load figures it decided on


class ScaleRequest(_Message):
    """An operator asks for worker counts (the console's confirmed action); the planner's limits hold."""

    kind: Literal["scale_request"] = "scale_request"
    prefill: int | None = Field(None, ge=0)
    decode: int | None = Field(None, ge=0)
    reason: str = ""


class DrainRequest(_Message):
    """Stop taking new requests, finish the ones held, then exit (or stay idle when ``exit`` is false)."""

    kind: Literal["drain"] = "drain"
    exit: bool = True


# -- console views -----------------------------------------------------------------------------------
class SequenceBlocks(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str
    num_tokens: int
    block_table: list[int]
    prefix_cached_blocks: int = 0  # leading blocks claimed from this worker's prefix cache
    imported_blocks: int = 0  # leading blocks that came from a hand-off or the KV-store


class BlockSnapshot(_Message):
    """A worker's KV pool: one state byte per physical block and every live sequence's block table."""

    kind: Literal["block_snapshot"] = "block_snapshot"
    instance_id: str
    num_blocks: int
    block_size: int
    states: bytes  # per block: 0 free, 1 in use, 2 free but cached, 3 shared (ref count > 1)
    sequences: list[SequenceBlocks]


class KVTransferEvent(_Message):
    """One KV hand-off or store transfer, published after it completes (console's transfer lanes)."""

    kind: Literal["kv_transfer"] = "kv_transfer"
    request_id: str
    source: str
    dest: str
    path: Literal["ring", "nats", "store"]
    blocks: int
    bytes: int
    start: float  # unix seconds
    end: float


Message = Annotated[
    Union[
        GenerateRequest, GenerateAccepted, ErrorReply, Ack, PrefillRequest, DecodeRequest,
        StreamChunk, Probe, Cancel, Heartbeat, KVEvent, RoutingDecision,
        KVLookupRequest, KVLookupReply, KVGetRequest, KVGetReply, KVPutRequest, KVPutReply,
        TrainStart, TrainStop, TrainStatusRequest, TrainStatusReply, TrainStepMetrics, TrainTimeline,
        WeightsUpdated, MetricsSnapshot, ScalingDecision, ScaleRequest, DrainRequest, BlockSnapshot,
        KVTransferEvent,
    ],
    Field(discriminator="kind"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)
_SHAPE_ERRORS = {"missing", "extra_forbidden", "union_tag_invalid", "union_tag_not_found", "literal_error"}


def encode(message: BaseModel) -> bytes:
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def decode(data: bytes, expect: type[BaseModel] | tuple[type[BaseModel], ...] | None = None) -> BaseModel:
    """Parse one message; raise :class:`ProtocolError` for anything that is not a valid one."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(ErrorCode.BAD_FRAME, f"payload is not msgpack ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "payload is not a msgpack map")
    if raw.get("v") != SCHEMA_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION, f"schema version {raw.get('v')!r} is not supported (want {SCHEMA_VERSION})"
        )
    try:
        message = _adapter.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        # A field out of its bounds is a bad request; a missing, extra or mistyped field is bad schema.
        shape_error = first["type"].endswith("_type") or first["type"] in _SHAPE_ERRORS
        code = ErrorCode.BAD_SCHEMA if shape_error else ErrorCode.INVALID_REQUEST
        raise ProtocolError(code, f"{where}: {first['msg']}") from None
    if expect is not None and not isinstance(message, expect):
        raise ProtocolError(ErrorCode.BAD_SCHEMA, f"unexpected message kind {message.kind!r} here")
    return message


def error_reply(exc: Exception, request_id: str | None = None) -> ErrorReply:
    """The reply for an exception raised while handling a message."""
    if isinstance(exc, ProtocolError):
        return ErrorReply(code=exc.code, message=exc.message, request_id=request_id)
    return ErrorReply(code=ErrorCode.WORKER_FAILURE, message=f"{type(exc).__name__}: {exc}", request_id=request_id)
