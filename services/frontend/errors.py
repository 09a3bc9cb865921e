"""Errors as the OpenAI API returns them: an HTTP status and ``{"error": {message, type, param, code}}``.

Every failure a request can meet ends here as one :class:`APIError`: a body that does not parse or
is no JSON object (400), one not sent as JSON (415), a value out of its bounds (400, naming the field
and the bound), a missing key (401), an unknown model or route (404), a wrong method (405), a body or
bus message too large (413), too many requests at once or the router's queue full (429), no worker
(503), and the client library's typed errors from the bus. A handler never lets anything else out,
so a client never sees a stack trace. The bounds themselves: :mod:`tandem.services.frontend.limits`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tandem.client import (
    ConnectionLostError,
    InvalidRequestError,
    NoWorkersError,
    OverloadedError,
    PromptTooLongError,
    RequestTimeoutError,
    RequestTooLargeError,
    ShuttingDownError,
    TandemError,
    UnknownModelError,
    error_field,
)
from tandem.services.frontend.schemas import ErrorBody, ErrorResponse
from tandem.shared.protocol.base import shortened

SEND_AN_OBJECT = "send a JSON object with the request's fields"
JSON_TYPES = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean", int: "a JSON number",
              float: "a JSON number", type(None): "null"}


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
    """The 404 for a ``model`` this server does not serve, naming the name(s) to send instead."""
    others = "".join(f" (or {name!r})" for name in served[1:])
    return APIError(404, f"the model {shortened(repr(model), 200)} does not exist here: send model={served[0]!r}"
                         f"{others}, or leave it out", "invalid_request_error", "model", "model_not_found")


def from_body_errors(errors: list[dict[str, Any]], content_type: str | None) -> APIError:
    """The answer to a body the request's model refused (FastAPI's ``RequestValidationError``): 415
    for one not sent as JSON, 400 for an empty one, one that is not JSON, one that is JSON but no
    object, and otherwise ``field: what is wrong`` for its first finding."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type")
    if kind == "json_invalid":
        where = first.get("loc", ())[-1] if len(first.get("loc", ())) > 1 else None
        at = f" at character {where}" if isinstance(where, int) else ""
        reason = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return bad_request(f"the body is not valid JSON ({reason}{at}): {SEND_AN_OBJECT}", None, "invalid_json")
    if not loc and kind == "missing":
        return bad_request(f"the body is empty: {SEND_AN_OBJECT}", None, "invalid_json")
    if not loc and isinstance(first.get("input"), bytes | bytearray):  # FastAPI parses JSON only when it is said to be
        # JSON under another type is refused, not parsed: a web page can make a browser POST a
        # text/plain or form body to a local server without asking it first (no CORS preflight).
        got = f"Content-Type: {shortened(content_type, 100)}" if content_type else "no Content-Type"
        return APIError(415, f"the body must be JSON sent with Content-Type: application/json (got {got})",
                        "invalid_request_error", None, "unsupported_media_type")
    if not loc and kind in ("model_attributes_type", "dict_type"):
        got = JSON_TYPES.get(type(first.get("input")), "no object")
        return bad_request(f"the body must be a JSON object with the request's fields (got {got})", None,
                           "invalid_json")
    where = loc[0] if loc else ""  # the request's own field; deeper parts name pydantic's union branches
    message = first.get("msg", "invalid request body")
    return bad_request(f"{where}: {message}" if where else message, where or None)


def from_http_status(status: int, detail: str, method: str, path: str, routes: tuple[str, ...],
                     allowed: str | None = None) -> APIError:
    """OpenAI's error object for Starlette's own answers: an unknown route (404; ``routes``: the
    ones served), a method the route does not take (405; ``allowed``: its ``Allow`` header), or
    another HTTP error with its detail."""
    route = shortened(f"{method} {path}", 200)
    if status == 404:
        return APIError(404, f"{route}: no such route; this server serves {', '.join(routes)}",
                        "invalid_request_error", None, "not_found")
    if status == 405:
        use = f"; use {allowed}" if allowed else ""
        return APIError(405, f"{route}: method not allowed{use}", "invalid_request_error", None,
                        "method_not_allowed")
    if status == 400:  # FastAPI's answer to a body its JSON parser gave up on (nested too deep, ...)
        return bad_request(f"the body could not be parsed as JSON: {SEND_AN_OBJECT}", None, "invalid_json")
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return APIError(status, shortened(f"{route}: {detail}"), kind, None, None)


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
    if isinstance(exc, RequestTooLargeError):  # over one bus message: the request's own fault, the bus untouched
        return APIError(413, message, "invalid_request_error", param, exc.code.value)
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
