"""What services say about themselves and how the fleet is steered: heartbeats, metrics snapshots,
routing decisions, the planner's scaling decisions, operator scale and drain requests."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.shared.protocol.base import WireMessage


class Heartbeat(WireMessage):
    """Each worker's load and identity, published a few times a second."""

    kind: Literal["heartbeat"] = "heartbeat"
    service: str
    instance_id: str
    host: str
    pid: int
    model: str
    # This process's own id, new at each start: a worker restarted under the same instance id (as a
    # supervisor does) beats with another, so whoever waits on the old process knows it is gone
    # even though the name is on the bus again. Empty: not said (older workers).
    incarnation: str = ""
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 16
    max_model_len: int = 0
    max_num_seqs: int = 0  # sequences its batch runs at once (0: not said); the router's admission reads it
    draining: bool = False
    kv_namespace: str = ""  # blocks are comparable only within one (see tandem.shared.kvcache.cache)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    host_id: str = ""  # workers with equal host ids share /dev/shm (tandem.shared.kvtransfer.ring.host_id)
    kv_ring: str = ""  # a decode worker's shared-memory ring for KV hand-offs on this host
    # The accelerator it computes on, as an id unique across processes and hosts (a CUDA GPU's UUID;
    # an index is not: CUDA_VISIBLE_DEVICES renumbers). Equal ids share the device, so the router does
    # not hand a decode worker's prompts to a prefill worker there. Empty: not said (CPU, older workers).
    device: str = ""
    kv_transfers_ring: int = 0  # hand-offs received through the ring ...
    kv_transfers_nats: int = 0  # ... and as NATS frames
    pending_decode: list[str] = Field(default_factory=list)  # prefill: decode workers it still owes a hand-off
    # prefill: requests it holds (prefilling or handing off) per decode worker they go to, which the
    # router counts against that worker until they arrive there
    owed_requests: dict[str, int] = Field(default_factory=dict)
    # LoRA: slots on the device (0: serves no adapters), the highest rank a slot holds, and the
    # adapters (name@version) in its slots and in its host memory, which the router places by.
    max_loras: int = 0
    max_lora_rank: int = 0
    adapters_resident: list[str] = Field(default_factory=list, max_length=1024)
    adapters_host: list[str] = Field(default_factory=list, max_length=1024)


class RouteCandidate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    instance_id: str
    cached_blocks: int
    load: int
    cost: float


class RoutingDecision(WireMessage):
    """What the router decided for one request and why, published for the console."""

    kind: Literal["routing_decision"] = "routing_decision"
    request_id: str
    prompt_tokens: int
    prompt_blocks: int
    candidates: list[RouteCandidate]
    decode_worker: str
    prefill_worker: str | None
    reason: str


class HistogramSnapshot(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    bounds: list[float]  # bucket upper bounds, increasing (the +Inf bucket is implied)
    counts: list[int]  # per bucket, not cumulative; len(bounds) + 1 (last: above every bound)
    sum: float
    count: int


class MetricsSnapshot(WireMessage):
    """One service instance's metrics, published every few seconds (the Prometheus figures, by name)."""

    kind: Literal["metrics"] = "metrics"
    service: str
    instance_id: str
    host: str
    time: float  # unix seconds
    counters: dict[str, float] = Field(default_factory=dict)
    gauges: dict[str, float] = Field(default_factory=dict)
    histograms: dict[str, HistogramSnapshot] = Field(default_factory=dict)


class ScalingDecision(WireMessage):
    """What the planner wants and why; the supervisor carries it out within its limits."""

    kind: Literal["scaling_decision"] = "scaling_decision"
    time: float
    prefill_current: int
    decode_current: int
    prefill_wanted: int
    decode_wanted: int
    reason: str  # one line for a human
    inputs: dict[str, float] = Field(default_factory=dict)  # the load figures it decided on


class ScaleRequest(WireMessage):
    """An operator asks for worker counts (the console's confirmed action); the planner's limits hold."""

    kind: Literal["scale_request"] = "scale_request"
    prefill: int | None = Field(None, ge=0)
    decode: int | None = Field(None, ge=0)
    reason: str = ""


class DrainRequest(WireMessage):
    """Stop taking new requests, finish the ones held, then exit (or stay idle when ``exit`` is false)."""

    kind: Literal["drain"] = "drain"
    exit: bool = True
