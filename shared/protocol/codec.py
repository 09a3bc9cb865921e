"""Encoding and decoding bus messages: msgpack of a model's Python-mode dump (``bytes`` stay bytes).

:func:`decode` turns every way a payload can be wrong into a :class:`ProtocolError` carrying an
:class:`ErrorCode`; :func:`error_reply` is the reply for an exception raised while handling one.
"""

from __future__ import annotations

from typing import Annotated

import msgpack
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from tandem.shared.protocol.adapters import AdapterRecord, LoadAdapter, UnloadAdapter
from tandem.shared.protocol.base import (
    SCHEMA_VERSION,
    Ack,
    ErrorCode,
    ErrorReply,
    ProtocolError,
    first_error,
    shortened,
)
from tandem.shared.protocol.embedding import EmbeddingResult, EmbedRequest, EmbedWork
from tandem.shared.protocol.fleet import (
    DrainRequest,
    Heartbeat,
    MetricsSnapshot,
    RoutingDecision,
    ScaleRequest,
    ScalingDecision,
)
from tandem.shared.protocol.kv import (
    KVEvent,
    KVGetReply,
    KVGetRequest,
    KVLookupReply,
    KVLookupRequest,
    KVPutReply,
    KVPutRequest,
)
from tandem.shared.protocol.serving import (
    Cancel,
    DecodeRequest,
    GenerateAccepted,
    GenerateRequest,
    PlacementReceived,
    PrefillRequest,
    Probe,
    StreamChunk,
)
from tandem.shared.protocol.training import (
    TrainStart,
    TrainStatusReply,
    TrainStatusRequest,
    TrainStepMetrics,
    TrainStop,
    TrainTimeline,
    WeightsUpdated,
)
from tandem.shared.protocol.views import BlockSnapshot, KVTransferEvent

Message = Annotated[
    GenerateRequest | GenerateAccepted | ErrorReply | Ack | PrefillRequest | DecodeRequest
    | StreamChunk | Probe | Cancel | Heartbeat | KVEvent | RoutingDecision
    | KVLookupRequest | KVLookupReply | KVGetRequest | KVGetReply | KVPutRequest | KVPutReply
    | TrainStart | TrainStop | TrainStatusRequest | TrainStatusReply | TrainStepMetrics | TrainTimeline
    | WeightsUpdated | MetricsSnapshot | ScalingDecision | ScaleRequest | DrainRequest | BlockSnapshot
    | KVTransferEvent | PlacementReceived | EmbedRequest | EmbedWork | EmbeddingResult
    | AdapterRecord | LoadAdapter | UnloadAdapter,
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
            ErrorCode.UNSUPPORTED_VERSION,
            f"schema version {shortened(repr(raw.get('v')), 40)} is not supported (want {SCHEMA_VERSION})"
        )
    try:
        message = _adapter.validate_python(raw)
    except ValidationError as exc:
        kind = exc.errors()[0]["type"]
        # A field out of its bounds is a bad request; a missing, extra or mistyped field is bad schema.
        shape_error = kind.endswith("_type") or kind in _SHAPE_ERRORS
        code = ErrorCode.BAD_SCHEMA if shape_error else ErrorCode.INVALID_REQUEST
        raise ProtocolError(code, first_error(exc)) from None
    if expect is not None and not isinstance(message, expect):
        raise ProtocolError(ErrorCode.BAD_SCHEMA, f"unexpected message kind {shortened(repr(message.kind), 60)} here")
    return message


def error_reply(exc: Exception, request_id: str | None = None) -> ErrorReply:
    """The reply for an exception raised while handling a message."""
    if isinstance(exc, ProtocolError):
        return ErrorReply(code=exc.code, message=shortened(exc.message), request_id=shortened(request_id or "", 128)
                          or None, param=exc.param)
    return ErrorReply(code=ErrorCode.WORKER_FAILURE, message=shortened(f"{type(exc).__name__}: {exc}"),
                      request_id=shortened(request_id or "", 128) or None)
