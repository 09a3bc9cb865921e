"""The client's typed errors: every failure a caller sees is a :class:`TandemError`, chosen from
the bus's :class:`ErrorCode`; nats-py's own errors never reach the caller."""

from __future__ import annotations

from pydantic import ValidationError

from tandem.shared.protocol.base import ErrorCode, ErrorReply, first_error
from tandem.shared.protocol.serving import (
    SamplingParams,
)


class TandemError(Exception):
    """Base of every error the client raises."""

    code = ErrorCode.WORKER_FAILURE

    def __init__(self, message: str, request_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.param = param  # the request field at fault, when the error names one ("max_tokens", "prompt")


class NoWorkersError(TandemError):
    code = ErrorCode.NO_WORKERS


class RequestTimeoutError(TandemError):
    code = ErrorCode.TIMEOUT


class InvalidRequestError(TandemError):
    code = ErrorCode.INVALID_REQUEST


class UnknownModelError(InvalidRequestError):
    code = ErrorCode.UNKNOWN_MODEL


class PromptTooLongError(InvalidRequestError):
    code = ErrorCode.PROMPT_TOO_LONG


class RequestTooLargeError(InvalidRequestError):
    """The request does not fit in one bus message (the server's ``max_payload``): refused before it
    is sent, so the connection is untouched. Send a shorter prompt (or its token ids)."""

    code = ErrorCode.REQUEST_TOO_LARGE


class WorkerFailureError(TandemError):
    code = ErrorCode.WORKER_FAILURE


class ShuttingDownError(WorkerFailureError):
    """The worker holding the request stopped before it finished (its shutdown timeout ran out)
    and no other worker could take it on: the deployment is stopping."""

    code = ErrorCode.SHUTTING_DOWN


class OverloadedError(TandemError):
    """Every decode worker is busy and the router's admission queue is full, or the request waited
    there its longest (``--router-max-queue-wait-s``): refused at once, so retry later."""

    code = ErrorCode.OVERLOADED


class ConnectionLostError(TandemError):
    """The NATS connection dropped and did not come back within ``reconnect_s`` (a stopping
    ``tandem up``, a server gone for good)."""

    code = ErrorCode.NO_WORKERS


_BY_CODE: dict[ErrorCode, type[TandemError]] = {
    ErrorCode.NO_WORKERS: NoWorkersError,
    ErrorCode.TIMEOUT: RequestTimeoutError,
    ErrorCode.UNKNOWN_MODEL: UnknownModelError,
    ErrorCode.PROMPT_TOO_LONG: PromptTooLongError,
    ErrorCode.INVALID_REQUEST: InvalidRequestError,
    ErrorCode.BAD_SCHEMA: InvalidRequestError,
    ErrorCode.BAD_FRAME: InvalidRequestError,
    ErrorCode.UNSUPPORTED_VERSION: InvalidRequestError,
    ErrorCode.WORKER_FAILURE: WorkerFailureError,
    ErrorCode.OVERLOADED: OverloadedError,
    ErrorCode.SHUTTING_DOWN: ShuttingDownError,
    ErrorCode.REQUEST_TOO_LARGE: RequestTooLargeError,
}


def first_error_text(exc: Exception) -> str:
    """``field: what is wrong`` for a pydantic error (its first one), else the exception's text."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    if not exc.errors()[0]["loc"]:  # a check across fields: its message names them itself
        return exc.errors()[0]["msg"].removeprefix("Value error, ")
    return first_error(exc)


def error_field(exc: Exception) -> str | None:
    """The request field a pydantic error's first finding is about: where it was found, or for a
    check across fields (``best_of (2) must be at least n (3)``) the field its message begins with,
    as :class:`SamplingParams`' cross-field checks name the field at fault first."""
    if not isinstance(exc, ValidationError) or not exc.errors():
        return None
    first = exc.errors()[0]
    if first["loc"]:
        return str(first["loc"][0])
    words = first["msg"].removeprefix("Value error, ").split()
    return words[0] if words and words[0] in SamplingParams.model_fields else None


def error_from_reply(reply: ErrorReply) -> TandemError:
    return _BY_CODE.get(reply.code, TandemError)(f"{reply.code.value}: {reply.message}", reply.request_id,
                                                 reply.param)
