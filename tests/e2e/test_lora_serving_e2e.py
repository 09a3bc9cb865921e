"""LoRA adapters served by real services, asked for with the official ``openai`` client.

A router started with ``--lora-modules`` serves one adapter from the start; another is loaded at run
time through vLLM's ``/v1/load_lora_adapter`` while a stream of the first runs on, then unloaded. An
adapter's greedy output over HTTP, prefilled on a prefill worker and decoded on a decode worker, equals
an in-process engine's with the same adapter (the workers' K/V and tokens are the adapter's, not the
base model's); bad adapters and unknown names are one-line 400s and 404s that disturb nothing.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from cli_support import launch, run_sync
from factories import make_engine, make_request, run
from test_openai_api import frontend_urls

from tandem.cli.supervisor import wait_until_ready
from tandem.shared.lora.peft_format import TARGETS, AdapterConfig, LoraWeights, projection_shapes, save_adapter
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.adapters import AdapterRef

pytestmark = pytest.mark.e2e

PROMPT = "def fibonacci(n):"
SLOT_ARGS = ["--max-loras", "2", "--max-lora-rank", "8"]


def random_adapter(directory, rank: int, targets: tuple[str, ...], seed: int):  # noqa: ANN001, ANN201
    """A PEFT adapter of the tiny model with random A and B, large enough to change its greedy text."""
    config = ModelConfig.tiny()
    shapes = projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    a, b = {}, {}
    for layer in range(config.num_layers):
        for target in targets:
            out_features, in_features = shapes[target]
            a[(layer, target)] = torch.randn(rank, in_features, generator=generator) * 0.2
            b[(layer, target)] = torch.randn(out_features, rank, generator=generator) * 0.2
    return save_adapter(directory, LoraWeights(AdapterConfig(rank, 2.0 * rank, targets), a, b))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"e2e-alpha": random_adapter(root / "alpha", 8, TARGETS, 1),
            "e2e-beta": random_adapter(root / "beta", 4, ("q_proj", "v_proj", "down_proj"), 2),
            "e2e-wide": random_adapter(root / "wide", 16, ("q_proj",), 3)}


@pytest.fixture(scope="module")
def api(start_system, adapters):
    system = start_system(prefill=1, decode=1, prefill_args=SLOT_ARGS, decode_args=SLOT_ARGS,
                          router_args=["--lora-modules", f"e2e-alpha={adapters['e2e-alpha']}"])
    system.processes["frontend-lora"] = launch(system.url, "frontend", "frontend-lora", system.logdir, system.env,
                                               ["--http-port", "0", "--allow-runtime-lora-updating"])
    run_sync(wait_until_ready(system.url, {"frontend": ["frontend-lora"]}, system.check_alive, 60))
    system.http = run_sync(frontend_urls(system.url))["frontend-lora"]
    yield system
    for name in adapters:  # the session's bus outlives this module: leave no adapter published on it
        httpx.post(f"{system.http}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def client_for(api) -> openai.AsyncOpenAI:  # noqa: ANN001
    return openai.AsyncOpenAI(base_url=f"{api.http}/v1", api_key="unused", max_retries=0, timeout=120)


def in_process_greedy(adapter_dir, max_tokens: int) -> list[int]:  # noqa: ANN001
    """The same request in an in-process engine with the adapter (None: the base model)."""
    loaded = load_model("tiny")
    engine = make_engine(loaded, max_loras=1, max_lora_rank=8)
    adapter = None if adapter_dir is None else AdapterRef(name="x", version="1", path=str(adapter_dir))
    prompt = loaded.tokenizer.encode(PROMPT)
    return run(engine, [make_request("r", prompt, max_tokens=max_tokens, adapter=adapter)])["r"].tokens


async def greedy_tokens(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> tuple[str, list[int]]:
    done = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                           logprobs=1, extra_body={"ignore_eos": True})
    tokens = done.choices[0].logprobs.tokens
    return done.choices[0].text, tokens


def test_models_lists_adapters_with_their_parent(api) -> None:
    async def go():
        return await client_for(api).models.list()

    cards = {card.id: card for card in run_sync(go()).data}
    assert "e2e-alpha" in cards, f"the --lora-modules adapter is not listed: {sorted(cards)}"
    base = next(card for card in cards.values() if getattr(card, "parent", None) is None)
    assert cards["e2e-alpha"].parent == base.id, f"e2e-alpha's parent is {cards['e2e-alpha'].parent!r}"


def test_adapter_output_equals_in_process_engine(api, adapters) -> None:
    """Prefilled remotely and decoded, over HTTP: the adapter's greedy tokens, not the base model's."""
    async def go():
        client = client_for(api)
        return await asyncio.gather(greedy_tokens(client, "e2e-alpha", 24), greedy_tokens(client, "tiny", 24))

    (adapter_text, _), (base_text, _) = run_sync(go())
    loaded = load_model("tiny")
    expected = loaded.tokenizer.decode(in_process_greedy(adapters["e2e-alpha"], 24))
    assert adapter_text == expected, f"adapter output over HTTP {adapter_text!r} != in-process {expected!r}"
    assert base_text == loaded.tokenizer.decode(in_process_greedy(None, 24))
    assert adapter_text != base_text, "the adapter did not change the output: a weak test"


def test_load_serve_unload_while_another_stream_runs(api, adapters) -> None:
    async def go():
        client = client_for(api)
        stream = await client.completions.create(model="e2e-alpha", prompt=PROMPT, max_tokens=200, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        texts: list[str] = []

        async def read() -> str | None:
            reason = None
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            return reason

        reader = asyncio.ensure_future(read())
        async with httpx.AsyncClient(base_url=api.http, timeout=60) as http:
            loaded = await http.post("/v1/load_lora_adapter",
                                     json={"lora_name": "e2e-beta", "lora_path": str(adapters["e2e-beta"])})
            beta = await client.completions.create(model="e2e-beta", prompt=PROMPT, max_tokens=8, temperature=0)
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "e2e-beta"})
            with pytest.raises(openai.NotFoundError) as gone:
                await client.completions.create(model="e2e-beta", prompt=PROMPT, max_tokens=8)
        return loaded, beta, unloaded, gone.value, await reader, texts

    loaded, beta, unloaded, gone, reason, texts = run_sync(go())
    assert loaded.status_code == 200 and "e2e-beta" in loaded.text, loaded.text
    assert beta.model == "e2e-beta" and beta.choices[0].finish_reason == "length"
    assert unloaded.status_code == 200, unloaded.text
    assert "e2e-beta" in str(gone), f"the 404 does not name the adapter: {gone}"
    assert reason == "length" and len("".join(texts)) > 0, "the stream beside the load and unload did not finish"


@pytest.mark.parametrize("body, status, words", [
    ({"lora_name": "e2e-missing", "lora_path": "/nonexistent/adapter"}, 400, "does not exist"),
    ({"lora_name": "e2e-wide", "lora_path": "WIDE"}, 400, "--max-lora-rank"),
    ({"lora_name": "e2e-nopath"}, 400, "lora_path"),
])
def test_bad_adapters_are_one_line_errors(api, adapters, body: dict, status: int, words: str) -> None:
    if body.get("lora_path") == "WIDE":
        body = {**body, "lora_path": str(adapters["e2e-wide"])}
    answer = httpx.post(f"{api.http}/v1/load_lora_adapter", json=body, timeout=30)
    message = answer.json()["error"]["message"]
    assert answer.status_code == status and words in message and "\n" not in message, (answer.status_code, message)


def test_unknown_adapter_is_404(api) -> None:
    async def go():
        with pytest.raises(openai.NotFoundError) as caught:
            await client_for(api).chat.completions.create(model="no-such-adapter", max_tokens=4,
                                                          messages=[{"role": "user", "content": "hi"}])
        return caught.value

    error = run_sync(go())
    assert "no-such-adapter" in str(error) and "e2e-alpha" in str(error), str(error)
    answer = httpx.post(f"{api.http}/v1/unload_lora_adapter", json={"lora_name": "no-such-adapter"}, timeout=30)
    assert answer.status_code == 404, answer.text
