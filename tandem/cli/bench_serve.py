"""``tandem bench serve``: load a running tandem and report what clients see, like ``vllm bench serve``.

    tandem up &                                   # or any deployment: --nats-url URL
    tandem bench serve --dataset-name random --input-len 512 --output-len 64 --num-prompts 200 \\
        --request-rate 8 --burstiness 1 --goodput ttft:500 tpot:50 --json-out result.json
    tandem bench serve --dataset-name prefix --prefix-ratio 0.75 --max-concurrency 16
    tandem bench serve --base-url http://127.0.0.1:8000 --max-concurrency 32   # the OpenAI HTTP API

Prompts are token ids valid for the served model (see :mod:`tandem.cli.bench_data`); requests use
``ignore_eos`` and greedy sampling so output lengths are exact. ``--num-warmups`` requests go first
and are not counted. TTFT is measured from just before the request is sent to the arrival of its
first token. The table ends with the services' own TTFT for the same requests: the difference of
the ``tandem:time_to_first_token_seconds`` histograms of every prefill and decode worker, scraped
before and after the measured run (their TTFT starts when the router accepts a request, so the
client's is larger by two bus hops).

Two ways in, one workload and one table: a :class:`Backend` sends one request and yields its tokens
as they arrive. :class:`NatsBackend` is ``tandem.client`` over NATS; :class:`HttpBackend`
(``--base-url``) is OpenAI streaming completions (``POST /v1/completions``, ``stream: true``, the
server-sent events parsed here), against tandem's frontend or any OpenAI-compatible server. Over
HTTP the vocabulary size comes from ``--vocab-size``, the ``/v1/models`` entry's ``vocab_size``, or
the router when the NATS URL is known (``--nats-url``, or the running ``tandem up`` that serves that
HTTP API), which also gives the services' TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.cli.bench_data import (
    DATASETS,
    BenchRequest,
    RequestResult,
    arrival_gaps,
    make_requests,
    parse_goodput,
    summarize,
)
from tandem.shared.infra.config import BY_FLAT, Settings

TTFT_METRIC = "tandem:time_to_first_token_seconds"
# The frontend's own key (its --api-key setting): a bench run beside it sends the same key.
API_KEY = BY_FLAT["api_key"]


class BenchLimits(BaseModel):
    """What each flag of ``tandem bench serve`` may be: a value outside is refused with the flag and
    this bound (:func:`tandem.cli.flags.invalid_value`), before anything is sent."""

    model_config = ConfigDict(extra="ignore")
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    range_ratio: float = Field(ge=0, lt=1, allow_inf_nan=False)
    prefix_ratio: float = Field(ge=0, le=1, allow_inf_nan=False)
    num_prefixes: int = Field(ge=1)
    num_prompts: int = Field(ge=1)
    request_rate: float = Field(gt=0)  # inf: all at once
    burstiness: float = Field(gt=0, allow_inf_nan=False)
    max_concurrency: int | None = Field(ge=1)
    num_warmups: int = Field(ge=0)
    timeout: float = Field(gt=0, allow_inf_nan=False)
    vocab_size: int | None = Field(ge=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random token ids, with a shared prefix (see --prefix-ratio), or random ones whose output is "
                        "held to a JSON schema (structured outputs)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (mean; exact per request)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ ratio)")
    p.add_argument("--prefix-ratio", type=float, default=0.5, help="prefix dataset: shared share of each prompt")
    p.add_argument("--num-prefixes", type=int, default=1, help="prefix dataset: distinct shared prefixes")
    p.add_argument("--num-prompts", type=int, default=100, help="requests measured")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight (default: no limit)")
    p.add_argument("--num-warmups", type=int, default=2, help="requests sent first and not counted")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--seed", type=int, default=0, help="of the prompts and the arrivals")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json-out", help="write the full result (summary and every request) here (default: not written)")
    p.add_argument("--base-url", metavar="URL",
                   help="an OpenAI-compatible HTTP API (http://HOST:PORT) to load instead of NATS (default: NATS)")
    p.add_argument("--api-key", default=None,
                   help=f"sent as Authorization: Bearer KEY with --base-url (default: ${API_KEY.env}, the frontend's "
                        "key, else none)")
    p.add_argument("--model", help="the model name sent with each request (default: the router's over NATS, "
                                   "the first of /v1/models over HTTP)")
    p.add_argument("--vocab-size", type=int, metavar="N",
                   help="the model's vocabulary size, for the token-id prompts (default: asked of the server)")


class Progress:
    """A one-line progress bar on stderr (a line per tenth when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool, label: str = "") -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.label = label
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty or self.done == self.total or self.done % max(1, self.total // 10) == 0:
            filled = int(30 * self.done / self.total)
            rate = self.done / max(1e-9, time.perf_counter() - self.start)
            line = f"{self.label}[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} ({rate:.1f} req/s)"
            sys.stderr.write(("\r" + line) if self.tty else (line + "\n"))
            if self.tty and self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


class BenchError(Exception):
    """The run cannot start or go on (no router, no model, a server that does not speak the API):
    one line for the user."""


class RequestFailed(Exception):
    """One request failed as the server said; ``str()`` is the reason (``no_workers: ...``)."""


@dataclass
class Tokens:
    """One arrival on a request's stream."""

    count: int  # output tokens that arrived now
    total: int | None = None  # the server's count of all the request's output tokens (OpenAI's usage chunk)


class Backend(Protocol):
    """The one part of a run that differs between NATS and HTTP: send a request, yield its tokens."""

    kind: str  # "nats" or "http"
    url: str

    async def describe(self) -> tuple[str, int]:
        """(model name, vocabulary size): what the prompts are made for."""

    def stream(self, prompt: list[int], output_len: int, timeout_s: float,
               schema: dict | None = None) -> AsyncIterator[Tokens]:
        """One greedy ``ignore_eos`` request of exactly ``output_len`` tokens (its output held to
        ``schema`` when given); raises on failure."""

    async def services_ttft(self) -> dict[str, tuple[float, int]] | None:
        """instance -> (TTFT sum, count) of every engine worker; None where the services are out of reach."""


async def router_model(nc) -> tuple[str, int]:  # noqa: ANN001 - a nats.NATS
    from tandem.client.discovery import service_infos

    for info in await service_infos(nc, name="tandem-router"):
        meta = info.get("metadata", {})
        if meta.get("vocab_size"):
            return meta.get("model", ""), int(meta["vocab_size"])
    raise BenchError("no router answered $SRV.INFO with the model's vocab_size: is tandem running?")


async def server_ttft(nc) -> dict[str, tuple[float, int]]:  # noqa: ANN001 - a nats.NATS
    """instance -> (TTFT sum, count) from every engine worker's page."""
    from tandem.client.discovery import scrape_services

    pages = await scrape_services(nc, ("tandem-prefill", "tandem-decode"))
    return {iid: (page[2][TTFT_METRIC].sum, page[2][TTFT_METRIC].count)
            for iid, page in pages.items() if TTFT_METRIC in page[2]}


class NatsBackend:
    """Requests through ``tandem.client``: the router, then the workers' token stream."""

    kind = "nats"

    def __init__(self, client, url: str, model: str | None = None,  # noqa: ANN001 - a tandem.client.Client
                 vocab_size: int | None = None, watch=None) -> None:  # noqa: ANN001 - a nats.NATS
        self.client, self.url, self.model, self.vocab_size = client, url, model, vocab_size
        self.watch = watch  # an operator's connection, to read the workers' metrics (None: not allowed)

    async def describe(self) -> tuple[str, int]:
        model, vocab = await router_model(self.client.nc)
        return self.model or model, self.vocab_size or vocab

    async def stream(self, prompt: list[int], output_len: int, timeout_s: float,
                     schema: dict | None = None) -> AsyncIterator[Tokens]:
        structured = {} if schema is None else {"structured_output": {"kind": "json_schema",
                                                                      "spec": json.dumps(schema)}}
        chunks = self.client.generate(prompt, model=self.model, max_tokens=output_len, temperature=0.0,
                                      ignore_eos=True, timeout_s=timeout_s, **structured)
        # Closed however the loop ends, so a request given up on is cancelled on the workers.
        async with aclosing(chunks):
            async for chunk in chunks:
                yield Tokens(len(chunk.token_ids))

    async def services_ttft(self) -> dict[str, tuple[float, int]] | None:
        return await server_ttft(self.watch) if self.watch is not None else None


def base_of(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` (as OpenAI clients take it) are one server."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def error_reason(status: int, body: bytes | str) -> str:
    """An OpenAI-shaped error (``{"error": {"message", "type", "param", "code"}}``) as one line:
    ``code: message (HTTP status)``; any other body is quoted, cut short."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        error = json.loads(text)["error"]
        message = str(error.get("message") or "").strip()
        code = error.get("code") or error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        short = " ".join(text.split())[:200]
        return f"HTTP {status}: {short}" if short else f"HTTP {status}"
    where = f" (HTTP {status})" if status != 200 else ""
    if not code or message.startswith(f"{code}:"):  # tandem's messages from the bus start with their code
        return f"{message}{where}"
    return f"{code}: {message}{where}"


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (its ``data:`` lines joined by newlines, as the spec
    says); comments and other fields are skipped."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


def chunk_tokens(choice: dict) -> int:
    """Output tokens one streamed completion choice carries. OpenAI's chunks do not say: a chunk with
    text (or an empty one mid-stream, a token whose text is not complete yet) is one, the closing
    chunk that only gives the finish reason is none; a server that lists ``token_ids`` is counted
    exactly. The usage chunk's total corrects the count in the end."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if choice.get("text") or choice.get("finish_reason") is None else 0


class HttpBackend:
    """Requests as OpenAI streaming completions to ``base_url`` (``http://HOST:PORT``)."""

    kind = "http"

    def __init__(self, http, base_url: str, *, api_key: str | None = None, model: str | None = None,  # noqa: ANN001
                 vocab_size: int | None = None, nc=None) -> None:  # noqa: ANN001 - httpx.AsyncClient, nats.NATS
        self.http, self.url = http, base_of(base_url)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model, self.vocab_size, self.nc = model, vocab_size, nc

    async def describe(self) -> tuple[str, int]:
        import httpx

        entry: dict[str, Any] = {}
        if not (self.model and self.vocab_size):
            try:
                resp = await self.http.get(f"{self.url}/v1/models", headers=self.headers)
            except httpx.HTTPError as exc:
                raise BenchError(f"cannot reach {self.url}/v1/models: {exc or type(exc).__name__}") from None
            if resp.status_code != 200:
                raise BenchError(f"{self.url}/v1/models: {error_reason(resp.status_code, resp.content)}")
            try:
                models = resp.json()["data"]
            except (ValueError, KeyError, TypeError):
                models = None
            if not isinstance(models, list):
                raise BenchError(f"{self.url}/v1/models is not an OpenAI model list")
            named = [m for m in models if isinstance(m, dict) and m.get("id")]
            if not self.model:
                if not named:
                    raise BenchError(f"{self.url}/v1/models lists no model: pass --model")
                self.model = str(named[0]["id"])
            entry = next((m for m in named if m["id"] == self.model), {})
        vocab = self.vocab_size or entry.get("vocab_size")
        if not vocab and self.nc is not None:
            vocab = (await router_model(self.nc))[1]
        if not vocab:
            raise BenchError(f"{self.url} does not say the model's vocabulary size, which the token-id prompts "
                             "need: pass --vocab-size N, or --nats-url of its tandem")
        self.vocab_size = int(vocab)
        return self.model, self.vocab_size

    async def stream(self, prompt: list[int], output_len: int, timeout_s: float,
                     schema: dict | None = None) -> AsyncIterator[Tokens]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if schema is not None:
            body["structured_outputs"] = {"json": schema}
        async with self.http.stream("POST", f"{self.url}/v1/completions", json=body, headers=self.headers,
                                    timeout=timeout_s) as resp:
            if resp.status_code != 200:
                raise RequestFailed(error_reason(resp.status_code, await resp.aread()))
            async for data in sse_data(resp.aiter_lines()):
                if data.strip() == "[DONE]":
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise RequestFailed(f"not JSON in the event stream: {data[:100]!r}") from None
                if chunk.get("error"):
                    raise RequestFailed(error_reason(200, json.dumps(chunk)))
                choices = chunk.get("choices") or []
                if choices and (n := chunk_tokens(choices[0])):
                    yield Tokens(n)
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    yield Tokens(0, int(usage["completion_tokens"]))
        raise RequestFailed("the event stream ended without data: [DONE]")

    async def services_ttft(self) -> dict[str, tuple[float, int]] | None:
        return await server_ttft(self.nc) if self.nc is not None else None


@asynccontextmanager
async def nats_backend(url: str, *, timeout_s: float, model: str | None = None, vocab_size: int | None = None,
                       auth: dict[str, Any] | None = None,
                       watch_options: dict[str, Any] | None = None) -> AsyncIterator[NatsBackend]:
    """A :class:`NatsBackend` through ``tandem.client`` (``auth``: its ``connect``'s identity
    arguments), and with ``watch_options`` (an operator's identity) a second connection that reads
    the workers' metrics: a client's role may not ask the workers, so without it the run has no
    server-side TTFT."""
    from tandem.client import connect
    from tandem.client.access import BusConnectError, connect_command

    watch = None
    if watch_options is not None:
        try:
            watch = await connect_command(url, watch_options, max_reconnect_attempts=1)
        except BusConnectError as exc:  # the figures from the client side stand alone
            print(f"tandem bench serve: no server-side TTFT ({exc})", file=sys.stderr)
    try:
        async with connect(url, request_timeout_s=timeout_s, **(auth or {})) as client:
            yield NatsBackend(client, url, model, vocab_size, watch)
    finally:
        if watch is not None:
            await watch.close()


@asynccontextmanager
async def http_backend(base_url: str, *, timeout_s: float, api_key: str | None = None, model: str | None = None,
                       vocab_size: int | None = None, nats_url: str | None = None,
                       nats_options: dict[str, Any] | None = None) -> AsyncIterator[HttpBackend]:
    """An :class:`HttpBackend`; with ``nats_url``, also connected to that system's NATS (the router's
    vocabulary size, the services' TTFT) with ``nats_options`` (an operator's identity)."""
    import httpx

    from tandem.client.access import BusConnectError, connect_command

    async with AsyncExitStack() as stack:
        # No pool limit: a bench of N requests in flight must not queue them in the client; and no
        # proxies from the environment: the figures are the server's.
        http = await stack.enter_async_context(httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)))
        nc = None
        if nats_url:
            try:
                nc = await connect_command(nats_url, nats_options or {}, max_reconnect_attempts=3,
                                           reconnect_time_wait=0.5)
            except BusConnectError as exc:
                raise BenchError(str(exc)) from None
            stack.push_async_callback(nc.close)
        yield HttpBackend(http, base_url, api_key=api_key, model=model, vocab_size=vocab_size, nc=nc)


def failure_reason(exc: BaseException) -> str:
    """One line for a failed request: the server's reason as it gave it, else the exception's kind and text."""
    from tandem.client import TandemError

    if isinstance(exc, RequestFailed | TandemError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def one(backend: Backend, prompt: list[int], output_len: int, timeout_s: float,
              schema: dict | None = None) -> RequestResult:
    """Send one request and time its tokens; a failure is recorded, not raised."""
    result = RequestResult(prompt_len=len(prompt), output_len=0, max_tokens=output_len)
    start = time.perf_counter()
    last = None
    total = None
    try:
        async with aclosing(backend.stream(prompt, output_len, timeout_s, schema)) as tokens:
            async for got in tokens:
                now = time.perf_counter()
                for _ in range(got.count):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    result.output_len += 1
                if got.total is not None:
                    total = got.total
    except Exception as exc:  # counted as failed, the run goes on
        result.ok, result.error = False, failure_reason(exc)
    result.e2e = time.perf_counter() - start
    if total is not None:
        result.output_len = total
    if result.ok and result.output_len == 0:
        result.ok, result.error = False, "the request ended without output tokens"
    return result


async def drive(backend: Backend, requests: Sequence[BenchRequest], *, request_rate: float = math.inf,
                burstiness: float = 1.0, seed: int = 0, max_concurrency: int | None = None,
                timeout_s: float = 300.0, progress: Progress | None = None) -> tuple[list[RequestResult], float]:
    """Send ``requests`` with arrivals at ``request_rate`` (gamma gaps of shape ``burstiness``), at
    most ``max_concurrency`` in flight; returns every result in request order and the wall time."""
    gaps = arrival_gaps(len(requests), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)

    async def limited(req: BenchRequest) -> RequestResult:
        async with limit:
            result = await one(backend, req.prompt, req.output_len, timeout_s, req.schema)
        if progress is not None:
            progress.step()
        return result

    start = time.perf_counter()
    tasks = []
    for gap, req in zip(gaps, requests):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(limited(req)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def run(backend: Backend, args: argparse.Namespace) -> dict:
    """One benchmark run through ``backend``; returns the full result."""
    slos = parse_goodput(args.goodput)
    model, vocab = await backend.describe()
    kw = dict(range_ratio=args.range_ratio, prefix_ratio=args.prefix_ratio, num_prefixes=args.num_prefixes)
    requests = make_requests(args.dataset_name, args.num_prompts, args.input_len, args.output_len, vocab,
                             seed=args.seed, **kw)
    warmups = make_requests(args.dataset_name, args.num_warmups, args.input_len, args.output_len, vocab,
                            seed=args.seed + 1000, **kw)
    for w in warmups:
        await one(backend, w.prompt, w.output_len, args.timeout, w.schema)
    before = await backend.services_ttft()
    results, duration = await drive(backend, requests, request_rate=args.request_rate, burstiness=args.burstiness,
                                    seed=args.seed, max_concurrency=args.max_concurrency, timeout_s=args.timeout,
                                    progress=Progress(len(requests), not args.no_progress))
    after = await backend.services_ttft()
    summary = summarize(results, duration, slos)
    if before is not None and after is not None:
        d_sum = sum(s - before.get(i, (0.0, 0))[0] for i, (s, _) in after.items())
        d_count = sum(c - before.get(i, (0.0, 0))[1] for i, (_, c) in after.items())
        summary["server_ttft_mean_ms"] = d_sum / d_count * 1e3 if d_count else math.nan
        summary["server_ttft_count"] = d_count
    else:
        summary["server_ttft_mean_ms"], summary["server_ttft_count"] = math.nan, None
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
              if k not in ("func", "api_key")}
    return {"model": model, "backend": backend.kind, "url": backend.url,
            "nats_url": backend.url if backend.kind == "nats" else None, "config": config, "summary": summary,
            "requests": [vars(r) | {"tpot": r.tpot} for r in results]}


def print_table(result: dict) -> None:
    s = result["summary"]
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}")]
    if "request_goodput" in s:
        rows.append(("Goodput SLOs (ms):", " ".join(f"{k}<={v:g}" for k, v in s["goodput_slos_ms"].items())))
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=60, c="=")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append("{s:{c}^{n}}".format(s=title, n=60, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms):':<44}{s[key][stat]:>16.2f}")
    if s.get("server_ttft_count") is not None:  # None: over HTTP with the services out of reach
        lines.append("{s:{c}^{n}}".format(s="Services' own TTFT (same requests)", n=60, c="-"))
        lines.append(f"{'Mean TTFT, ' + TTFT_METRIC.split(':')[1] + ' (ms):':<44}{s['server_ttft_mean_ms']:>16.2f}")
        lines.append(f"{'Requests in that histogram:':<44}{s['server_ttft_count']:>16}")
    lines.append("=" * 60)
    print("\n".join(lines), flush=True)


def strict_json(value: Any) -> Any:
    """NaN and infinity as null: JSON has neither."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def check_args(args: argparse.Namespace) -> str | None:
    """The first flag of ``args`` outside its bound, as one line (None: all fine)."""
    from tandem.cli.flags import invalid_value

    try:
        BenchLimits.model_validate(vars(args))
        parse_goodput(args.goodput)
    except ValidationError as exc:
        return invalid_value(exc, BenchLimits, {})
    except ValueError as exc:
        return str(exc)
    return None


def nats_url_for_http(base_url: str, settings: Settings) -> str | None:
    """The NATS URL behind ``base_url`` when it is known: ``--nats-url`` (or ``TANDEM_NATS_URL``), or
    the running ``tandem up`` whose frontend is that very URL (never another system's)."""
    from tandem.client.runstate import find_running

    if settings.bus.nats_url:
        return settings.bus.nats_url
    state = find_running(settings.data_dir)
    if state and state.http_url and base_of(state.http_url) == base_of(base_url):
        return state.nats_url
    return None


def run_bench_serve(args: argparse.Namespace, settings: Settings) -> int:
    from tandem.client import TandemError
    from tandem.client.access import command_auth, operator_options
    from tandem.client.runstate import find_running_url
    from tandem.shared.auth.credentials import CredentialsError
    from tandem.shared.infra.process import run_async

    prog = "tandem bench serve"
    problem = check_args(args)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    if args.base_url:
        if not args.base_url.startswith(("http://", "https://")):
            print(f"{prog}: --base-url must start with http:// or https://, not {args.base_url!r}", file=sys.stderr)
            return 2
        nats_url = nats_url_for_http(args.base_url, settings)
        try:
            options = operator_options(settings, "tandem-bench", nats_url) if nats_url else None
        except CredentialsError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        opened = http_backend(args.base_url, timeout_s=args.timeout, api_key=args.api_key or settings.frontend.api_key,
                              model=args.model, vocab_size=args.vocab_size, nats_url=nats_url, nats_options=options)
    else:
        url = settings.bus.nats_url or find_running_url(settings.data_dir)
        if url is None:
            print(f"{prog}: no running tandem found; start one with `tandem up`, or pass --nats-url or --base-url",
                  file=sys.stderr)
            return 2
        try:
            watch_options = operator_options(settings, "tandem-bench", url)
        except CredentialsError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        opened = nats_backend(url, timeout_s=args.timeout, model=args.model, vocab_size=args.vocab_size,
                              auth=command_auth(settings), watch_options=watch_options)

    async def main() -> dict:
        async with opened as backend:
            return await run(backend, args)

    try:
        result = run_async(main())
    except (BenchError, TandemError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print_table(result)
    s = result["summary"]
    if s["failed"]:
        print(f"{prog}: {s['failed']} of {s['completed'] + s['failed']} requests failed; "
              f"first failure: {s['first_failure']}", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(strict_json(result), f, indent=2)
    return 0 if s["completed"] else 1
