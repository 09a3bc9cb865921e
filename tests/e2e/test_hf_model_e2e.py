"""A Hugging Face model directory served end to end: router tokenizes with its tokenizer.json,
prefill and decode load its safetensors, and greedy output matches the contiguous reference."""

from __future__ import annotations

import asyncio
import random

import pytest
from model_support import make_hf_checkpoint

from tandem.client import UnknownModelError, connect
from tandem.shared.model.loader import load_model
from tandem.shared.model.reference import reference_generate

pytestmark = pytest.mark.slow  # Hugging Face checkpoints made and served through the whole path

LENGTHS = [1, 15, 16, 17, 31, 32, 33, 70]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def hf_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"hf-{request.param}")
    make_hf_checkpoint(request.param, directory)
    return directory


@pytest.fixture(scope="module")
def hf_system(start_system, hf_model):
    system = start_system(prefill=1, decode=1, model_args=["--model", str(hf_model)],
                          prefill_args=["--max-num-batched-tokens", "16"])
    yield system
    system.stop_all()  # the next parameter's system must not share the bus with this one


def test_hf_directory_parity_through_disaggregated_path(hf_system, hf_model):
    loaded = load_model(str(hf_model))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, loaded.config.vocab_size) for _ in range(n)] for n in LENGTHS]

    async def run():
        async with connect(hf_system.url) as client:
            return await asyncio.gather(*(
                client.complete(p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts))

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results):
        expected, _ = reference_generate(loaded.model, prompt, NEW_TOKENS)
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged from the reference"


def test_hf_text_prompt_uses_the_directory_tokenizer(hf_system, hf_model):
    loaded = load_model(str(hf_model))

    async def run():
        async with connect(hf_system.url) as client:
            named = await client.complete("the quick brown fox", model=hf_model.name, max_tokens=4, temperature=0.0)
            with pytest.raises(UnknownModelError):
                await client.complete("the quick brown fox", model="tiny", max_tokens=4)
            return named

    result = asyncio.run(run())
    assert result.prompt_token_ids == loaded.tokenizer.encode("the quick brown fox")
    assert result.token_ids, "no tokens generated"


def test_hf_directory_beam_search_matches_transformers_through_disaggregated_path(hf_system, hf_model):
    """Beam search through router -> prefill (chunks of 16) -> decode, every beam token-exact with
    transformers' generate(num_beams=3, do_sample=False) on the directory's weights, in fp32 on CPU."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_model, torch_dtype=torch.float32).eval()
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 90) for _ in range(n)] for n in (5, 17, 33)]
    pad = 95

    async def run():
        async with connect(hf_system.url) as client:
            return await asyncio.gather(*(client.beam_search(p, beam_width=3, max_tokens=10) for p in prompts))

    for prompt, result in zip(prompts, asyncio.run(run())):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, max_new_tokens=10,
                                   num_return_sequences=3, pad_token_id=pad)[:, len(prompt):].tolist()
        got = [output.token_ids for output in result.outputs]
        assert len(got) == 3, f"{len(got)} beams came back"
        for rank, (tokens, want) in enumerate(zip(got, expected)):
            assert want[: len(tokens)] == tokens and all(t == pad for t in want[len(tokens):]), \
                f"prompt of {len(prompt)} tokens, beam {rank}: {tokens} != transformers' {want}"
