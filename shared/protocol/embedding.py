"""Embedding requests and their vectors: client to router to a decode worker, and the vector back.

An embedding is the served model's final hidden states (the final norm's output, what feeds the LM
head) over the prompt, pooled (``last``: the last token's row; ``mean``: the mean of every row) and
L2-normalised; with ``dimensions`` only the first N components are kept and normalised again
(Matryoshka-style truncation). The client sends an :class:`EmbedRequest` to
``tandem.v1.router.embed.<owner>``; the router tokenizes it, resolves the model's default pooling,
places it as it places generation (admission queue included) and sends :class:`EmbedWork` to the
decode worker's ``embed`` subject; that worker prefills the prompt in its running batch and
publishes one :class:`EmbeddingResult` on the request's stream subject (an error comes as a
:class:`~tandem.shared.protocol.serving.StreamChunk` with its ``error``, as for generation).

The vector travels as little-endian float32 bytes (:func:`vector_bytes`, :func:`vector_of`): a
tenth of what a msgpack list of floats costs, and what OpenAI's base64 encoding is made of.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.shared.protocol.base import WireMessage
from tandem.shared.protocol.serving import (
    INT32_MAX,
    MAX_PRIORITY,
    MIN_PRIORITY,
    InstanceName,
    RequestId,
    StreamSubject,
    TokenId,
)

PoolingMethod = Literal["last", "mean"]
POOLING_METHODS: tuple[str, ...] = ("last", "mean")
FLOAT32_BYTES = 4


class PoolingParams(BaseModel):
    """How one input's hidden states become its vector: the one definition, on the bus and in the engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: PoolingMethod | None = None  # None: the served model's default (the router resolves it)
    # Keep the first N components, then normalise again; None: all of them (the model's hidden size).
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)


class EmbedRequest(WireMessage):
    """Client to router: embed one input. Exactly one of ``prompt`` and ``prompt_token_ids``."""

    kind: Literal["embed"] = "embed"
    request_id: RequestId
    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    pooling: PoolingParams = Field(default_factory=PoolingParams)
    model: str | None = None
    stream_subject: StreamSubject
    # vLLM's field: keep only the prompt's last N tokens (-1: as many as the context holds).
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | Literal[-1] | None = None
    exclude_workers: list[InstanceName] = Field(default_factory=list, max_length=32)  # as GenerateRequest's
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    ack_placement: bool = False


class EmbedWork(WireMessage):
    """Router to a decode worker: prefill ``prompt_token_ids`` and publish their pooled vector on
    ``stream_subject``. The pooling method is resolved (the model's default applied)."""

    kind: Literal["embed_work"] = "embed_work"
    request_id: RequestId
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    pooling: PoolingParams
    stream_subject: StreamSubject
    model: str
    arrival_time: float = Field(0.0, ge=0.0, allow_inf_nan=False)  # unix time the router accepted it

    @model_validator(mode="after")
    def _resolved(self) -> EmbedWork:
        if self.pooling.method is None:
            raise ValueError("pooling.method must be resolved (the router applies the model's default)")
        return self


class EmbeddingResult(WireMessage):
    """Worker to client stream: the request's vector, unit L2 norm, as little-endian float32 bytes."""

    kind: Literal["embedding"] = "embedding"
    request_id: str
    embedding: bytes
    num_prompt_tokens: int = Field(ge=1)
    pooling: PoolingMethod


def vector_bytes(values: Iterable[float]) -> bytes:
    """``values`` as little-endian float32 bytes (the wire's and OpenAI's base64 layout)."""
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def vector_of(data: bytes) -> array:
    """The float32 ``array('f')`` that :func:`vector_bytes` made; ``ValueError`` for a length no vector has."""
    if len(data) % FLOAT32_BYTES:
        raise ValueError(f"an embedding of {len(data)} bytes is no whole number of float32 values")
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values
