"""``tandem bench serve --base-url``'s HTTP path against a real HTTP server started here: a small
Starlette app on uvicorn that speaks OpenAI's streaming completions (server-sent events, the usage
chunk, ``data: [DONE]``) and its error bodies, one behaviour per URL prefix. Checks the request the
bench sends, what it measures from the stream, and the one-line reason each failure gets."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem.cli.bench_serve import BenchError, HttpBackend, base_of, http_backend, one, sse_data
from tandem.cli.main import main

FIRST_DELAY_S = 0.15  # before the first chunk: the TTFT the bench must see
GAP_S = 0.05  # between chunks
VOCAB = 300
ERRORS = {  # status -> (code, message) as tandem's frontend sends them
    400: ("invalid_value", "temperature: Input should be less than or equal to 100"),
    401: ("invalid_api_key", "this server wants an API key: send Authorization: Bearer KEY"),
    404: ("model_not_found", "the model 'x' does not exist; this server serves 'tiny'"),
    429: ("too_many_requests", "512 requests in flight already; retry later"),
    503: ("no_workers", "no_workers: no decode worker is running"),
}


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def completion(text: str, finish: str | None = None, **choice) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake-model",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, **choice}]}


async def ok_stream(max_tokens: int) -> AsyncIterator[str]:
    """``max_tokens - 1`` text chunks (the first carries two tokens' text, as a coalescing server
    sends), a closing chunk with no text, then the usage chunk that gives the true count."""
    yield ": keep-alive comment, skipped\n\n"
    await asyncio.sleep(FIRST_DELAY_S)
    for i in range(max_tokens - 1):
        if i == 1:  # one event split over two data lines, joined by a newline as the spec says
            body = json.dumps(completion(f"t{i}"))
            cut = body.index(",") + 1  # between two members: the joining newline is JSON whitespace
            yield f"event: message\ndata: {body[:cut]}\ndata: {body[cut:]}\n\n"
        else:
            yield event(completion(f"t{i}"))
        await asyncio.sleep(GAP_S)
    yield event(completion("", "length"))
    yield event({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake-model", "choices": [],
                 "usage": {"prompt_tokens": 4, "completion_tokens": max_tokens, "total_tokens": 4 + max_tokens}})
    yield event("[DONE]")


async def token_id_stream(max_tokens: int) -> AsyncIterator[str]:
    """A server that lists each chunk's token ids (and sends no usage): counted exactly."""
    for start in range(0, max_tokens, 2):
        ids = list(range(start, min(start + 2, max_tokens)))
        yield event(completion("ab"[: len(ids)], "length" if start + 2 >= max_tokens else None, token_ids=ids))
    yield event("[DONE]")


async def broken_stream(kind: str) -> AsyncIterator[str]:
    yield event(completion("t0"))
    if kind == "midstream":
        yield event({"error": {"message": "worker_failure: worker decode-1 stopped sending heartbeats",
                               "type": "server_error", "param": None, "code": "worker_failure"}})
        yield event("[DONE]")
    # "nodone": the connection just ends


def make_app(seen: list[dict]) -> Starlette:
    async def models(request: Request) -> Response:
        scenario = request.path_params["scenario"]
        if scenario == "nomodels":
            return JSONResponse({"error": {"message": "not here", "type": "invalid_request_error", "param": None,
                                           "code": "not_found"}}, status_code=404)
        card = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "test"}
        return JSONResponse({"object": "list", "data": [card | ({} if scenario == "novocab" else
                                                                {"vocab_size": VOCAB})]})

    async def completions(request: Request) -> Response:
        scenario = request.path_params["scenario"]
        body = await request.json()
        seen.append({"scenario": scenario, "body": body, "authorization": request.headers.get("authorization")})
        if scenario.startswith("status"):
            status = int(scenario.removeprefix("status"))
            code, message = ERRORS[status]
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": code}}, status_code=status)
        if scenario == "html":
            return Response("<html><body>502 Bad Gateway</body></html>", status_code=502, media_type="text/html")
        if scenario in ("midstream", "nodone"):
            return StreamingResponse(broken_stream(scenario), media_type="text/event-stream")
        stream = token_id_stream if scenario == "tokenids" else ok_stream
        return StreamingResponse(stream(body["max_tokens"]), media_type="text/event-stream")

    return Starlette(routes=[Route("/{scenario}/v1/models", models),
                             Route("/{scenario}/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, list[dict]]]:
    """(URL, the completion requests it got) of the OpenAI-speaking server, on a free port."""
    seen: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(seen), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test's HTTP server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def no_tandem(tmp_path, monkeypatch):
    """No running tandem to find and no NATS URL: the HTTP path alone."""
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_NATS_URL", raising=False)
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)


async def lines(*items: str) -> AsyncIterator[str]:
    for item in items:
        yield item


async def test_sse_data_follows_the_event_stream_format():
    got = [d async for d in sse_data(lines(": comment", "event: completion", "data: {\"a\":", "data: 1}", "",
                                           "", "data:no-space", "id: 7", "", "data: [DONE]"))]
    assert got == ['{"a":\n1}', "no-space", "[DONE]"], "joined lines, comments and other fields left out, and "\
                                                       "the last event kept without its blank line"


@pytest.mark.parametrize(("url", "base"), [("http://h:8000", "http://h:8000"), ("http://h:8000/", "http://h:8000"),
                                           ("http://h:8000/v1", "http://h:8000"), ("http://h:8000/v1/", "http://h:8000")])
def test_base_url_forms(url, base):
    assert base_of(url) == base


async def test_a_stream_is_timed_and_counted_by_its_usage(server):
    url, seen = server
    async with http_backend(f"{url}/ok", timeout_s=10, api_key="sekrit") as backend:
        assert await backend.describe() == ("fake-model", VOCAB)
        result = await one(backend, [5, 6, 7, 8], 6, timeout_s=10)
    assert result.ok, result.error
    assert result.output_len == 6, "the usage chunk's count, not the 5 chunks that had text"
    assert result.ttft >= FIRST_DELAY_S, f"TTFT {result.ttft:.3f}s: measured from before the request was sent"
    assert len(result.itls) == 4 and all(gap >= GAP_S * 0.8 for gap in result.itls), result.itls
    assert result.e2e >= result.ttft + 4 * GAP_S * 0.8
    request = seen[-1]
    assert request["authorization"] == "Bearer sekrit"
    assert request["body"] == {"model": "fake-model", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0.0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def test_chunks_listing_token_ids_are_counted_exactly(server):
    url, seen = server
    async with http_backend(f"{url}/tokenids", timeout_s=10, vocab_size=50) as backend:
        assert await backend.describe() == ("fake-model", 50), "--vocab-size wins over the server's"
        result = await one(backend, [1, 2], 5, timeout_s=10)
    assert result.ok and result.output_len == 5, (result.output_len, result.error)
    assert len(result.itls) == 4, "two tokens in one chunk: a zero gap between them"
    assert seen[-1]["authorization"] is None, "no --api-key: no Authorization header"


@pytest.mark.parametrize("status", sorted(ERRORS))
async def test_an_openai_error_is_the_reason(server, status):
    url, _ = server
    code, message = ERRORS[status]
    async with http_backend(f"{url}/status{status}", timeout_s=10, model="m", vocab_size=10) as backend:
        result = await one(backend, [1], 4, timeout_s=10)
    assert not result.ok and result.output_len == 0
    want = f"{message} (HTTP {status})" if message.startswith(f"{code}:") else f"{code}: {message} (HTTP {status})"
    assert result.error == want


@pytest.mark.parametrize(("scenario", "reason"), [
    ("midstream", "worker_failure: worker decode-1 stopped sending heartbeats"),
    ("nodone", "the event stream ended without data: [DONE]"),
    ("html", "HTTP 502: <html><body>502 Bad Gateway</body></html>"),
])
async def test_a_broken_stream_fails_with_its_reason(server, scenario, reason):
    url, _ = server
    async with http_backend(f"{url}/{scenario}", timeout_s=10, model="m", vocab_size=10) as backend:
        result = await one(backend, [1], 4, timeout_s=10)
    assert (result.ok, result.error) == (False, reason)


async def test_no_vocabulary_size_is_a_clear_error(server):
    url, _ = server
    async with http_backend(f"{url}/novocab", timeout_s=10) as backend:
        with pytest.raises(BenchError, match="pass --vocab-size N, or --nats-url of its tandem"):
            await backend.describe()


async def test_model_list_errors_are_one_line(server):
    url, _ = server
    async with http_backend(f"{url}/nomodels", timeout_s=10) as backend:
        with pytest.raises(BenchError, match=r"/nomodels/v1/models: not_found: not here \(HTTP 404\)$"):
            await backend.describe()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    async with http_backend(f"http://127.0.0.1:{port}", timeout_s=5) as backend:
        assert isinstance(backend, HttpBackend)
        with pytest.raises(BenchError, match=f"cannot reach http://127.0.0.1:{port}/v1/models"):
            await backend.describe()


def run_bench(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["bench", "serve", "--input-len", "4", "--output-len", "3", "--num-prompts", "3", "--num-warmups",
                 "0", "--no-progress", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bench_serve_over_http_prints_the_table(server, no_tandem, capsys, tmp_path):
    url, seen = server
    out_file = tmp_path / "result.json"
    code, out, err = run_bench(["--base-url", f"{url}/ok/v1", "--json-out", str(out_file)], capsys)
    assert code == 0, err
    assert "Successful requests:                                       3" in out, out
    assert "Services' own TTFT" not in out, "no NATS URL known: the services' histograms are out of reach"
    result = json.loads(out_file.read_text())
    assert (result["backend"], result["url"], result["model"]) == ("http", f"{url}/ok", "fake-model")
    assert result["summary"]["total_output_tokens"] == 9 and result["summary"]["server_ttft_count"] is None
    assert all(r["output_len"] == r["max_tokens"] == 3 for r in result["requests"])
    assert all(0 <= t < VOCAB for r in seen[-3:] for t in r["body"]["prompt"]), "prompts within the vocabulary"


def test_bench_serve_says_the_first_failure(server, no_tandem, capsys):
    url, _ = server
    code, out, err = run_bench(["--base-url", f"{url}/status503", "--vocab-size", "20"], capsys)
    assert code == 1, "no request completed"
    assert "Failed requests:                                           3" in out, out
    assert err.splitlines()[-1] == ("tandem bench serve: 3 of 3 requests failed; first failure: no_workers: "
                                    "no decode worker is running (HTTP 503)"), err
