"""The OpenAI-compatible HTTP API (FastAPI): routes, authentication, admission, and SSE streams.

Each generation request becomes one bus request per prompt through :mod:`tandem.client`, exactly as a
library user's would: the router tokenizes and places it, the workers stream its tokens. A prompt's
``n`` outputs come on its one bus request; choice ``p * n + i`` is prompt ``p``'s output ``i`` (as
vLLM numbers them), streamed or not. A request is
placed before its HTTP answer starts, so every refusal (a bad value, an unknown model, no workers)
comes back with its status code and OpenAI's error body, never as a broken stream. Every bound a
request meets here (its body's size, its prompts, its choices, its lists, the requests in flight)
is checked by :mod:`.limits` before any bus work. A client that
disconnects cancels its requests on the workers: a stream's generator is cancelled by the server, a
non-streamed request's disconnect is watched for while it runs.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tandem.client import Client, RequestStream, TandemError
from tandem.services.frontend import schemas
from tandem.services.frontend.adapters import add_adapter_routes
from tandem.services.frontend.chat_answer import THINK_END, ChatAnswer, ChoiceStream
from tandem.services.frontend.embeddings import add_embeddings_route
from tandem.services.frontend.errors import (
    APIError,
    bad_request,
    from_body_errors,
    from_http_status,
    from_tandem,
    unknown_model,
)
from tandem.services.frontend.limits import BodyLimit, HTTPLimits, check_in_flight
from tandem.services.frontend.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from tandem.services.frontend.metrics import FrontendMetrics
from tandem.services.frontend.sampling import sampling_params
from tandem.shared.infra.adapter_registry import AdapterRegistry
from tandem.shared.infra.version import VERSION
from tandem.shared.text.chat_template import ChatTemplate, ChatTemplateError
from tandem.shared.text.tokenizer import HFTokenizer, Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is "what the context leaves"
DISCONNECT_POLL_S = 0.25
THREAD_RENDER_CHARS = 32768  # a longer conversation is rendered and tokenized off the event loop


@dataclass
class ServedModel:
    """The model behind the API: its name there, its name on the bus, and what chat needs."""

    served_name: str
    bus_name: str  # what the router serves (the ``model`` of a bus request)
    tokenizer: Tokenizer
    template: ChatTemplate | None
    template_error: str = ""  # why there is no template, for the 400 a chat request gets
    spec: str = ""  # the --model value as given (a directory's path): a client may send it as its name

    def names(self) -> list[str]:
        """What a request's ``model`` may be: the served name first, then the bus name (the --model
        value is taken too, but never shown: a path on the server is no client's business)."""
        return list(dict.fromkeys((self.served_name, self.bus_name)))

    def answers_to(self, model: str | None) -> bool:
        return not model or model in self.names() or (bool(self.spec) and model == self.spec)


@dataclass
class Frontend:
    """What the routes need: the bus client, the model, the settings, the figures."""

    client: Client
    model: ServedModel
    api_key: str | None
    max_concurrent_requests: int
    router_models: Callable[[], Awaitable[dict[str, int | None]]]  # the routers' models -> their vocab sizes
    max_model_len: Callable[[str], int | None]  # a bus model's context, from its decode workers' heartbeats
    router_alive: Callable[[], Awaitable[bool]]
    limits: HTTPLimits = field(default_factory=HTTPLimits)
    metrics: FrontendMetrics | None = None
    metrics_page: Callable[[], str] = lambda: ""
    running: int = 0
    log: object = None
    created: int = field(default_factory=schemas.now)
    adapters: AdapterRegistry | None = None  # the fleet's LoRA adapters (None: none served)
    allow_runtime_lora_updating: bool = False

    # -- request building -----------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The name the request goes to the bus with: the base model's, or the LoRA adapter's it
        names; a 404 naming what is served otherwise."""
        if self.model.answers_to(model):
            return self.model.bus_name
        if self.adapters is not None:
            record = self.adapters.lookup(model)
            if record is not None and record.base_model == self.model.bus_name:
                return record.name
        raise unknown_model(model, self.model.names() + self.adapter_names())

    def adapter_names(self) -> list[str]:
        return [] if self.adapters is None else [r.name for r in self.adapters.served(self.model.bus_name)]

    def shown_model(self, bus_model: str) -> str:
        """A response's ``model``: the served name for the base model, an adapter's own name."""
        return self.model.served_name if bus_model == self.model.bus_name else bus_model

    def chat_answer(self, request: schemas.ChatCompletionRequest) -> ChatAnswer:
        """What the request asks of its answer beyond text (tools, reasoning); a 400 for bad tools."""
        return ChatAnswer.plan(request, self.model.template, self.model.served_name, self.encode(THINK_END))

    def encode(self, text: str) -> list[int]:
        """Text as the model's tokens, no special tokens added (a template writes its own)."""
        tokenizer = self.model.tokenizer
        return tokenizer.encode(text, add_special_tokens=False) if isinstance(tokenizer, HFTokenizer) else \
            tokenizer.encode(text)

    async def chat_prompt(self, request: schemas.ChatCompletionRequest, answer: ChatAnswer) -> tuple[list[int], str]:
        """The conversation rendered by the model's chat template, as token ids and as text; a long
        one off the event loop, so the requests beside it never wait for it."""
        messages = request.template_messages()
        if sum(len(str(m.get("content") or "")) for m in messages) > THREAD_RENDER_CHARS:
            return await asyncio.to_thread(self.render_chat, request, messages, answer)
        return self.render_chat(request, messages, answer)

    def render_chat(self, request: schemas.ChatCompletionRequest, messages: list[dict],
                    answer: ChatAnswer) -> tuple[list[int], str]:
        if self.model.template is None:
            raise bad_request(self.model.template_error, "messages",
                              "no_chat_template")
        try:
            text = self.model.template.render(messages, add_generation_prompt=request.add_generation_prompt,
                                              **answer.template_variables(request))
        except ChatTemplateError as exc:
            raise bad_request(f"messages: {exc}", "messages") from None
        ids = self.encode(text)
        if not ids:
            raise bad_request("messages: the conversation renders to an empty prompt", "messages")
        return ids, text

    # -- running requests -----------------------------------------------------------------------
    def admit(self, prompts: int) -> None:
        """Take ``prompts`` more requests on the bus, or 429."""
        check_in_flight(self.running, prompts, self.max_concurrent_requests)
        self.running += prompts

    async def open_streams(self, prompts: list[str | list[int]], params: dict, chat: bool,
                           priority: int = 0, model: str | None = None) -> list[RequestStream]:
        """Place every prompt's request; if one is refused, cancel the others and raise its error
        (a chat request's prompt is its ``messages``)."""
        try:
            streams = [self.client.stream(p, model=model or self.model.bus_name, priority=priority, **params)
                       for p in prompts]
        except TandemError as exc:
            raise from_tandem(exc, exc.param) from None
        results = await asyncio.gather(*(s.__aenter__() for s in streams), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            for stream in streams:
                stream.close_nowait()
            if isinstance(failed, TandemError):
                param = "messages" if chat and failed.param == "prompt" else failed.param
                raise from_tandem(failed, param) from None
            raise failed
        return streams


def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """Chunks of several streams as they come, as (stream index, chunk); a stream's error is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
        except BaseException as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))
            return
        queue.put_nowait((i, done))

    async def gen() -> AsyncIterator[tuple[int, object]]:
        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.close_nowait()

    return gen()


def sse(payload: schemas.BaseModel | dict) -> str:
    data = payload.model_dump_json(exclude_none=False) if isinstance(payload, schemas.BaseModel) else \
        json.dumps(payload)
    return f"data: {data}\n\n"


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)


@dataclass
class Tally:
    """One HTTP request's figures while it runs: first token, last chunk, tokens per choice."""

    started: float
    prompts: list[int]  # prompt tokens of each prompt (one bus request each), as the router counted them
    outputs_per_prompt: int = 1  # n: choice c is an output of prompt c // n
    first: float | None = None
    last: float | None = None
    tokens: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)

    def on_chunk(self, metrics: FrontendMetrics | None, index: int, chunk) -> None:
        now = time.perf_counter()
        if chunk.token_ids:
            if self.first is None:
                self.first = now
                if metrics:
                    metrics.ttft.observe(now - self.started)
            elif metrics and self.last is not None:
                metrics.itl.observe(now - self.last)
            self.last = now
        self.tokens[index] = self.tokens.get(index, 0) + len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.reasons[index] = chunk.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompts)  # once per prompt, whatever its n (as OpenAI and vLLM count them)

    def completion_tokens(self) -> int:
        return sum(self.tokens.values())  # every output's

    def finish(self, metrics: FrontendMetrics | None) -> None:
        """One finished request per prompt (its bus request): its outputs' tokens together, and the
        finish reason of its first output."""
        if metrics is None:
            return
        metrics.e2e.observe(time.perf_counter() - self.started)
        n = self.outputs_per_prompt
        for prompt, prompt_tokens in enumerate(self.prompts):
            choices = range(prompt * n, (prompt + 1) * n)
            reasons = [self.reasons[c] for c in choices if c in self.reasons]
            if reasons:
                metrics.finished(prompt_tokens, sum(self.tokens.get(c, 0) for c in choices), reasons[0])


class Gate:
    """Pure ASGI middleware (no BaseHTTPMiddleware: that one copies every streamed body through a
    memory channel, a delay per SSE event): the API key on /v1/ routes, and every answer counted
    by route and status."""

    def __init__(self, app, frontend: Frontend) -> None:  # noqa: ANN001 - any ASGI app
        self.app = app
        self.frontend = frontend

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        key = self.frontend.api_key
        if key and path.startswith("/v1/") and not self.authorized(scope, key):
            error = APIError(401, "missing or wrong API key: send it as `Authorization: Bearer KEY`",
                             "invalid_request_error", None, "invalid_api_key")
            await error_response(error)(scope, receive, send)
            self.count(path, 401)
            return

        async def counted(message) -> None:  # noqa: ANN001
            if message["type"] == "http.response.start":
                self.count(path, message["status"])
            await send(message)

        await self.app(scope, receive, counted)

    @staticmethod
    def authorized(scope, key: str) -> bool:  # noqa: ANN001
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        return hmac.compare_digest(token.encode(), key.encode())

    def count(self, path: str, status: int) -> None:
        if self.frontend.metrics is not None:
            self.frontend.metrics.http.labels(path if path in KNOWN_PATHS else "other", str(status)).inc()


@dataclass
class Collected:
    """One choice's whole output: its text's parts, and with logprobs asked its tokens and entries."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def add(self, chunk) -> None:  # noqa: ANN001 - a tandem.client.Chunk
        self.text.append(chunk.text)
        if chunk.logprobs is not None:
            self.token_ids.extend(chunk.token_ids)
            self.logprobs.extend(chunk.logprobs)


def build_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="tandem", version=VERSION, docs_url="/docs", redoc_url=None)
    text_of = TokenText(frontend.model.tokenizer)

    @app.exception_handler(APIError)
    async def on_api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_body_errors(list(exc.errors()), request.headers.get("content-type")))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:  # Starlette's: 404, 405, ...
        error = from_http_status(exc.status_code, str(exc.detail), request.method, request.url.path, KNOWN_PATHS,
                                 (exc.headers or {}).get("Allow"))
        return error_response(error, exc.headers)

    @app.exception_handler(Exception)
    async def on_crash(_request: Request, exc: Exception) -> JSONResponse:  # the last line of defence
        if frontend.log:
            frontend.log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))

    # The last added runs first: the Gate counts every answer, the body limit's 413 included.
    app.add_middleware(BodyLimit, limits=frontend.limits)
    app.add_middleware(Gate, frontend=frontend)
    add_embeddings_route(app, frontend)
    add_adapter_routes(app, frontend)

    @app.get("/health")
    async def health() -> Response:
        if await frontend.router_alive():
            return JSONResponse({"status": "ok"})
        return error_response(APIError(503, "no router answers on the bus", "service_unavailable_error", None,
                                       "no_workers"))

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(frontend.metrics_page(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> schemas.ModelList:
        cards = []
        for bus_name, vocab_size in (await frontend.router_models()).items():
            name = frontend.model.served_name if bus_name == frontend.model.bus_name else bus_name
            cards.append(schemas.ModelCard(id=name, created=frontend.created, root=bus_name,
                                           max_model_len=frontend.max_model_len(bus_name), vocab_size=vocab_size))
            if bus_name == frontend.model.bus_name and frontend.adapters is not None:
                cards += [schemas.ModelCard(id=r.name, created=int(r.published_at) or frontend.created, root=r.path,
                                            parent=name, max_model_len=frontend.max_model_len(bus_name),
                                            vocab_size=vocab_size)
                          for r in frontend.adapters.served(bus_name)]
        return schemas.ModelList(data=cards)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        bus_model = frontend.check_model(body.model)
        prompts = body.prompts()
        frontend.limits.check(body, len(prompts))
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, "max_tokens")
        if not prompts or any(isinstance(p, str | list) and len(p) == 0 for p in prompts):
            raise bad_request("prompt: the prompt is empty", "prompt")
        return await run(request, body, prompts, params, chat=False, bus_model=bus_model)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        bus_model = frontend.check_model(body.model)
        frontend.limits.check(body, 1)
        field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        answer = frontend.chat_answer(body)
        params = sampling_params(body, body.asked_max_tokens(), field_name)
        prompt, prompt_text = await frontend.chat_prompt(body, answer)
        answer = answer.after_prompt(prompt_text)
        return await run(request, body, [prompt], answer.constrain(params, body), chat=True, answer=answer,
                         bus_model=bus_model)

    async def run(request: Request, body: schemas.SamplingFields, prompts: list, params: dict, chat: bool,
                  answer: ChatAnswer | None = None, bus_model: str | None = None) -> Response:
        frontend.admit(len(prompts))
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                frontend.running -= len(prompts)

        n = params.get("n", 1)
        try:
            started = time.perf_counter()
            streams = await frontend.open_streams(prompts, params, chat, body.priority, bus_model)
            tally = Tally(started, [len(s.accepted.prompt_token_ids) for s in streams], n)
            request_id = schemas.new_id("chatcmpl" if chat else "cmpl")
            model = frontend.shown_model(bus_model or frontend.model.bus_name)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = stream_events(streams, n, tally, request_id, model, answer if chat else None, include_usage,
                                       release)
                # A client gone before the first event leaves the generator unstarted, so its finally
                # never runs: its collection still releases the slot (release is idempotent).
                weakref.finalize(events, release)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            outputs, prompt_entries = await collect_unless_disconnected(request, streams, n, tally)
        except BaseException:
            release()
            raise
        release()
        tally.finish(frontend.metrics)
        usage = schemas.Usage.of(tally.prompt_tokens, tally.completion_tokens())
        created = schemas.now()
        with_logprobs = params.get("logprobs") is not None
        # Per prompt, with prompt_logprobs asked: vLLM's shape of them (every choice of a prompt shares its prompt's).
        prompts_shaped = [None if entries is None else prompt_logprobs(s.accepted.prompt_token_ids, entries, text_of)
                          for s, entries in zip(streams, prompt_entries)]
        if chat:
            messages = [answer.message("".join(out.text), tally.reasons.get(i)) for i, out in enumerate(outputs)]
            choices = [schemas.ChatChoice(
                index=i, message=message,
                logprobs=chat_logprobs(out.token_ids, out.logprobs, text_of) if with_logprobs else None,
                finish_reason=reason) for i, (out, (message, reason)) in enumerate(zip(outputs, messages))]
            return JSONResponse(schemas.ChatCompletion(id=request_id, created=created, model=model, choices=choices,
                                                       usage=usage, prompt_logprobs=prompts_shaped[0]).model_dump())
        choices = [schemas.CompletionChoice(
            index=i, text="".join(out.text),
            logprobs=completion_logprobs(out.token_ids, out.logprobs, text_of) if with_logprobs else None,
            finish_reason=tally.reasons.get(i), prompt_logprobs=prompts_shaped[i // n])
            for i, out in enumerate(outputs)]
        return JSONResponse(schemas.Completion(id=request_id, created=created, model=model, choices=choices,
                                               usage=usage).model_dump())

    async def collect_unless_disconnected(request: Request, streams: list[RequestStream], n: int,
                                          tally: Tally) -> tuple[list[Collected], list[list | None]]:
        """Every choice's whole output (stream ``p``'s output ``i`` is choice ``p * n + i``), and
        each stream's prompt logprobs (None where none came)."""
        outputs = [Collected() for _ in range(len(streams) * n)]
        prompt_entries: list[list | None] = [None] * len(streams)

        async def collect() -> None:
            async for i, chunk in merged(streams):
                choice = i * n + chunk.sample_index
                tally.on_chunk(frontend.metrics, choice, chunk)
                outputs[choice].add(chunk)
                if chunk.prompt_logprobs is not None:
                    prompt_entries[i] = chunk.prompt_logprobs

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():  # the client left: stop, and the streams cancel their requests
                work.cancel()
                for stream in streams:
                    stream.close_nowait()
        if work.cancelled():
            raise APIError(499, "the client closed the connection", "client_closed_request")
        try:
            work.result()
        except TandemError as exc:
            raise from_tandem(exc, exc.param) from None
        return outputs, prompt_entries

    async def stream_events(streams: list[RequestStream], n: int, tally: Tally, request_id: str, model: str,
                            answer: ChatAnswer | None, include_usage: bool,
                            release: Callable[[], None]) -> AsyncIterator[str]:
        """Each chunk as an event of its choice (stream ``p``'s output ``o`` is choice ``p * n + o``);
        ``[DONE]`` once every choice has ended (held outputs come as one event each, at the end).
        A chat choice's text goes through its answer's stream (reasoning, tool calls): a chunk may
        become several deltas, or none while a marker is being read."""
        created = schemas.now()
        chat = answer is not None
        text_offsets = [0] * (len(streams) * n)  # per choice: where its next token's text starts
        choice_streams = [answer.stream() for _ in range(len(streams) * n)] if chat else []
        try:
            if chat:
                for i in range(len(streams) * n):
                    yield sse(chat_chunk(request_id, created, model, i, schemas.ChatDelta(role="assistant",
                                                                                          content="")))
            try:
                async for stream_index, chunk in merged(streams):
                    i = stream_index * n + chunk.sample_index
                    tally.on_chunk(frontend.metrics, i, chunk)
                    if not chunk.token_ids and not chunk.text and chunk.finish_reason is None:
                        continue  # a token whose text is incomplete still goes out (empty), as vLLM sends it
                    if chat:
                        logprobs = None if chunk.logprobs is None else \
                            chat_logprobs(chunk.token_ids, chunk.logprobs, text_of)
                        for event in chat_events(request_id, created, model, i, choice_streams[i], chunk, logprobs):
                            yield sse(event)
                    else:
                        logprobs = None
                        if chunk.logprobs is not None:
                            logprobs = completion_logprobs(chunk.token_ids, chunk.logprobs, text_of, text_offsets[i])
                            text_offsets[i] += sum(map(len, logprobs.tokens))
                        yield sse(schemas.Completion(
                            id=request_id, created=created, model=model,
                            choices=[schemas.CompletionChoice(index=i, text=chunk.text, logprobs=logprobs,
                                                              finish_reason=chunk.finish_reason)]))
            except TandemError as exc:  # mid-stream: the status line has gone, so the error goes as an event
                yield sse(from_tandem(exc, exc.param).body)
                yield "data: [DONE]\n\n"
                return
            tally.finish(frontend.metrics)
            if include_usage:
                usage = schemas.Usage.of(tally.prompt_tokens, tally.completion_tokens())
                kind = schemas.ChatCompletionChunk if chat else schemas.Completion
                yield sse(kind(id=request_id, created=created, model=model, choices=[], usage=usage))
            yield "data: [DONE]\n\n"
        finally:
            release()
            for stream in streams:
                stream.close_nowait()

    return app


def chat_events(request_id: str, created: int, model: str, index: int, choice: ChoiceStream, chunk,  # noqa: ANN001
                logprobs: schemas.ChatLogprobs | None) -> list[schemas.ChatCompletionChunk]:
    """One bus chunk of a chat choice as its events: its deltas (the chunk's logprobs on the first),
    and its finish reason on the last; a chunk with logprobs or an end makes an event even when its
    text is held back (a marker being read), as plain chat sends every token."""
    deltas = choice.feed(chunk.text) + (choice.finish() if chunk.finish_reason is not None else [])
    if not deltas and (logprobs is not None or chunk.finish_reason is not None):
        deltas = [schemas.ChatDelta(content="")]
    reason = choice.finish_reason(chunk.finish_reason)
    return [chat_chunk(request_id, created, model, index, delta, reason if last else None,
                       logprobs if first else None)
            for first, last, delta in ((k == 0, k == len(deltas) - 1, d) for k, d in enumerate(deltas))]


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: schemas.ChatDelta,
               finish_reason: str | None = None,
               logprobs: schemas.ChatLogprobs | None = None) -> schemas.ChatCompletionChunk:
    return schemas.ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[schemas.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                                        finish_reason=finish_reason)])


KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/version",
               "/metrics")
