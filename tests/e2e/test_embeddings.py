"""``/v1/embeddings`` with the official ``openai`` client, against real services.

One system per module: a router and a decode worker (which prefills by itself, so embeddings and
generation share its batches) on the session's nats-server, a plain frontend and one with an API
key and a served model name. The vectors must be what the bus client's ``embed`` returns, the same
whether sent as floats, as base64 or decoded by the SDK itself, unit norm, equal for equal inputs
and for an input's text and token ids; ``dimensions`` keeps the leading components normalised
again; bad requests are one-line 400s naming their field and disturb no generation stream beside
them; the route counts in the frontend's metrics and takes the API key like the others.

Run: ``python3 -m pytest -q tests/e2e/test_embeddings.py``.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct

import httpx
import openai
import pytest
from cli_support import launch, run_sync
from support import assert_pools_free, prompt_of
from test_openai_api import frontend_urls

from tandem.cli.supervisor import wait_until_ready
from tandem.client import connect
from tandem.shared.text.tokenizer import ByteTokenizer

pytestmark = pytest.mark.e2e

KEY = "sekrit-key"
SERVED = "tandem-tiny"
CONTEXT = 256
HIDDEN = 256  # the tiny model's hidden size
TEXTS = ["def fibonacci(n):", "import os\nimport sys", "class Stack:\n    pass", prompt_of(120)]
TOLERANCE = 1e-5  # one input's vector batched beside different rows (fp32 on the CPU)


@pytest.fixture(scope="module")
def api(start_system):
    system = start_system(prefill=0, decode=1, decode_args=["--num-blocks", "200", "--max-model-len", str(CONTEXT)])
    frontends = {"frontend-embed": [], "frontend-embed-keyed": ["--api-key", KEY, "--served-model-name", SERVED]}
    for name, args in frontends.items():
        system.processes[name] = launch(system.url, "frontend", name, system.logdir, system.env,
                                        ["--http-port", "0", *args])
    run_sync(wait_until_ready(system.url, {"frontend": list(frontends)}, system.check_alive, 60))
    system.http = run_sync(frontend_urls(system.url))
    yield system


def client_for(api, name: str = "frontend-embed", key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.http[name]}/v1", api_key=key, max_retries=0, timeout=60)


def norm(vector) -> float:
    return math.sqrt(sum(x * x for x in vector))


def close(a, b, tolerance: float = TOLERANCE) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tolerance


async def test_float_base64_and_the_sdks_own_decoding_agree_with_the_bus_client(api):
    async with connect(api.url) as bus:
        expected = await bus.embed(TEXTS)
    client = client_for(api)
    as_floats, as_base64, sdk_decoded = await asyncio.gather(
        client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float"),
        client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64"),
        client.embeddings.create(model="tiny", input=TEXTS))  # the SDK asks for base64 and decodes it itself
    for result in (as_floats, as_base64, sdk_decoded):
        assert result.object == "list" and result.model == "tiny"
        assert [d.index for d in result.data] == list(range(len(TEXTS))) and {d.object for d in result.data} == {
            "embedding"}
        tokens = sum(e.prompt_tokens for e in expected)
        assert (result.usage.prompt_tokens, result.usage.total_tokens) == (tokens, tokens)
    for i, want in enumerate(expected):
        floats = as_floats.data[i].embedding
        raw = base64.b64decode(as_base64.data[i].embedding)
        assert len(raw) == 4 * HIDDEN, "base64 is not the vector's float32 bytes"
        # Three requests, batched differently: equal within float tolerance, not bit for bit.
        assert close(struct.unpack(f"<{HIDDEN}f", raw), floats), "base64 is not the floats' little-endian float32"
        assert close(sdk_decoded.data[i].embedding, floats)
        assert len(floats) == HIDDEN and norm(floats) == pytest.approx(1.0, abs=1e-5)
        assert close(floats, want.vector), f"input {i}: HTTP and the bus client differ"
        assert want.pooling == "last" and want.prompt_tokens == len(ByteTokenizer().encode(TEXTS[i]))


async def test_token_ids_equal_their_text_and_equal_inputs_give_equal_vectors(api):
    ids = [ByteTokenizer().encode(text) for text in TEXTS[:2]]
    client = client_for(api)
    texts, one_list, lists = await asyncio.gather(
        client.embeddings.create(model="tiny", input=[TEXTS[0], TEXTS[0], TEXTS[1]], encoding_format="float"),
        client.embeddings.create(model="tiny", input=ids[0], encoding_format="float"),
        client.embeddings.create(model="tiny", input=ids, encoding_format="float"))
    same, again, other = (d.embedding for d in texts.data)
    assert close(same, again), "the same input gave different vectors"
    assert not close(same, other, 1e-3), "different inputs gave the same vector"
    assert close(one_list.data[0].embedding, same) and one_list.usage.prompt_tokens == len(ids[0])
    assert close(lists.data[0].embedding, same) and close(lists.data[1].embedding, other)


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_dimensions_keep_the_leading_components_normalised_again(api, pooling: str):
    client = client_for(api)
    asked = dict(model="tiny", input=TEXTS[2], encoding_format="float", extra_body={"pooling": pooling})
    full, short = await asyncio.gather(client.embeddings.create(**asked),
                                       client.embeddings.create(**asked, dimensions=16))
    head = full.data[0].embedding[:16]
    assert close(short.data[0].embedding, [x / norm(head) for x in head])
    async with connect(api.url) as bus:
        (on_bus,) = await bus.embed(TEXTS[2], pooling=pooling)
        (default,) = await bus.embed(TEXTS[2])
    assert on_bus.pooling == pooling and close(full.data[0].embedding, on_bus.vector)
    assert close(default.vector, on_bus.vector) == (pooling == "last"), "the tiny model's default is last-token"


BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": [65, 300]}, "input"),  # a token id outside the 256-byte vocabulary
    ({"input": [[65], [-1]]}, "input"),
    ({"input": "x" * (CONTEXT + 1)}, "input"),  # one more token than the context holds (with BOS)
    ({"input": [["a"]]}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": "x", "pooling": "cls"}, "pooling"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "model": "no-such-model"}, "model"),
]


async def test_bad_requests_are_one_line_errors_naming_the_field_beside_a_live_stream(api):
    """Every bad request while a greedy stream runs: a 400 (404 for the model) naming its field in
    one line; the stream ends with exactly the tokens it gives alone; the pools end empty."""
    prompt = prompt_of(48, salt=3)
    async with connect(api.url) as bus:
        alone = await bus.complete(prompt, max_tokens=192, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        streaming = asyncio.Event()

        async def follow() -> None:
            async for chunk in bus.generate(prompt, max_tokens=192, temperature=0.0, ignore_eos=True):
                tokens.extend(chunk.token_ids)
                streaming.set()

        stream = asyncio.ensure_future(follow())
        async with httpx.AsyncClient(base_url=api.http["frontend-embed"], timeout=60) as http:
            await streaming.wait()
            answers = await asyncio.gather(*(http.post("/v1/embeddings", json=body) for body, _ in BAD))
            valid = await http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "float"})
            still_running = not stream.done()
        await stream
        (reference,) = await bus.embed(TEXTS[1])
    for (body, param), answer in zip(BAD, answers):
        error = answer.json()["error"]
        assert answer.status_code == (404 if param == "model" else 400), (body, answer.text)
        assert error["param"] == param, (body, error)
        assert "\n" not in error["message"] and error["message"], (body, error)
    assert valid.status_code == 200 and close(valid.json()["data"][0]["embedding"], reference.vector)
    assert still_running, "the stream ended before the requests beside it: the test checks nothing"
    assert tokens == alone.token_ids, "the stream beside the bad requests changed"
    await assert_pools_free(api.url)


async def test_the_api_key_the_served_name_and_the_metrics(api):
    keyed = api.http["frontend-embed-keyed"]
    async with httpx.AsyncClient(base_url=keyed, timeout=60) as http:
        refused = await http.post("/v1/embeddings", json={"input": "x"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        accepted = await http.post("/v1/embeddings", json={"input": ["x", "yz"], "model": SERVED},
                                   headers={"Authorization": f"Bearer {KEY}"})
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["model"] == SERVED and accepted.json()["usage"]["prompt_tokens"] == 1 + 2
        page = (await http.get("/metrics")).text
    assert 'tandem:http_requests_total{handler="/v1/embeddings",status="200"} 1.0' in page, page
    assert 'tandem:http_requests_total{handler="/v1/embeddings",status="401"} 1.0' in page
    assert 'tandem:request_success_total{finished_reason="embedded"} 2.0' in page
    assert "tandem:http_prompt_tokens_total 3.0" in page
