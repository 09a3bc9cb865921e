"""Requests and their token streams: client to router to prefill to decode, and back to the client."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.shared.protocol.base import ErrorReply, WireMessage
from tandem.shared.protocol.kv import KVTransfer, RingSlots


MAX_STOP_STRINGS = 16


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


class GenerateRequest(WireMessage):
    """Client to router. Exactly one of ``prompt`` and ``prompt_token_ids``."""

    kind: Literal["generate"] = "generate"
    request_id: str = Field(min_length=1, max_length=128)
    prompt: str | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    stream_subject: str = Field(min_length=1)


class GenerateAccepted(WireMessage):
    """Router to client: the request is placed; tokens follow on the stream subject."""

    kind: Literal["accepted"] = "accepted"
    request_id: str
    prompt_token_ids: list[int]
    prefill_worker: str | None
    decode_worker: str


class PrefillRequest(WireMessage):
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


class DecodeRequest(WireMessage):
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


class StreamChunk(WireMessage):
    """Worker to client: output tokens ``index .. index+len(token_ids)-1`` and their text."""

    kind: Literal["chunk"] = "chunk"
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: ErrorReply | None = None


class Probe(WireMessage):
    """Worker to client stream, with a reply subject: is anybody still listening?"""

    kind: Literal["probe"] = "probe"
    request_id: str


class Cancel(WireMessage):
    kind: Literal["cancel"] = "cancel"
    request_id: str
