"""Asynchronous output processing gives exactly what synchronous processing gives.

With ``EngineConfig.async_output`` a step's tokens are detokenized while the device runs the next
step, so outputs arrive one step later; tokens, text, finish reasons and hand-off KV must not change.
On CUDA it is on by default; these CPU tests switch it on explicitly.
"""

from __future__ import annotations

import pytest
import torch
from factories import engine_config, make_engine, make_prompts, mixed_requests, run

from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.protocol.serving import SamplingParams

CONFIG = engine_config(budget=40)


@pytest.mark.parametrize("num_blocks", [64, 6], ids=["roomy", "preempting"])
def test_async_output_matches_sync(tiny, num_blocks: int) -> None:
    sync = run(make_engine(tiny, CONFIG, num_blocks=num_blocks, async_output=False), mixed_requests())
    engine = make_engine(tiny, CONFIG, num_blocks=num_blocks, async_output=True)
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
    engine = make_engine(tiny, CONFIG, async_output=True)
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
    engine = make_engine(tiny, CONFIG, async_output=async_output)
    prompt = make_prompts()[6]  # 24 tokens, budget 40: prefilled and sampled in the first step
    engine.add_request(EngineRequest("h", prompt, SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True))
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["prefilled"], f"got {outputs}"
    assert outputs[0].kv is not None and not engine.has_unfinished()
