"""The HTTP API's answers for requests of several outputs, shaped from real ``StreamChunk``
messages: the frontend app (in process, over httpx's ASGI transport) with its real bus client on
the session's nats-server, the router played by the test (``scripted_router``). One choice per
output (prompt ``p``'s output ``i`` is choice ``p * n + i``), streamed and not, ``[DONE]`` only
after every choice ended, usage counting every output, held outputs in their rank, and the
bus request each API request became."""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_router import ScriptedRouter, chunk, prompt_ids

from tandem.client import connect
from tandem.services.frontend.app import Frontend, ServedModel, build_app
from tandem.shared.protocol.serving import TokenLogprobs
from tandem.shared.text.chat_template import tiny_template
from tandem.shared.text.tokenizer import ByteTokenizer


def samples(request):
    """Each output i of the request: its letter (a, b, c, ...) twice, interleaved with the others',
    the first output ending last; cumulative logprobs rank the last output first."""
    n = request.params.num_candidates
    letters = [ord("a") + i for i in range(n)]
    steps = [chunk(request, i, 0, [letters[i]]) for i in range(n)]
    steps += [chunk(request, i, 1, [letters[i]], finish_reason="length", cumulative_logprob=-float(n - i))
              for i in range(n - 1, -1, -1)]
    return steps


@pytest.fixture
async def api(nats_server):
    """``await api(script)`` -> (an httpx client on the app, the router playing ``script``)."""
    opened = []

    async def start(script):
        router = await ScriptedRouter.start(nats_server.url, script)
        bus = connect(nats_server.url, worker_timeout_s=5)
        client = await bus.__aenter__()

        async def models() -> dict[str, int | None]:
            return {"tiny": 259}

        async def alive() -> bool:
            return True

        frontend = Frontend(client=client, model=ServedModel("tiny", "tiny", ByteTokenizer(), tiny_template()),
                            api_key=None, max_concurrent_requests=8, router_models=models,
                            max_model_len=lambda _: 256, router_alive=alive)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)), base_url="http://api")
        opened.append((router, bus, http))
        return http, router

    yield start
    for router, bus, http in opened:
        await http.aclose()
        await bus.__aexit__(None, None, None)
        await router.close()


def events(body: str) -> list[dict | str]:
    """A server-sent events body as its payloads (``[DONE]`` as the string)."""
    out = []
    for line in body.splitlines():
        if line:
            assert line.startswith("data: "), line
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_one_choice_per_output_of_every_prompt(api):
    http, router = await api(samples)
    response = await http.post("/v1/completions", json={"prompt": ["ab", "xyz"], "n": 3, "max_tokens": 2,
                                                        "temperature": 0.8, "seed": 4})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "aa", "length"), (1, "bb", "length"), (2, "cc", "length"),
        (3, "aa", "length"), (4, "bb", "length"), (5, "cc", "length")], "choice p * n + i: prompt p's output i"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}, \
        "prompt tokens once per prompt, completion tokens of every output"
    assert [r.params.n for r in router.requests] == [3, 3] and router.requests[0].params.seed == 4


async def test_a_stream_carries_each_choices_index_and_ends_after_them_all(api):
    http, _ = await api(samples)
    response = await http.post("/v1/completions", json={"prompt": "ab", "n": 3, "max_tokens": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    payloads = events(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [p for p in payloads[:-1] if p["choices"]]
    texts: dict[int, str] = {}
    for piece in chunks:
        (choice,) = piece["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "aa", 1: "bb", 2: "cc"}
    finished = [p["choices"][0]["index"] for p in chunks if p["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2] and finished[-1] == 0, "the first output ended last, then [DONE]"
    assert payloads[-2]["usage"]["completion_tokens"] == 6 and payloads[-2]["choices"] == []


async def test_a_streamed_chat_opens_every_choice(api):
    http, _ = await api(samples)
    response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "n": 2, "max_tokens": 2, "stream": True})
    payloads = events(response.text)
    roles = [p["choices"][0]["index"] for p in payloads[:-1] if p["choices"][0]["delta"].get("role")]
    assert roles == [0, 1], "one assistant role delta per choice, first"
    content: dict[int, str] = {}
    for piece in payloads[:-1]:
        choice = piece["choices"][0]
        content[choice["index"]] = content.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert content == {0: "aa", 1: "bb"} and payloads[-1] == "[DONE]"


async def test_whole_chat_choices(api):
    http, _ = await api(samples)
    response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "n": 2, "max_tokens": 2})
    body = response.json()
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "aa"), (1, "bb")]
    assert body["usage"]["completion_tokens"] == 4


def ranked_beams(request):
    """Held outputs: whole, at the end, best first (rank = sample index)."""
    return [chunk(request, 1, 0, [66, 66], finish_reason="length", cumulative_logprob=-0.5),
            chunk(request, 0, 0, [65, 65, 65], finish_reason="stop", cumulative_logprob=-1.5)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_beam_search_choices_come_in_rank_order(api, stream):
    http, router = await api(ranked_beams)
    response = await http.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 3, "max_tokens": 3,
                                                        "use_beam_search": True, "length_penalty": 0.8,
                                                        "stream": stream})
    assert response.status_code == 200, response.text
    params = router.requests[0].params
    assert (params.beam_width, params.n, params.best_of, params.length_penalty) == (3, 2, None, 0.8)
    if stream:
        choices = [p["choices"][0] for p in events(response.text)[:-1]]
    else:
        choices = response.json()["choices"]
    assert sorted((c["index"], c["text"]) for c in choices) == [(0, "AAA"), (1, "BB")]


async def test_the_bus_request_carries_every_field(api):
    http, router = await api(lambda r: [chunk(r, i, 0, [97], finish_reason="stop") for i in range(r.params.n)])
    response = await http.post("/v1/completions", json={
        "prompt": "x", "n": 2, "best_of": 4, "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "repetition_penalty": 1.1, "min_tokens": 1, "logit_bias": {"97": 3, "10": -100}, "seed": 9, "max_tokens": 4})
    assert response.status_code == 200, response.text
    params = router.requests[0].params
    assert (params.n, params.best_of, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_tokens, params.seed) == (2, 4, 0.5, 0.25, 1.1, 1, 9)
    assert params.logit_bias == [(97, 3.0), (10, -100.0)]


@pytest.mark.parametrize("priority,status", [(-7, 200), (0, 200), (101, 400)])
async def test_priority_reaches_the_routers_queue_order(api, priority, status):
    http, router = await api(lambda r: [chunk(r, 0, 0, [97], finish_reason="stop")])
    response = await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "priority": priority})
    assert response.status_code == status, response.text
    if status == 200:
        assert router.requests[0].priority == priority
    else:
        assert response.json()["error"]["param"] == "priority" and router.requests == []


async def test_prompt_logprobs_in_vllms_shape(api):
    entries = [None, TokenLogprobs(logprob=-2.0, top=[(99, -0.5), (98, -2.0)]),
               TokenLogprobs(logprob=-4.0, top=[(97, -0.25)])]

    def script(request):
        assert prompt_ids(request) == [97, 98, 99]
        return [chunk(request, 0, 0, [100], finish_reason="length", prompt_logprobs=entries)]

    http, _ = await api(script)
    body = (await http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 1})).json()
    assert body["choices"][0]["prompt_logprobs"] == [
        None,
        {"98": {"logprob": -2.0, "rank": 2, "decoded_token": "b"}, "99": {"logprob": -0.5, "rank": 1,
                                                                          "decoded_token": "c"}},
        {"99": {"logprob": -4.0, "rank": None, "decoded_token": "c"}, "97": {"logprob": -0.25, "rank": 1,
                                                                             "decoded_token": "a"}},
    ]


async def test_a_refused_field_never_reaches_the_router(api):
    http, router = await api(samples)
    response = await http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"nope": 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"
    assert router.requests == []
