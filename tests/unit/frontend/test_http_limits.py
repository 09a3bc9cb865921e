"""The HTTP edge's bounds and error shapes (``services/frontend/limits.py``, ``errors.py``): the
frontend app in process over httpx's ASGI transport, its real bus client on the session's
nats-server, the router played by the test (``scripted_router``), so a refusal is seen to happen
before any bus work (the router got nothing). Small bounds, so that each is easy to pass; the
served model answers to its served name, its bus name and its ``--model`` path."""

from __future__ import annotations

import httpx
import pytest
from scripted_router import ScriptedRouter, chunk

from tandem.client import RequestTooLargeError, connect
from tandem.services.frontend.app import Frontend, ServedModel, build_app
from tandem.services.frontend.errors import from_tandem
from tandem.services.frontend.limits import HTTPLimits
from tandem.services.frontend.metrics import FrontendMetrics
from tandem.shared.infra.metrics import MetricsRegistry
from tandem.shared.protocol.serving import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tandem.shared.text.chat_template import tiny_template
from tandem.shared.text.tokenizer import ByteTokenizer

LIMITS = HTTPLimits(max_prompts=3, max_choices=6, max_body_bytes=64 * 1024)  # 10,000 short prompts fit
MODEL_PATH = "/srv/models/tiny"  # the --model value of the served model
SERVED = "served-tiny"
ERROR_FIELDS = {"message", "type", "param", "code"}


def one_token(request):
    """Every output of the request: one token, then done."""
    return [chunk(request, i, 0, [104], "h", "length") for i in range(request.params.num_candidates)]


@pytest.fixture
async def api(nats_server):
    """(an httpx client on the app, the scripted router, the app's Prometheus registry)."""
    router = await ScriptedRouter.start(nats_server.url, one_token)
    async with connect(nats_server.url, worker_timeout_s=5) as client:

        async def models() -> dict[str, int | None]:
            return {"tiny": 259}

        async def alive() -> bool:
            return True

        prom = MetricsRegistry()
        frontend = Frontend(client=client, model=ServedModel(SERVED, "tiny", ByteTokenizer(), tiny_template(),
                                                             spec=MODEL_PATH),
                            api_key=None, max_concurrent_requests=8, router_models=models,
                            max_model_len=lambda _: 256, router_alive=alive, limits=LIMITS)
        frontend.metrics = FrontendMetrics(prom, lambda: frontend.running)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)),
                                     base_url="http://api") as http:
            yield http, router, prom
    await router.close()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, f"wanted {status}, got {response.status_code}: {response.text}"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, f"not OpenAI's error object: {body}"
    assert "\n" not in body["error"]["message"], "an error is one line"
    return body["error"]


OVER_A_BOUND = [
    pytest.param({"prompt": ["a"] * 4}, "prompt", "4 prompts in one request; at most 3 (--http-max-prompts)",
                 id="prompts"),
    pytest.param({"prompt": ["a"] * 10_000}, "prompt", "10,000 prompts", id="10000-prompts"),
    pytest.param({"prompt": ["a", "b"], "n": 4}, "n", "2 prompts x 4 candidates = 8 sequences", id="prompts-x-n"),
    pytest.param({"prompt": "a", "n": 2, "best_of": 7}, "best_of", "at most 6 (--http-max-choices)", id="best_of"),
    pytest.param({"prompt": ["a", "b"], "n": 2, "best_of": 4, "use_beam_search": True}, "best_of", "8 sequences",
                 id="beam-width"),
    pytest.param({"prompt": "a", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop",
                 f"{MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}", id="stop-strings"),
    pytest.param({"prompt": "a", "stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, "stop",
                 f"at most {MAX_STOP_STRING_CHARS}", id="stop-string-chars"),
    pytest.param({"prompt": "a", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
                 f"at most {MAX_STOP_TOKEN_IDS}", id="stop-token-ids"),
    pytest.param({"prompt": "a", "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias",
                 f"{MAX_LOGIT_BIAS + 1:,} entries; at most {MAX_LOGIT_BIAS}", id="logit-bias"),
]


@pytest.mark.parametrize("fields,param,says", OVER_A_BOUND)
async def test_a_request_over_a_bound_is_a_400_naming_it_before_any_bus_work(api, fields, param, says):
    http, router, _ = api
    error = error_of(await http.post("/v1/completions", json={"max_tokens": 1, **fields}), 400)
    assert error["param"] == param and says in error["message"], error
    assert router.requests == [], "a refused request reached the router"


@pytest.mark.parametrize("fields,choices", [
    ({"prompt": ["a", "b", "c"], "n": 2}, 6),
    ({"prompt": "a", "n": 2, "best_of": 6}, 2),
    ({"prompt": "a", "stop": ["s"] * MAX_STOP_STRINGS, "logit_bias": {"1": 1}}, 1),
], ids=["prompts-x-n", "best_of", "stop-strings"])
async def test_a_request_at_its_bounds_is_served(api, fields, choices):
    http, router, _ = api
    response = await http.post("/v1/completions", json={"max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == choices


async def test_a_chat_request_is_bounded_too(api):
    http, router, _ = api
    error = error_of(await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "n": 7}), 400)
    assert error["param"] == "n" and "at most 6 (--http-max-choices)" in error["message"], error
    assert router.requests == []


def chunks_of(total: int, size: int = 4096):
    async def gen():
        sent = 0
        while sent < total:
            yield b" " * min(size, total - sent)
            sent += size
    return gen()


@pytest.mark.parametrize("send,says", [
    (dict(content=b" " * (LIMITS.max_body_bytes + 1)), "is 65,537 bytes; at most 65,536 bytes (0.0625 MiB"),
    (dict(content=chunks_of(LIMITS.max_body_bytes * 20)), "is over 65,536 bytes"),
], ids=["content-length", "chunked"])
async def test_a_body_over_the_bound_is_a_413_before_the_route_runs(api, send, says):
    http, router, prom = api
    response = await http.post("/v1/completions", headers={"content-type": "application/json"}, **send)
    error = error_of(response, 413)
    assert error["code"] == "request_too_large" and says in error["message"], error
    assert "--http-max-body-mib" in error["message"], error
    assert router.requests == []
    assert 'tandem:http_requests_total{handler="/v1/completions",status="413"} 1.0' in prom.text(), \
        "the 413 must be counted as an answer"


async def test_a_chunked_body_under_the_bound_is_read_whole(api):
    http, _, _ = api
    body = b'{"prompt": "a", "max_tokens": 1}'

    async def pieces():
        for i in range(0, len(body), 5):
            yield body[i:i + 5]

    response = await http.post("/v1/completions", content=pieces(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("content,content_type,status,says", [
    (b"[1, 2]", "application/json", 400, "the body must be a JSON object with the request's fields (got a JSON array)"),
    (b'"x"', "application/json", 400, "(got a JSON string)"),
    (b"7", "application/json", 400, "(got a JSON number)"),
    (b"null", "application/json", 400, "(got null)"),
    (b"hello", "application/json", 400, "the body is not valid JSON (Expecting value at character 0)"),
    (b"", "application/json", 400, "the body is empty"),
    (b"[" * 10_000, "application/json", 400, "the body could not be parsed as JSON"),  # past the parser's depth
    (b'{"prompt": "a"}', "text/plain", 415, "Content-Type: application/json (got Content-Type: text/plain)"),
    (b'{"prompt": "a"}', None, 415, "(got no Content-Type)"),
    (b'{"prompt": "a"}', "application/x-www-form-urlencoded", 415, "application/x-www-form-urlencoded"),
], ids=["array", "string", "number", "null", "not-json", "empty", "too-deep", "text-plain", "no-content-type", "form"])
async def test_a_body_that_is_no_json_object_is_one_line_naming_it(api, content, content_type, status, says):
    http, router, _ = api
    headers = {"content-type": content_type} if content_type else {}
    error = error_of(await http.post("/v1/completions", content=content, headers=headers), status)
    assert says in error["message"] and "valid dictionary" not in error["message"], error
    assert router.requests == []


@pytest.mark.parametrize("method,path,status,says", [
    ("GET", "/v1/nope", 404, "GET /v1/nope: no such route; this server serves /v1/completions"),
    ("POST", "/v1/completions/extra", 404, "no such route"),
    ("GET", "/v1/completions", 405, "GET /v1/completions: method not allowed; use POST"),
    ("DELETE", "/v1/models", 405, "use GET"),
], ids=["unknown", "unknown-under-a-route", "get-completions", "delete-models"])
async def test_starlettes_own_errors_come_in_openais_shape(api, method, path, status, says):
    http, _, _ = api
    response = await http.request(method, path)
    error = error_of(response, status)
    assert says in error["message"] and "detail" not in response.json(), error
    if status == 405:
        assert response.headers.get("allow"), "a 405 says which methods the route takes"


@pytest.mark.parametrize("model", [SERVED, "tiny", MODEL_PATH, None], ids=["served", "bus", "path", "none"])
async def test_the_model_answers_to_its_every_name(api, model):
    http, router, _ = api
    response = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "model": model})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == SERVED and router.requests[0].model == "tiny"


async def test_an_unknown_model_is_a_404_naming_the_names_to_use_not_the_path(api):
    http, router, _ = api
    error = error_of(await http.post("/v1/completions", json={"prompt": "a", "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert f"send model={SERVED!r} (or 'tiny')" in error["message"], error
    assert MODEL_PATH not in error["message"], "a path on the server is no client's business"
    assert router.requests == []


def test_a_request_over_the_bus_message_bound_is_a_413():
    error = from_tandem(RequestTooLargeError("the request is 9,000,000 bytes on the bus", "r1", "prompt"), "prompt")
    assert (error.status, error.body.error.code, error.body.error.param) == (413, "request_too_large", "prompt")
    assert error.body.error.type == "invalid_request_error"


def test_the_default_limits_are_the_settings_defaults():
    from tandem.shared.infra.config import FrontendSettings

    defaults = FrontendSettings()
    assert HTTPLimits() == HTTPLimits.of(defaults)
    assert HTTPLimits().max_body_bytes == defaults.max_body_mib * 1024 * 1024


async def test_the_consoles_services_pane_counts_the_answers_the_gate_counted(api):
    """The front end serves no $SRV endpoint: the console's row takes its requests from the
    ``tandem:http_requests_total`` the Gate counts (health probes and scrapes left out, as the
    console's own polls are for the bus services)."""
    from tandem.console.state import service_row

    http, _, prom = api
    assert (await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code == 200
    assert (await http.post("/v1/completions", json={"prompt": ["a"] * 4})).status_code == 400
    assert (await http.get("/v1/nope")).status_code == 404
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/metrics")).status_code == 200
    stats = {"name": "tandem-frontend", "metadata": {"instance_id": "fe-1"}, "endpoints": []}
    row = service_row(stats, 0.0, {("frontend", "fe-1"): prom.snapshot("frontend", "fe-1", "host")})
    assert (row.service, row.requests, row.errors) == ("frontend", 3, 0), row
    assert row.mean_latency_s > 0, "the finished completion's time is the row's mean latency"
    assert service_row(stats, 0.0).requests == 0, "no snapshot yet: nothing counted"


def test_the_in_flight_bound_counts_prompts():
    from tandem.services.frontend.errors import APIError
    from tandem.services.frontend.limits import check_in_flight

    check_in_flight(0, 100, 8)  # idle: any one request
    check_in_flight(5, 3, 8)
    with pytest.raises(APIError) as refused:
        check_in_flight(6, 3, 8)
    assert refused.value.status == 429 and "--max-concurrent-requests" in refused.value.message

