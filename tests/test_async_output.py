"""Asynchronous output processing gives exactly what synchronous processing gives.

With ``EngineConfig.async_output`` a step's tokens are detokenized while the device runs the next
step, so outputs arrive one step later; tokens, text, finish reasons and hand-off KV must not change.
On CUDA it is on by default; these CPU tests switch it on explicitly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.shared.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from tandem.shared.model import load_model

from test_engine import make_prompts, run

CONFIG = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=40, max_model_len=256)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype=torch.float32)


def mixed_requests() -> list[EngineRequest]:
    """Greedy and seeded sampling, a stop string, stop token ids, eos, a prefill-only hand-off."""
    prompts = make_prompts()
    kinds = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=11, stop=list("etaoinshrdlucmfw")),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop_token_ids=list(range(0, 256, 4))),
        SamplingParams(max_tokens=40, temperature=1.2, seed=9),
    ]
    requests = [EngineRequest(f"r{i}", prompt, kinds[i % len(kinds)]) for i, prompt in enumerate(prompts)]
    requests.append(EngineRequest("handoff", prompts[3], kinds[1], prefill_only=True))
    return requests


@pytest.mark.parametrize("num_blocks", [64, 6], ids=["roomy", "preempting"])
def test_async_output_matches_sync(tiny, num_blocks: int) -> None:
    config = dataclasses.replace(CONFIG, num_blocks=num_blocks)
    sync = run(LLMEngine(tiny.model, tiny.tokenizer, dataclasses.replace(config, async_output=False)), mixed_requests())
    engine = LLMEngine(tiny.model, tiny.tokenizer, dataclasses.replace(config, async_output=True))
    late = run(engine, mixed_requests())
    assert engine.async_output
    for request_id, expected in sync.items():
        got = late[request_id]
        assert got.tokens == expected.tokens, f"{request_id}: tokens differ"
        assert got.text == expected.text, f"{request_id}: text differs"
        assert got.finish_reason == expected.finish_reason, f"{request_id}: finish reason differs"
        assert (got.kv is None) == (expected.kv is None) and (got.kv is None or torch.equal(got.kv, expected.kv))
    assert {r.finish_reason for r in sync.values()} >= {"length", "stop", "prefilled"}


def test_abort_while_output_is_pending(tiny) -> None:
    engine = LLMEngine(tiny.model, tiny.tokenizer, dataclasses.replace(CONFIG, async_output=True))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("a", make_prompts()[4], params))
    engine.add_request(EngineRequest("b", make_prompts()[5], params))
    seen: dict[str, list] = {"a": [], "b": []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.abort("a")
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert seen["a"][-1].finish_reason == "abort" and sum(o.finished for o in seen["a"]) == 1
    assert seen["b"][-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in seen["b"]) == 50
    assert engine.stats()["free_blocks"] == CONFIG.num_blocks


@pytest.mark.parametrize("async_output", [False, True])
def test_prefill_only_output_is_not_delayed(tiny, async_output: bool) -> None:
    """A prefill-only sequence's token starts a hand-off: it must leave in the step that sampled it."""
    engine = LLMEngine(tiny.model, tiny.tokenizer, dataclasses.replace(CONFIG, async_output=async_output))
    prompt = make_prompts()[6]  # 24 tokens, budget 40: prefilled and sampled in the first step
    engine.add_request(EngineRequest("h", prompt, SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True))
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["prefilled"], f"got {outputs}"
    assert outputs[0].kv is not None and not engine.has_unfinished()
