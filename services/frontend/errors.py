"""Errors as the OpenAI API returns them: an HTTP status and ``{"error": {message, type, param, code}}``.

Every failure a request can meet ends here as one :class:`APIError`: a body that does not parse, a
value out of its bounds (400, naming the field and the bound), a missing key (401), an unknown model
(404), too many requests at once or the router's queue full (429), no worker (503), and the client
library's typed errors from the bus. A handler never lets anything else out, so a client never sees a stack trace.
"""

from __future__ import annotations

from pydantic import ValidationError

from tandem.client import (
    ConnectionLostError,
    InvalidRequestError,
    NoWorkersError,
    OverloadedError,
    PromptTooLongError,
    RequestTimeoutError,
    ShuttingDownError,
    TandemError,
    UnknownModelError,
    error_field,
)
from tandem.services.frontend.schemas import ErrorBody, ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))

    @property
    def message(self) -> str:
        return self.body.error.message


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_supported(field: str) -> APIError:
    return bad_request(f"{field} is not supported yet: tandem's engine has no {field} (leave it out)", field,
                       "unsupported_parameter")


def unknown_model(model: str, served: list[str]) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                    "invalid_request_error", "model", "model_not_found")


def from_validation(exc: ValidationError, names: dict[str, str] | None = None) -> APIError:
    """A 400 for a pydantic error's first finding: ``field: what is wrong`` (the bound included).
    ``names`` maps a model's field to the request's (``max_tokens`` may be ``max_completion_tokens``).
    A check across fields (``best_of (2) must be at least n (3)``) keeps its words, its ``param``
    the field it names first."""
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"] if part != "body"]
    if not loc:
        field = error_field(exc)
        return bad_request(first["msg"].removeprefix("Value error, "), (names or {}).get(field, field))
    loc[0] = (names or {}).get(loc[0], loc[0])
    return bad_request(f"{'.'.join(loc)}: {first['msg']}", loc[0])  # param: the request's own field


def from_tandem(exc: TandemError, param: str | None = None) -> APIError:
    """The HTTP form of a bus-side failure. ``param``: the field at fault when the error names one."""
    message = str(exc)
    if isinstance(exc, UnknownModelError):
        return APIError(404, message, "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, PromptTooLongError) or (isinstance(exc, InvalidRequestError) and param == "max_tokens"):
        return APIError(400, message, "invalid_request_error", param, "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return bad_request(message, param)
    if isinstance(exc, OverloadedError):  # OpenAI's answer to load it cannot take: retry later
        return APIError(429, message, "rate_limit_error", None, exc.code.value)
    if isinstance(exc, NoWorkersError | ConnectionLostError | ShuttingDownError):  # nothing serves: retry later
        return APIError(503, message, "service_unavailable_error", None, exc.code.value)
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, message, "timeout_error", None, exc.code.value)
    return APIError(500, message, "server_error", None, exc.code.value)  # a worker failed, or worse
