"""Every bound the HTTP edge checks, and the checks: what one HTTP request may ask before any bus work.

- the body's size (``--http-max-body-mib``): :class:`BodyLimit`, a pure ASGI middleware, answers 413
  before the body is read whole (at once for a declared Content-Length over the bound, else as soon
  as the bytes received pass it);
- prompts per request (``--http-max-prompts``): each prompt is one request on the bus;
- choices per request (``--http-max-choices``): prompts times each prompt's candidates (its ``n``,
  or ``best_of`` / the beam width where larger), since each candidate holds a sequence on a decode
  worker;
- requests in flight (``--max-concurrent-requests``, counting each prompt, one request on the bus
  each): 429;
- stop strings, stop token ids and logit-bias entries: the bus's own bounds
  (:mod:`tandem.shared.protocol.serving`), checked here first so that an over-long list is a 400
  naming its field, not a long validation of every entry.

What no HTTP bound covers, a request too big for one bus message (the server's ``max_payload``),
the client library refuses before publishing it (``RequestTooLargeError``), and
:func:`tandem.services.frontend.errors.from_tandem` answers it with 413.

Each refusal is OpenAI's error object with one line naming what to change and the flag that sets
the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

from tandem.services.frontend import schemas
from tandem.services.frontend.errors import APIError, bad_request
from tandem.shared.infra.config import FrontendSettings, knob_at
from tandem.shared.protocol.serving import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MIB = 1024 * 1024
# After a 413, what is left of the body is read and thrown away, up to these bounds, before the
# connection closes: a client still writing its body (as most do before they read an answer) would
# otherwise meet a connection reset, not the 413, since closing a socket with unread bytes resets it.
DISCARD_MAX_BYTES = 64 * MIB
DISCARD_MAX_S = 5.0


def flag(name: str) -> str:
    """The command-line flag of a front-end setting (``max_prompts`` -> ``--http-max-prompts``)."""
    knob = knob_at(("frontend", name))
    assert knob is not None, f"no front-end setting {name!r}"
    return knob.flag


@dataclass(frozen=True)
class HTTPLimits:
    """The bounds of one HTTP request (the front end's settings; the defaults are theirs)."""

    max_prompts: int = field(default_factory=lambda: FrontendSettings().max_prompts)
    max_choices: int = field(default_factory=lambda: FrontendSettings().max_choices)
    max_body_bytes: int = field(default_factory=lambda: round(FrontendSettings().max_body_mib * MIB))

    @classmethod
    def of(cls, settings: FrontendSettings) -> HTTPLimits:
        return cls(settings.max_prompts, settings.max_choices, round(settings.max_body_mib * MIB))

    def check(self, request: schemas.SamplingFields, prompts: int) -> None:
        """A 400 for the first bound ``request`` (with ``prompts`` prompts) is over; before any bus work."""
        if prompts > self.max_prompts:
            raise bad_request(f"prompt: {prompts:,} prompts in one request; at most {self.max_prompts:,} "
                              f"({flag('max_prompts')}): split the request", "prompt", "too_many_prompts")
        self.check_choices(request, prompts)
        check_lists(request)

    def check_choices(self, request: schemas.SamplingFields, prompts: int) -> None:
        n = request.n if request.n is not None else 1
        best_of = request.best_of if request.best_of is not None else 1
        candidates = max(n, best_of)  # a beam search's width is best_of, else n
        if prompts * candidates <= self.max_choices:
            return
        field_name = "best_of" if best_of > n else "n"
        shown = f"{prompts:,} prompts x " if prompts > 1 else ""
        fewer = f"send fewer prompts or a smaller {field_name}" if prompts > 1 else f"ask for a smaller {field_name}"
        raise bad_request(f"{field_name}: {shown}{candidates:,} candidates = {prompts * candidates:,} sequences in one "
                          f"request; at most {self.max_choices:,} ({flag('max_choices')}): {fewer}", field_name,
                          "too_many_choices")

    def body_too_large(self, size: int | None) -> APIError:
        """The 413 for a body of ``size`` bytes (None: its length was not declared, only passed the bound)."""
        bound = f"{self.max_body_bytes:,} bytes ({self.max_body_bytes / MIB:g} MiB, {flag('max_body_mib')})"
        said = f"is {size:,} bytes; at most {bound}" if size is not None else f"is over {bound}"
        return APIError(413, f"the request body {said}: send less in one request", "invalid_request_error", None,
                        "request_too_large")


def check_lists(request: schemas.SamplingFields) -> None:
    """A 400 for a stop list, stop-token list or logit-bias map over the bus's bound, naming it."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: {len(stop):,} stop strings; at most {MAX_STOP_STRINGS}: send fewer", "stop")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise bad_request(f"stop: a stop string of {longest:,} characters; at most {MAX_STOP_STRING_CHARS}: "
                          "shorten it", "stop")
    stop_ids = len(request.stop_token_ids or ())
    if stop_ids > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids: {stop_ids:,} token ids; at most {MAX_STOP_TOKEN_IDS}: send fewer",
                          "stop_token_ids")
    biased = len(request.logit_bias or ())
    if biased > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: {biased:,} entries; at most {MAX_LOGIT_BIAS}: bias fewer tokens", "logit_bias")


def check_in_flight(running: int, asked: int, max_concurrent_requests: int) -> None:
    """A 429 when ``asked`` more bus requests would take the front end past its most at once
    (``running`` now); an idle front end takes any one HTTP request, whatever its prompts."""
    if running and running + asked > max_concurrent_requests:
        raise APIError(429, f"too many requests in flight ({max_concurrent_requests}, "
                            f"{flag('max_concurrent_requests')}); retry shortly",
                       "rate_limit_error", None, "too_many_requests")


class BodyTooLarge(Exception):
    """Raised into the app by :class:`BodyLimit`'s ``receive`` once the body passed its bound."""


class BodyLimit:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would copy every SSE event through a memory
    channel): a request body over ``limits.max_body_bytes`` gets a 413 before it is read whole.

    A declared Content-Length over the bound is answered at once, before any byte of the body is
    read. Otherwise (chunked, or a Content-Length the server does not hold the client to) the bytes
    are counted as the app reads them; the read that passes the bound raises into the app, whose
    answer is dropped for the 413. What is left of the body is then thrown away, never buffered
    (see ``DISCARD_MAX_BYTES``), except when the client waits for ``100 Continue``: it has sent none."""

    def __init__(self, app, limits: HTTPLimits) -> None:  # noqa: ANN001 - any ASGI app
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = declared_length(headers)
        waits_to_send = headers.get(b"expect", b"").lower() == b"100-continue"
        if declared is not None and declared > self.limits.max_body_bytes:
            await refuse(send, self.limits.body_too_large(declared), None if waits_to_send else receive)
            return
        received = 0
        over = False
        body_left = True
        answered = False  # the app's answer has begun: too late for ours

        async def counted_receive() -> dict:
            nonlocal received, over, body_left
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_left = bool(message.get("more_body", False))
                if received > self.limits.max_body_bytes and not answered:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal answered
            if over:
                return  # the app's answer to a body it could not read: the 413 goes instead
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except BodyTooLarge:
            pass
        except Exception:
            if not over:
                raise
        if over:
            await refuse(send, self.limits.body_too_large(None), receive if body_left else None)


async def refuse(send, error: APIError, discard_from) -> None:  # noqa: ANN001 - ASGI callables
    """Answer ``error`` before the app reads the body: send it whole, then (``discard_from``: the
    request's ``receive``) read what is left of the body and drop it, then end the answer; the
    connection closes after it."""
    body = json.dumps(error.body.model_dump()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    if discard_from is not None:
        await discard(discard_from)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def discard(receive) -> None:  # noqa: ANN001 - an ASGI receive
    """Read the rest of a request body and drop it, within ``DISCARD_MAX_BYTES`` and ``DISCARD_MAX_S``."""
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DISCARD_MAX_S):
            while dropped < DISCARD_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


def declared_length(headers: dict[bytes, bytes]) -> int | None:
    """The body's Content-Length, or None where none (or no number) is declared."""
    value = headers.get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
