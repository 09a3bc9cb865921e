"""What every bus message shares: the schema version, the error codes and the error reply.

Every message is a frozen pydantic model with a ``kind`` discriminator and a schema version ``v``;
:mod:`tandem.shared.protocol.codec` encodes and decodes them. A service replies to a message it cannot
accept with :class:`ErrorReply` and keeps running.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

SCHEMA_VERSION = 3  # 2: PrefillRequest and DecodeRequest carry the RequestSpec whole; 3: several outputs per
# request (n, best_of, beam search), penalties and logit bias, prompt logprobs


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
    OVERLOADED = "overloaded"  # every decode worker is saturated and the router's queue is full (or waited too long)
    SHUTTING_DOWN = "shutting_down"  # the worker holding it stopped before it finished (its shutdown timeout ran out)
    REQUEST_TOO_LARGE = "request_too_large"  # over a size bound (the bus's max payload, the front end's body size)


class ProtocolError(Exception):
    """A message could not be accepted; ``code`` says why in a form clients can branch on."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.param = param  # the request field at fault, when one is (OpenAI's error ``param``)


class WireMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[3] = SCHEMA_VERSION


class ErrorReply(WireMessage):
    kind: Literal["error"] = "error"
    code: ErrorCode
    message: str
    request_id: str | None = None
    param: str | None = None  # the request field at fault: "max_tokens", "prompt", "model"


class Ack(WireMessage):
    kind: Literal["ack"] = "ack"
    request_id: str | None = None
    incarnation: str = ""  # the process that took the work (its Heartbeat.incarnation); empty: not said


MAX_ERROR_CHARS = 500  # an error quotes the bad input: never all of it (an 8 MiB value made an unsendable reply)


def shortened(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text``, cut to ``limit`` characters with a mark saying how much was left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def first_error(exc: ValidationError) -> str:
    """``field.path: what is wrong`` for a validation error's first finding: the one line a typed
    error carries, the bad value's quotation cut short."""
    first = exc.errors()[0]
    return shortened(f"{'.'.join(shortened(str(part), 100) for part in first['loc'])}: {first['msg']}")
