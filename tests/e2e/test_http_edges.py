"""The HTTP front end's edges against a real system: hostile requests beside live streams, bodies
over the bound (declared and chunked), Starlette's own errors, model names, and the console's count
of the front end's requests. The official ``openai`` client where an API client would use it, httpx
for what it cannot send (chunked bodies, wrong methods).

One system per module (router and a decode worker that prefills itself, on a nats-server of the
module's own, for its monitoring port) and two frontends on it: ``frontend-edge`` with the default
bounds, and ``frontend-path`` serving the model by its directory's path under a served name, with
a body bound above the bus's max payload (so a 10 MB prompt meets the bus's bound, not the body's).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from cli_support import launch, run_sync
from support import bus_connections, prompt_of, service_metadata

from tandem.cli.supervisor import wait_until_ready
from tandem.console.source import NatsSource
from tandem.console.state import ConsoleState
from tandem.shared.infra.natsserver import MAX_PAYLOAD, NatsServer
from tandem.shared.model.meta import shipped_checkpoint

# slow: its own nats-server and two front ends (about 18 s on 2 cores); the same bounds run by default in
# tests/unit/frontend/test_http_limits.py, against the app in process
pytestmark = pytest.mark.slow

SERVED = "served-tiny"
ROOMY_BODY_MIB = 16  # frontend-path's body bound: above the bus's max payload (8 MiB)
HOSTILE_PROMPTS = 10_000
HOSTILE_BODY_BYTES = 10 * 1000 * 1000
LEGIT_PROMPTS = [prompt_of(20, salt=s) for s in (0, 7, 13)]
LEGIT_TOKENS = 150  # long enough to be still streaming while the hostile requests are answered
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
SANE_S = 20.0  # a generous bound on a refusal: seconds, not the minutes a flooded front end took


@pytest.fixture(scope="module")
def nats_server():
    """This module's own server, with its monitoring port: its ``/connz`` tells whether a front
    end's connection was reset (the session's server has none)."""
    server = NatsServer.start(monitor_port=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def edges(start_system, nats_server):
    system = start_system(prefill=0, decode=1, decode_args=["--num-blocks", "200"])
    system.nats_monitor_port = nats_server.monitor_port
    model_dir = shipped_checkpoint("tiny")
    assert model_dir is not None, "the tiny checkpoint ships in the package"
    frontends = {
        "frontend-edge": ["--metrics-interval-s", "0.5"],
        "frontend-path": ["--model", str(model_dir), "--served-model-name", SERVED,
                          "--http-max-body-mib", str(ROOMY_BODY_MIB)],
    }
    for name, args in frontends.items():
        system.processes[name] = launch(system.url, "frontend", name, system.logdir, system.env,
                                        ["--http-port", "0", *args])
    run_sync(wait_until_ready(system.url, {"frontend": list(frontends)}, system.check_alive, 60))
    system.meta = run_sync(service_metadata(system.url, "tandem-frontend"))
    system.http = {name: meta["http_url"] for name, meta in system.meta.items()}
    system.model_dir = str(model_dir)
    yield system
    for name in frontends:
        if name in system.processes:
            system.stop(name)


def client_for(edges, name: str = "frontend-edge") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edges.http[name]}/v1", api_key="unused", max_retries=0, timeout=120)


def error_body(exc: openai.APIStatusError) -> dict:
    body = exc.body if isinstance(exc.body, dict) else {}
    return body.get("error", body)  # the SDK hands over the error object, or the whole body


async def streamed_text(client: openai.AsyncOpenAI, prompt: str, first: asyncio.Event | None = None) -> str:
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=LEGIT_TOKENS, stream=True,
                                             **GREEDY)
    text = []
    async for piece in stream:
        if piece.choices:
            text.append(piece.choices[0].text)
            if first is not None:
                first.set()
    return "".join(text)


async def refused(request) -> tuple[openai.APIStatusError, float]:
    """The error a request meant to be refused got, and how long the refusal took (seconds)."""
    started = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as caught:
        await request
    return caught.value, time.perf_counter() - started


async def assert_same_process_and_connection(edges, name: str, cid: int) -> None:
    process = edges.processes[name]
    assert process.poll() is None, f"{name} exited with {process.returncode}\n{edges.logs()}"
    now = await service_metadata(edges.url, "tandem-frontend")
    assert now[name]["pid"] == edges.meta[name]["pid"] == str(process.pid), f"{name} is another process now"
    connections = await bus_connections(edges.nats_monitor_port)
    assert connections.get(f"tandem-frontend-{name}") == cid, \
        f"{name}'s bus connection was reset (connection id {cid} -> {connections.get(f'tandem-frontend-{name}')})"


async def test_hostile_requests_beside_live_streams_are_refused_and_hurt_no_stream(edges):
    client = client_for(edges)
    alone = await asyncio.gather(*(streamed_text(client, p) for p in LEGIT_PROMPTS))
    assert all(len(text) > 0 for text in alone), "the reference streams came back empty"
    cid = (await bus_connections(edges.nats_monitor_port))["tandem-frontend-frontend-edge"]

    firsts = [asyncio.Event() for _ in LEGIT_PROMPTS]
    streams = [asyncio.ensure_future(streamed_text(client, p, first)) for p, first in zip(LEGIT_PROMPTS, firsts)]
    await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), 60)
    assert not any(s.done() for s in streams), "a legitimate stream ended before the hostile requests went"
    # One after the other, so that each one's time is its own (the SDK encodes a 10 MB body on this loop).
    # The baseline: an ordinary refusal of a one-prompt request (an unknown model), the same way, in this run.
    _, ordinary_s = await refused(client.completions.create(model="no-such-model", prompt="x", max_tokens=4))
    many, many_s = await refused(client.completions.create(model="tiny", prompt=["x"] * HOSTILE_PROMPTS, max_tokens=4))
    big, big_s = await refused(client.completions.create(model="tiny", prompt="x" * HOSTILE_BODY_BYTES, max_tokens=4))
    live = sum(not s.done() for s in streams)
    beside = await asyncio.wait_for(asyncio.gather(*streams), 120)
    print(f"\nrefused, against an ordinary one-prompt refusal in this run: {HOSTILE_PROMPTS:,} prompts "
          f"{many_s / ordinary_s:.1f}x, a {HOSTILE_BODY_BYTES:,}-byte body {big_s / ordinary_s:.1f}x; "
          f"{live} of {len(streams)} legitimate streams still live then")

    assert many.status_code == 400 and error_body(many).get("param") == "prompt", error_body(many)
    assert f"{HOSTILE_PROMPTS:,} prompts in one request; at most 128 (--http-max-prompts)" in \
        error_body(many).get("message", ""), error_body(many)
    assert big.status_code == 413 and error_body(big).get("code") == "request_too_large", error_body(big)
    assert many_s < SANE_S and big_s < SANE_S, f"refusals took {many_s:.1f} s and {big_s:.1f} s"
    assert beside == alone, "a legitimate stream beside the hostile requests differs from the same request alone"
    await assert_same_process_and_connection(edges, "frontend-edge", cid)
    again = await client.completions.create(model="tiny", prompt=LEGIT_PROMPTS[0], max_tokens=8, **GREEDY)
    assert again.choices[0].text == alone[0][:len(again.choices[0].text)], "the front end serves as before"


async def test_a_prompt_over_the_bus_message_bound_is_a_413_and_keeps_the_connection(edges):
    """Under frontend-path's body bound, over the bus's max payload: the client library refuses it
    before publishing, so the front end's NATS connection is never reset (it once was, with a 503)."""
    assert HOSTILE_BODY_BYTES > MAX_PAYLOAD and HOSTILE_BODY_BYTES < ROOMY_BODY_MIB * 1024 * 1024
    client = client_for(edges, "frontend-path")
    cid = (await bus_connections(edges.nats_monitor_port))["tandem-frontend-frontend-path"]
    error, took = await refused(client.completions.create(model=SERVED, prompt="x" * HOSTILE_BODY_BYTES,
                                                          max_tokens=4))
    print(f"\na {HOSTILE_BODY_BYTES:,}-byte prompt over the bus's max payload refused in {took * 1e3:.1f} ms")
    assert error.status_code == 413 and error_body(error).get("code") == "request_too_large", error_body(error)
    assert error_body(error).get("param") == "prompt" and "max_payload" in error_body(error).get("message", "")
    await assert_same_process_and_connection(edges, "frontend-path", cid)
    result = await client.completions.create(model=SERVED, prompt="x", max_tokens=2, **GREEDY)
    assert result.usage.completion_tokens == 2


def body_chunks(total: int, size: int = 64 * 1024):
    async def gen():
        for start in range(0, total, size):
            yield b" " * min(size, total - start)
    return gen()


async def test_a_chunked_body_over_the_bound_is_a_413_once_over(edges):
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{edges.http['frontend-edge']}/v1/completions", content=body_chunks(
            HOSTILE_BODY_BYTES), headers={"content-type": "application/json"})
    print(f"\na chunked {HOSTILE_BODY_BYTES:,}-byte body refused in {(time.perf_counter() - started) * 1e3:.1f} ms")
    assert "content-length" not in response.request.headers, "the body must go chunked"
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "is over 4,194,304 bytes" in error["message"], error


async def test_a_chunked_body_under_the_bound_is_served(edges):
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}'

    async def pieces():
        for start in range(0, len(body), 7):
            yield body[start:start + 7]

    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{edges.http['frontend-edge']}/v1/completions", content=pieces(),
                                   headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("method,path,content,headers,status,says", [
    ("GET", "/v1/nope", None, {}, 404, "GET /v1/nope: no such route"),
    ("GET", "/v1/completions", None, {}, 405, "method not allowed; use POST"),
    ("POST", "/v1/completions", b"[1, 2]", {"content-type": "application/json"}, 400,
     "the body must be a JSON object with the request's fields (got a JSON array)"),
    ("POST", "/v1/chat/completions", b'"x"', {"content-type": "application/json"}, 400, "(got a JSON string)"),
    ("POST", "/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 415,
     "the body must be JSON sent with Content-Type: application/json"),
], ids=["404", "405", "json-array", "json-string", "text-plain"])
async def test_edge_errors_are_openai_error_objects(edges, method, path, content, headers, status, says):
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.request(method, f"{edges.http['frontend-edge']}{path}", content=content,
                                      headers=headers)
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert says in body["error"]["message"], body


async def test_the_model_answers_to_its_path_and_names_the_names_to_use(edges):
    client = client_for(edges, "frontend-path")
    for model in (edges.model_dir, SERVED, "tiny"):
        result = await client.completions.create(model=model, prompt="x", max_tokens=2, **GREEDY)
        assert result.model == SERVED and result.usage.completion_tokens == 2, model
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    message = error_body(caught.value).get("message", "")
    assert f"send model={SERVED!r} (or 'tiny')" in message and edges.model_dir not in message, message


async def test_the_console_counts_the_front_ends_http_requests(edges):
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(3):
            assert (await http.get(f"{edges.http['frontend-edge']}/v1/models")).status_code == 200
            assert (await http.get(f"{edges.http['frontend-edge']}/v1/nope")).status_code == 404
    source, state = NatsSource(edges.url), ConsoleState()
    await source.start(state)
    try:
        deadline = time.monotonic() + 15
        while True:
            row = next((r for r in state.services if r.instance_id == "frontend-edge"), None)
            if row is not None and row.requests >= 6:
                break
            assert time.monotonic() < deadline, f"the console shows the front end at {row}"
            await asyncio.sleep(0.2)
    finally:
        await source.stop()
    assert row.service == "frontend" and row.errors == 0, row
