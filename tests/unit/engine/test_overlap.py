"""Overlapped decode steps give exactly what one-step-at-a-time gives.

With ``EngineConfig.overlap_steps`` the engine queues decode step N+1, fed by step N's sampled ids
on the device, before it has read them (engine/overlap.py). Tokens, text, finish reasons, hand-off
KV and the blocks given back must not change. On CUDA it is on by default (with graphs); these CPU
tests switch it on and check that steps really were overlapped, so they cannot pass vacuously.
"""

from __future__ import annotations

import dataclasses

import pytest
from factories import engine_config, make_engine, make_prompts, mixed_requests, run

from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.protocol.serving import SamplingParams

CONFIG = engine_config(budget=40)


def engine_for(tiny, overlap: bool, **changes) -> LLMEngine:
    return make_engine(tiny, CONFIG, overlap_steps=overlap, **changes)


@pytest.mark.parametrize("async_output", [False, True], ids=["text-now", "text-later"])
@pytest.mark.parametrize("num_blocks", [64, 6], ids=["roomy", "preempting"])
def test_overlap_matches_one_step_at_a_time(tiny, num_blocks: int, async_output: bool) -> None:
    plain = run(engine_for(tiny, False, num_blocks=num_blocks, async_output=async_output), mixed_requests())
    engine = engine_for(tiny, True, num_blocks=num_blocks, async_output=async_output)
    got = run(engine, mixed_requests())
    assert engine.num_overlapped_steps > 0, "no step was overlapped: the test checks nothing"
    for request_id, expected in plain.items():
        out = got[request_id]
        assert out.tokens == expected.tokens, f"{request_id}: tokens differ"
        assert out.text == expected.text, f"{request_id}: text differs"
        assert out.finish_reason == expected.finish_reason, f"{request_id}: finish reason differs"
        assert (out.kv is None) == (expected.kv is None)
    assert engine.stats()["free_blocks"] == num_blocks, "blocks leaked"


def test_stop_token_in_flight_drops_the_extra_row(tiny) -> None:
    """A sequence ended by a stop token while the next step was already queued keeps no token of it."""
    prompt = make_prompts()[4]
    probe = engine_for(tiny, False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = run(probe, [EngineRequest("p", prompt, greedy)])["p"].tokens
    stop_at = tokens[5]  # the 6th greedy token becomes a stop token
    params = greedy.model_copy(update={"stop_token_ids": [stop_at]})
    engine = engine_for(tiny, True)
    out = run(engine, [EngineRequest("s", prompt, params), EngineRequest("g", make_prompts()[5], greedy)])
    assert out["s"].tokens == tokens[: tokens.index(stop_at) + 1], "tokens after the stop token leaked out"
    assert out["s"].finish_reason == "stop"
    assert len(out["g"].tokens) == 12 and engine.num_overlapped_steps > 0


def test_abort_while_steps_are_in_flight(tiny) -> None:
    engine = engine_for(tiny, True, async_output=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("a", make_prompts()[4], params))
    engine.add_request(EngineRequest("b", make_prompts()[5], params))
    seen: dict[str, list] = {"a": [], "b": []}
    for _ in range(6):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.num_overlapped_steps > 0
    assert engine.abort("a")
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert seen["a"][-1].finish_reason == "abort" and sum(o.finished for o in seen["a"]) == 1
    assert sum(len(o.new_token_ids) for o in seen["b"]) == 40 and seen["b"][-1].finish_reason == "length"
    assert engine.stats()["free_blocks"] == CONFIG.num_blocks


def test_length_cap_ends_without_a_wasted_row(tiny) -> None:
    """Sequences running into max_model_len finish exactly there, and a sequence the in-flight step
    surely ends (its token reaches the cap) gets no row in the step queued after it."""
    prompts = make_prompts()[:6]
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    plain = run(engine_for(tiny, False, max_model_len=64), requests)
    engine = engine_for(tiny, True, max_model_len=64)
    launch_decode = engine.runner.launch_decode
    positions: list[int] = []

    def checked(seqs, prev_tokens, rows):
        positions.extend(seq.num_tokens for seq in seqs)
        return launch_decode(seqs, prev_tokens, rows)

    engine.runner.launch_decode = checked
    got = run(engine, [dataclasses.replace(r) for r in requests])
    # A row at position 63 would compute the 64th token's successor: the 64th already ends the sequence.
    assert positions and max(positions) < 63, f"a row was queued at position {max(positions)} for a finished sequence"
    for prompt, (request_id, expected) in zip(prompts, plain.items()):
        assert got[request_id].tokens == expected.tokens, f"{request_id}: tokens differ"
        assert got[request_id].finish_reason == "length"
        assert len(prompt) + len(expected.tokens) == 64, f"{request_id}: did not stop at the cap"
    assert engine.num_overlapped_steps > 0


def test_failed_step_leaves_nothing_in_flight(tiny) -> None:
    """A step that raises while another is in flight drops it: aborting the requests empties the engine."""
    engine = engine_for(tiny, True)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", make_prompts()[4 + i], params))
    while engine.num_overlapped_steps == 0:
        engine.step()

    def broken(*args):
        raise RuntimeError("device fault")

    engine.runner.launch_decode = broken
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    for i in range(3):
        engine.abort(f"r{i}")
    outputs = engine.step()
    assert (sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
            and all(o.finish_reason == "abort" for o in outputs))
    assert not engine.has_unfinished(), "a failed step was left in flight"
    assert engine.stats()["free_blocks"] == CONFIG.num_blocks


def staggered(engine: LLMEngine, batches: list[list[EngineRequest]], every: int) -> dict[str, tuple[list[int], str]]:
    """Add one batch of requests every ``every`` steps (as a decode worker receives hand-offs)."""
    out: dict[str, tuple[list[int], str]] = {}
    pending = list(batches)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            for request in pending.pop(0):
                engine.add_request(request)
        for o in engine.step():
            tokens, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        step += 1
    return out


@pytest.mark.parametrize("num_blocks", [64, 14], ids=["roomy", "tight"])
def test_handoffs_join_overlapped_steps(tiny, num_blocks: int) -> None:
    """Hand-offs arriving while steps are in flight join the next queued step as decode rows (no
    wait for the in-flight tokens) and decode exactly as when each step is waited for."""
    prompts = make_prompts()
    params = [SamplingParams(max_tokens=12 + 5 * (i % 3), temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    prefill = engine_for(tiny, False)
    firsts = run(prefill, [EngineRequest(f"r{i}", p, params[i], prefill_only=True) for i, p in enumerate(prompts)])

    def handoffs() -> list[list[EngineRequest]]:
        requests = [EngineRequest(f"r{i}", p, params[i], kv=firsts[f"r{i}"].kv, output_token_ids=firsts[f"r{i}"].tokens)
                    for i, p in enumerate(prompts)]
        return [requests[i : i + 2] for i in range(0, len(requests), 2)]

    plain = staggered(engine_for(tiny, False, num_blocks=num_blocks), handoffs(), every=3)
    engine = engine_for(tiny, True, num_blocks=num_blocks)
    joined: list[int] = []
    launch_decode = engine.runner.launch_decode

    def noting(seqs, prev_tokens, rows):
        joined.append(len(seqs) - len(rows))
        return launch_decode(seqs, prev_tokens, rows)

    engine.runner.launch_decode = noting
    got = staggered(engine, handoffs(), every=3)
    assert sum(joined) > 0, "no hand-off joined a queued step: the test checks nothing"
    assert got == plain, "overlapped steps with hand-offs joining differ from stepping one at a time"
    assert engine.stats()["free_blocks"] == num_blocks
