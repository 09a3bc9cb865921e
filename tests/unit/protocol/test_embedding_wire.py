"""The embedding messages on the wire: float32 little-endian vectors, msgpack round trips, bounds."""

from __future__ import annotations

import base64
import struct

import msgpack
import pytest
from pydantic import ValidationError

from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.embedding import (
    EmbeddingResult,
    EmbedRequest,
    EmbedWork,
    PoolingParams,
    vector_bytes,
    vector_of,
)

VALUES = [0.5, -1.25, 3.0e-8, 1.0e30, 0.0]


def test_a_vector_is_little_endian_float32_as_openais_client_reads_base64() -> None:
    data = vector_bytes(VALUES)
    assert data == struct.pack(f"<{len(VALUES)}f", *VALUES)
    # What OpenAI's python client does with a base64 embedding when numpy is absent.
    decoded = struct.unpack(f"<{len(VALUES)}f", base64.b64decode(base64.b64encode(data)))
    assert list(vector_of(data)) == list(decoded)
    assert list(vector_of(data)) == pytest.approx(VALUES, rel=1e-7)


def test_a_byte_count_no_vector_has_is_refused() -> None:
    with pytest.raises(ValueError, match="no whole number of float32"):
        vector_of(b"\x00" * 6)


@pytest.mark.parametrize("message", [
    EmbedRequest(request_id="r", prompt="hello", pooling=PoolingParams(method="mean", dimensions=4),
                 stream_subject="_INBOX.k.c.r", truncate_prompt_tokens=-1, priority=-3),
    EmbedRequest(request_id="r", prompt_token_ids=[1, 2, 3], stream_subject="_INBOX.k.c.r"),
    EmbedWork(request_id="r", prompt_token_ids=[1, 2], pooling=PoolingParams(method="last"),
              stream_subject="_INBOX.k.c.r", model="tiny", arrival_time=1.5),
    EmbeddingResult(request_id="r", embedding=vector_bytes(VALUES), num_prompt_tokens=3, pooling="mean"),
], ids=["request-text", "request-token-ids", "work", "result"])
def test_each_message_survives_the_codec(message) -> None:
    assert decode(encode(message), type(message)) == message


def test_the_vector_travels_as_bytes_not_a_list_of_floats() -> None:
    result = EmbeddingResult(request_id="r", embedding=vector_bytes([0.1] * 4096), num_prompt_tokens=1, pooling="last")
    assert len(encode(result)) < 4096 * 4 + 100


@pytest.mark.parametrize(("fields", "where"), [
    (dict(pooling={"method": "cls"}), "pooling.method"),
    (dict(pooling={"dimensions": 0}), "pooling.dimensions"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
    (dict(priority=101), "priority"),
], ids=["unknown-method", "zero-dimensions", "zero-truncation", "negative-token", "priority"])
def test_out_of_bounds_values_are_refused_naming_the_field(fields: dict, where: str) -> None:
    base = {"request_id": "r", "prompt": "x", "stream_subject": "_INBOX.k.c.r", **fields}
    if "prompt_token_ids" in fields:
        base.pop("prompt")
    with pytest.raises(ValidationError) as refused:
        EmbedRequest(**base)
    assert ".".join(str(p) for p in refused.value.errors()[0]["loc"]).startswith(where)


def test_work_needs_its_pooling_resolved() -> None:
    """A worker never guesses a model's default: an EmbedWork without a method is an invalid request."""
    raw = {"v": 3, "kind": "embed_work", "request_id": "r", "prompt_token_ids": [1], "pooling": {"method": None},
           "stream_subject": "_INBOX.k.c.r", "model": "tiny"}
    with pytest.raises(ProtocolError, match="must be resolved") as refused:
        decode(msgpack.packb(raw), EmbedWork)
    assert refused.value.code is ErrorCode.INVALID_REQUEST


def test_garbage_on_the_embed_subjects_is_a_typed_refusal() -> None:
    with pytest.raises(ProtocolError) as refused:
        decode(encode(EmbedRequest(request_id="r", prompt="x", stream_subject="_INBOX.k.c.r")), EmbedWork)
    assert refused.value.code is ErrorCode.BAD_SCHEMA
