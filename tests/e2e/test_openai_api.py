"""The OpenAI-compatible frontend with the official ``openai`` client, against real services over real sockets.

One system per module (router, prefill, decode on the session's nats-server) and three frontends on
it: a plain one, one with an API key and a served model name, one admitting a single request at a
time. The router is stopped by the last test (503s), so keep that one last.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx
import openai
import pytest
from cli_support import TANDEM, launch, run_sync
from support import assert_pools_free, prompt_of

from tandem.cli.supervisor import wait_until_ready
from tandem.client import connect
from tandem.client.discovery import service_infos
from tandem.shared.text.chat_template import tiny_template
from tandem.shared.text.tokenizer import ByteTokenizer

KEY = "sekrit-key"
SERVED = "tandem-tiny"
CONTEXT = 256  # --max-model-len of the decode worker: small, so the context limit is easy to reach
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


async def frontend_urls(url: str) -> dict[str, str]:
    import nats

    nc = await nats.connect(url)
    try:
        infos = await service_infos(nc, name="tandem-frontend")
    finally:
        await nc.close()
    return {i["metadata"]["instance_id"]: i["metadata"]["http_url"] for i in infos}


@pytest.fixture(scope="module")
def api(start_system):
    system = start_system(prefill=1, decode=1, decode_args=["--num-blocks", "200", "--max-model-len", str(CONTEXT)])
    frontends = {"frontend-plain": [], "frontend-keyed": ["--api-key", KEY, "--served-model-name", SERVED],
                 "frontend-one": ["--max-concurrent-requests", "1"]}
    for name, args in frontends.items():
        system.processes[name] = launch(system.url, "frontend", name, system.logdir, system.env,
                                        ["--http-port", "0", *args])
    run_sync(wait_until_ready(system.url, {"frontend": len(frontends)}, system.check_alive, 60))
    system.http = run_sync(frontend_urls(system.url))
    yield system
    for name in frontends:
        if name in system.processes:
            system.stop(name)


def client_for(api, name: str = "frontend-plain", key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.http[name]}/v1", api_key=key, max_retries=0, timeout=60)


async def test_completion_matches_the_bus_client_with_usage(api):
    prompt = prompt_of(40)
    async with connect(api.url) as bus:
        expected = await bus.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    result = await client_for(api).completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
    assert result.choices[0].text == expected.text, "HTTP and NATS must give the same greedy text"
    assert result.choices[0].finish_reason == "length" and result.choices[0].index == 0
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (40, 12, 52)
    assert result.id.startswith("cmpl-") and result.model == "tiny" and result.created > 0 and \
        result.object == "text_completion"


def token_text(token_id: int) -> str:
    return ByteTokenizer().decode([token_id])  # the tiny model's tokenizer


async def test_completion_logprobs_equal_the_bus_clients(api):
    """The first token's logprobs come from the prefill worker, the others from decode: both reach
    the bus client and the HTTP answer, whole and streamed, as the same numbers."""
    prompt = prompt_of(33)
    async with connect(api.url) as bus:
        expected = await bus.complete(prompt, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    assert len(expected.logprobs) == 10 and all(len(e.top) == 3 for e in expected.logprobs)
    assert expected.cumulative_logprob == pytest.approx(sum(e.logprob for e in expected.logprobs))
    for token, entry in zip(expected.token_ids, expected.logprobs):  # greedy: the most likely token
        assert entry.logprob == pytest.approx(entry.top[0][1]) and entry.logprob <= 0
        assert token == entry.top[0][0] or entry.top[0][1] == entry.top[1][1]  # (ties aside)

    client = client_for(api)
    result = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=3, **GREEDY)
    shaped = result.choices[0].logprobs
    assert shaped.tokens == [token_text(t) for t in expected.token_ids]
    # Approximate: a CPU forward's last bits depend on what else shares the batch.
    assert shaped.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    for top, token, entry in zip(shaped.top_logprobs, expected.token_ids, expected.logprobs):
        want = {token_text(i): v for i, v in entry.top}
        want.setdefault(token_text(token), entry.logprob)  # the sampled token is always there
        assert top == pytest.approx(want, abs=1e-4)
    offsets = [sum(len(token) for token in shaped.tokens[:i]) for i in range(len(shaped.tokens))]
    assert shaped.text_offset == offsets

    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=3, stream=True,
                                             **GREEDY)
    pieces = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.token_logprobs] == pytest.approx(shaped.token_logprobs, abs=1e-4)
    assert [o for p in pieces for o in p.text_offset] == shaped.text_offset

    plain = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == result.choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_top_logprobs_equal_the_bus_clients(api, stream):
    messages = [{"role": "user", "content": "a function"}]
    rendered = tiny_template().render(messages, add_generation_prompt=True)
    async with connect(api.url) as bus:
        expected = await bus.complete(rendered, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    client = client_for(api)
    asked = dict(model="tiny", messages=messages, max_completion_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    if stream:
        content = [t for c in [c async for c in await client.chat.completions.create(stream=True, **asked)]
                   if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    else:
        content = (await client.chat.completions.create(**asked)).choices[0].logprobs.content
    assert [t.token for t in content] == [token_text(t) for t in expected.token_ids]
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert [t.bytes for t in content] == [list(token_text(t).encode()) for t in expected.token_ids]
    assert [[a.token for a in t.top_logprobs] for t in content] == \
        [[token_text(i) for i, _ in e.top] for e in expected.logprobs]
    assert [[a.logprob for a in t.top_logprobs] for t in content] == \
        [pytest.approx([v for _, v in e.top], abs=1e-4) for e in expected.logprobs]


async def test_streamed_completion_joins_to_the_whole_and_ends_with_usage(api):
    client = client_for(api)
    whole = await client.completions.create(model="tiny", prompt=prompt_of(30), max_tokens=10, **GREEDY)
    stream = await client.completions.create(model="tiny", prompt=prompt_of(30), max_tokens=10, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text, "the stream's pieces must join to the non-streamed text"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10, \
        "include_usage: a last chunk with no choices carries the usage"
    assert all(c.usage is None for c in chunks[:-1]), "usage comes once, at the end"


async def test_raw_stream_is_server_sent_events_ending_with_done(api):
    body = {"prompt": "def f(x):", "max_tokens": 5, "stream": True, "temperature": 0}
    async with httpx.AsyncClient() as http, \
            http.stream("POST", f"{api.http['frontend-plain']}/v1/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]", f"a stream must end with data: [DONE], got {lines[-3:]}"
    assert all(line.startswith("data: ") for line in lines)
    json.loads(lines[0].removeprefix("data: "))


@pytest.mark.parametrize("prompt,expected", [
    ([[100, 101, 102], list(b"import os")], [3, 9]),
    (["first prompt", "second"], [12, 6]),
    (list(b"token ids"), [9]),
], ids=["lists-of-token-ids", "strings", "token-ids"])
async def test_prompt_forms_give_one_choice_each(api, prompt, expected):
    result = await client_for(api).completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    assert [c.index for c in result.choices] == list(range(len(expected)))
    assert result.usage.prompt_tokens == sum(expected) and result.usage.completion_tokens == 3 * len(expected)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_renders_the_template_and_matches_the_rendered_completion(api, stream):
    """Text parts are joined by newlines, as vLLM joins them."""
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "a function"}, {"type": "text", "text": "!"}]}]
    rendered = tiny_template().render([{"role": "system", "content": "You write Python."},
                                       {"role": "user", "content": "a function\n!"}], add_generation_prompt=True)
    client = client_for(api)
    plain = await client.completions.create(model="tiny", prompt=rendered, max_tokens=8, **GREEDY)
    if stream:
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=8, stream=True,
            stream_options={"include_usage": True}, **GREEDY)]
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        result = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
        content, usage = result.choices[0].message.content, result.usage
        assert result.choices[0].message.role == "assistant" and result.id.startswith("chatcmpl-")
    assert content == plain.choices[0].text, "chat must be the completion of the template's rendering"
    assert usage.prompt_tokens == len(rendered.encode()) and usage.completion_tokens == 8


async def test_chat_without_a_limit_runs_to_the_end_of_the_context(api):
    result = await client_for(api).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                           **GREEDY)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.total_tokens == CONTEXT, "no max_tokens: what the context leaves after the prompt"


async def test_stop_string_ends_the_text_before_it(api):
    client = client_for(api)
    free = await client.completions.create(model="tiny", prompt=prompt_of(24), max_tokens=30, temperature=0.9,
                                           seed=3, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    start = next(i for i in range(3, len(text) - 1) if all(c.isascii() and c.isprintable() for c in text[i:i + 2]))
    stop = text[start:start + 2]
    stopped = await client.completions.create(model="tiny", prompt=prompt_of(24), max_tokens=30, temperature=0.9,
                                              seed=3, stop=stop, extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop", f"{stop!r} in {text!r} did not stop it"
    assert stopped.choices[0].text == text[:text.index(stop)]


BAD_BODIES = [
    ({"temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"top_p": 0}, 400, "top_p", "greater than 0"),
    ({"top_k": -5}, 400, "top_k", "greater than or equal to -1"),
    ({"max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"seed": -1}, 400, "seed", "greater than or equal to 0"),
    ({"stop": [""]}, 400, "stop", "at least 1 character"),
    ({"n": 65}, 400, "n", "less than or equal to 64"),
    ({"n": 2, "best_of": 1}, 400, "best_of", "best_of (1) must be at least n (2)"),
    ({"logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ({"logprobs": True}, 400, "logprobs", "integer"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", "less than or equal to 2"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ({"min_tokens": 5}, 400, "min_tokens", "min_tokens (5) must not exceed max_tokens (4)"),
    ({"logit_bias": {"a": 1}}, 400, "logit_bias", "keys are token ids"),
    ({"logit_bias": {"259": 1}}, 400, "logit_bias", "outside the vocabulary of 259 tokens"),  # the router's check
    ({"use_beam_search": True}, 400, "n", "more than one beam"),
    ({"use_beam_search": True, "n": 2, "stop": "x"}, 400, "stop", "do not apply to beam search"),
    ({"length_penalty": 2.0}, 400, "length_penalty", "beam search only"),
    ({"prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "not with stream"),
    ({"echo": True}, 400, "echo", "not supported"),
    ({"temperature": "hot"}, 400, "temperature", "valid number"),
    ({"model": "gpt-4"}, 404, "model", "does not exist"),
    ({"max_tokens": CONTEXT}, 400, "max_tokens", "at most"),
    ({"prompt": "x" * CONTEXT}, 400, "prompt", "context holds"),
    ({"prompt": ""}, 400, "prompt", "empty"),
]


@pytest.mark.parametrize("change,status,param,says", BAD_BODIES, ids=[f"{next(iter(c))}={c[next(iter(c))]!r}"[:40]
                                                                     for c, *_ in BAD_BODIES])
async def test_bad_values_get_openai_errors_by_status_and_shape(api, change, status, param, says):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **change}
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{api.http['frontend-plain']}/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and says in error["message"], error
    assert "Traceback" not in response.text


async def test_the_sdk_raises_its_typed_errors(api):
    client = client_for(api)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             max_completion_tokens=0)
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{api.http['frontend-plain']}/v1/completions", content=b"{not json",
                                   headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


async def test_chat_min_tokens_past_what_the_context_leaves_names_it(api):
    """No max_tokens: the router grants what the context leaves, and refuses a min_tokens above it."""
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{api.http['frontend-plain']}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "min_tokens": CONTEXT})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "min_tokens" and "ask for at most" in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_n_samples_are_one_choice_each(api, stream):
    """Waits on the engine's parallel sampling (n > 1 streams of sample_index 0..n-1)."""
    asked = dict(model="tiny", prompt=[prompt_of(12), prompt_of(9, salt=1)], n=3, max_tokens=5, temperature=1.0,
                 seed=5, extra_body={"ignore_eos": True})
    client = client_for(api)
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **asked,
                                                                    stream_options={"include_usage": True})]
        texts: dict[int, str] = {}
        for piece in chunks:
            for choice in piece.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        finished = {c.index for piece in chunks for c in piece.choices if c.finish_reason == "length"}
        usage = chunks[-1].usage
    else:
        result = await client.completions.create(**asked)
        texts = {c.index: c.text for c in result.choices}
        finished = {c.index for c in result.choices if c.finish_reason == "length"}
        usage = result.usage
    assert sorted(texts) == list(range(6)) and finished == set(range(6)), "choice p * n + i for prompt p's output i"
    assert (usage.prompt_tokens, usage.completion_tokens) == (21, 30), "every output's tokens, each prompt's once"
    assert len({texts[0], texts[1], texts[2]}) > 1, "three samples of one prompt at temperature 1 all alike"


async def test_beam_search_over_http_equals_the_bus_clients(api):
    """Waits on the engine's beam search: use_beam_search with best_of beams returns the n best, as
    ``Client.beam_search`` does."""
    prompt = prompt_of(20)
    async with connect(api.url) as bus:
        expected = await bus.beam_search(prompt, beam_width=3, n=2, max_tokens=6, ignore_eos=True)
    result = await client_for(api).completions.create(model="tiny", prompt=prompt, n=2, best_of=3, max_tokens=6,
                                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1]
    assert [c.text for c in result.choices] == [o.text for o in expected.outputs]


async def test_logit_bias_decides_a_greedy_choice(api):
    """Waits on the engine's logit bias: +100 on "Z" makes greedy decoding write only Z."""
    result = await client_for(api).completions.create(model="tiny", prompt=prompt_of(10), max_tokens=4,
                                                      logit_bias={str(ord("Z")): 100}, **GREEDY)
    assert result.choices[0].text == "ZZZZ"


async def test_prompt_logprobs_come_per_prompt_token(api):
    """Waits on the engine's prompt logprobs (vLLM's shape: None first, then token id -> logprob)."""
    prompt = prompt_of(17)
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{api.http['frontend-plain']}/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    shaped = response.json()["choices"][0]["prompt_logprobs"]
    assert len(shaped) == 17 and shaped[0] is None
    for token, position in zip(prompt.encode()[1:], shaped[1:]):
        assert str(token) in position and len(position) >= 2
        assert all(entry["logprob"] <= 0 for entry in position.values())


async def test_api_key_and_served_model_name(api):
    with pytest.raises(openai.AuthenticationError):
        await client_for(api, "frontend-keyed", "wrong").completions.create(model=SERVED, prompt="x", max_tokens=2)
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{api.http['frontend-keyed']}/v1/models")
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        health = await http.get(f"{api.http['frontend-keyed']}/health")
        assert health.status_code == 200, "only /v1/ routes need the key"
    client = client_for(api, "frontend-keyed", KEY)
    models = await client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    result = await client.completions.create(model=SERVED, prompt="x", max_tokens=2, **GREEDY)
    assert result.model == SERVED and result.usage.completion_tokens == 2


async def test_models_health_version_and_metrics(api):
    async with httpx.AsyncClient() as http:
        base = api.http["frontend-plain"]
        models = (await http.get(f"{base}/v1/models")).json()
        assert [(m["id"], m["object"], m["max_model_len"], m["vocab_size"]) for m in models["data"]] == [
            ("tiny", "model", CONTEXT, 259)]
        assert (await http.get(f"{base}/health")).status_code == 200
        assert (await http.get(f"{base}/version")).json()["version"]
        page = (await http.get(f"{base}/metrics")).text
    for name in ("tandem:http_time_to_first_token_seconds_bucket", "tandem:http_e2e_request_latency_seconds_count",
                 'tandem:request_success_total{finished_reason="length"}', "tandem:http_generation_tokens_total",
                 'tandem:http_requests_total{handler="/v1/completions",status="400"}',
                 "tandem:http_generation_requests_running"):
        assert name in page, f"{name} missing from the frontend's /metrics"


async def test_over_the_limit_gets_429(api):
    client = client_for(api, "frontend-one")
    first = await client.completions.create(model="tiny", prompt=prompt_of(20), max_tokens=200, stream=True, **GREEDY)
    await first.__anext__()
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model="tiny", prompt="x", max_tokens=2)
    await first.close()
    await asyncio.sleep(0.3)
    await client.completions.create(model="tiny", prompt="x", max_tokens=2)  # admitted again


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_client_that_disconnects_frees_its_blocks(api, stream):
    body = {"model": "tiny", "prompt": prompt_of(60), "max_tokens": CONTEXT - 61, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    url = f"{api.http['frontend-plain']}/v1/completions"
    async with httpx.AsyncClient() as http:
        if stream:
            async with http.stream("POST", url, json=body) as response:
                events = response.aiter_lines()
                while not (await events.__anext__()).startswith("data: "):
                    pass
        else:
            # Gone long before the answer, with the request already held: the frontend has it within
            # milliseconds, its 195 tokens take a few hundred (a 0.5 s wait once saw the whole answer
            # on a fast CI machine).
            with pytest.raises(httpx.ReadTimeout):
                await http.post(url, json=body, timeout=0.1)
    await assert_pools_free(api.url, timeout_s=10)


def test_a_port_in_use_is_one_line_naming_the_flag(api):
    port = api.http["frontend-plain"].rsplit(":", 1)[1]
    done = subprocess.run([*TANDEM, "serve", "frontend", "--nats-url", api.url, "--http-port", port],
                          env=api.env, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "--http-port" in lines[0], done.stderr


def test_sigterm_stops_a_frontend_cleanly(api):
    process = api.processes["frontend-one"]
    api.stop("frontend-one")
    assert process.returncode == 0, f"exit code {process.returncode}"


async def test_no_router_gives_503_and_unhealthy(api):
    """Last: stops the router."""
    api.stop(api.instance("router"))
    async with httpx.AsyncClient() as http:
        base = api.http["frontend-plain"]
        response = await http.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and "no router" in response.json()["error"]["message"], response.text
        assert (await http.get(f"{base}/health")).status_code == 503
