"""Engine tests on the tiny model (CPU, float32) against the contiguous-cache reference: chunked
prefill, preemption, the prefill -> decode KV hand-off (greedy and seeded sampling, text held back
across it), stop strings / stop tokens / eos, abort, validation, and a fully free pool at the end."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch

from tandem.shared.engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from tandem.shared.model import load_model, reference_generate
from tandem.shared.text.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("tiny", device="cpu", dtype=torch.float32)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    kv: torch.Tensor | None = None


def run(engine: LLMEngine, requests: list[EngineRequest], max_steps: int = 5000) -> dict[str, Result]:
    for request in requests:
        engine.add_request(request)
    results: dict[str, Result] = {r.request_id: Result() for r in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            result = results[out.request_id]
            result.tokens += out.new_token_ids
            result.text += out.text_delta
            assert not result.finish_reason, f"{out.request_id} reported after finishing"
            if out.finished:
                result.finish_reason, result.kv = out.finish_reason, out.kv
            assert out.num_output_tokens >= len(result.tokens)
    assert not engine.has_unfinished(), "engine did not finish"
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0
    return results


PROMPT_LENGTHS = [1, 5, 15, 16, 17, 23, 24, 25, 32, 33, 47]


def make_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


def greedy_requests(prompts: list[list[int]], **extra) -> list[EngineRequest]:
    return [
        EngineRequest(f"p{i}", prompt, SamplingParams(max_tokens=8 + i % 9, temperature=0.0, ignore_eos=True), **extra)
        for i, prompt in enumerate(prompts)
    ]


def record_logits(engine: LLMEngine) -> dict[tuple[str, int], torch.Tensor]:
    """Wrap the runner so every sampled row's logits are kept, keyed by (request, output index),
    for steps run one at a time and for overlapped ones (``launch_decode`` + ``sample_async``)."""
    logged: dict[tuple[str, int], torch.Tensor] = {}
    runner = engine.runner
    launch, launch_decode, sample_async = runner.launch, runner.launch_decode, runner.sample_async

    def launch_and_note(batch):
        pending = launch(batch)
        if pending is not None:
            pending.keys = [(i.seq.request_id, i.seq.num_output_tokens) for i in batch.items if i.samples]
        return pending

    def launch_decode_and_note(seqs, prev_tokens, rows):
        pending = launch_decode(seqs, prev_tokens, rows)
        # The first len(rows) sequences' newest token is in flight; the rest are admitted hand-offs.
        pending.keys = [(seq.request_id, seq.num_output_tokens + (i < len(rows))) for i, seq in enumerate(seqs)]
        return pending

    def sample_async_and_log(pending):  # every sampling goes through here (``sample`` waits on it)
        # Before the next step is queued: a graph's logits buffer is reused by the next replay.
        for key, row in zip(pending.keys, pending.logits):
            logged[key] = row.clone()
        return sample_async(pending)

    runner.launch, runner.launch_decode, runner.sample_async = (
        launch_and_note, launch_decode_and_note, sample_async_and_log)
    return logged


@pytest.mark.parametrize(
    "num_blocks,budget,expect_preemption",
    [(64, 24, False), (64, 1000, False), (6, 24, True), (5, 40, True)],
    ids=["chunked", "whole-prompts", "tiny-pool", "tinier-pool"],
)
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_greedy_matches_reference(tiny, num_blocks: int, budget: int, expect_preemption: bool, caching: bool) -> None:
    config = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=budget,
                          max_model_len=256, enable_prefix_caching=caching)
    engine = LLMEngine(tiny.model, tiny.tokenizer, config, "cpu", torch.float32)
    logged = record_logits(engine)
    prompts = make_prompts()
    requests = greedy_requests(prompts)
    results = run(engine, requests)
    assert (engine.stats()["preemptions"] > 0) == expect_preemption
    for request, prompt in zip(requests, prompts):
        ref_tokens, ref_logits = reference_generate(tiny.model, prompt, request.params.max_tokens)
        got = results[request.request_id]
        assert got.tokens == ref_tokens, f"{request.request_id} (prompt {len(prompt)}) diverged"
        assert got.finish_reason == "length" and got.text == tiny.tokenizer.decode(ref_tokens)
        for index, ref_row in enumerate(ref_logits):
            row = logged[(request.request_id, index)]
            assert torch.allclose(row, ref_row, atol=1e-4, rtol=1e-4), f"logits of {request.request_id}[{index}]"


def printable_pair(text: str) -> str:
    """The first two printable characters in a row (no U+FFFD) after the first two characters."""
    return next(text[j : j + 2] for j in range(2, len(text) - 1)
                if text[j : j + 2].isprintable() and "\ufffd" not in text[j : j + 2])


def test_prefill_then_import_matches_single_engine(tiny) -> None:
    config = EngineConfig(block_size=16, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=256)
    prompts = make_prompts()[:8]
    base = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.2, top_k=40, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # the first token finishes it
    ]
    plain = run(LLMEngine(tiny.model, tiny.tokenizer, config),
                [EngineRequest(f"r{i}", p, base[i % 4]) for i, p in enumerate(prompts)])
    # Stop strings placed from the plain run: greedy rows repeat one printable character, so
    # "<char>\0" holds token 0's text back across the hand-off; seeded rows hit a stop midway.
    params = []
    for i in range(len(prompts)):
        text = plain[f"r{i}"].text
        stop = [text[0] + "\x00"] if i % 4 == 0 else [printable_pair(text)] if i % 4 in (1, 2) else []
        params.append(dataclasses.replace(base[i % 4], stop=stop))
    single = run(LLMEngine(tiny.model, tiny.tokenizer, config),
                 [EngineRequest(f"r{i}", p, params[i]) for i, p in enumerate(prompts)])
    assert [single[f"r{i}"].finish_reason for i in range(4)] == ["length", "stop", "stop", "length"]
    prefilled = run(LLMEngine(tiny.model, tiny.tokenizer, config),
                    [EngineRequest(f"r{i}", p, params[i], prefill_only=True) for i, p in enumerate(prompts)])
    handoffs = []
    for i, prompt in enumerate(prompts):
        first, rid = prefilled[f"r{i}"], f"r{i}"
        assert first.tokens == single[rid].tokens[:1]
        if first.finish_reason != "prefilled":  # the first token already ended the request
            assert first.kv is None and (first.finish_reason, first.text) == (single[rid].finish_reason, single[rid].text)
            continue
        assert first.kv is not None and first.kv.device.type == "cpu"
        assert first.kv.shape[0] == -(-len(prompt) // 16)
        if i % 4 == 0:
            assert first.text == "", "a possible stop prefix must be held back across the hand-off"
        handoffs.append(EngineRequest(rid, prompt, params[i], kv=first.kv, output_token_ids=first.tokens))
    assert len(handoffs) >= 5
    decoded = run(LLMEngine(tiny.model, tiny.tokenizer, config), handoffs)
    for request in handoffs:
        rid = request.request_id
        assert prefilled[rid].tokens + decoded[rid].tokens == single[rid].tokens, f"{rid}: split run diverged"
        assert prefilled[rid].text + decoded[rid].text == single[rid].text
        assert decoded[rid].finish_reason == single[rid].finish_reason


def test_stop_string_stop_token_and_eos(tiny) -> None:
    prompt = make_prompts()[6]
    config = EngineConfig(num_blocks=16, max_num_batched_tokens=24)
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=6, ignore_eos=True)
    ref = run(LLMEngine(tiny.model, tiny.tokenizer, config), [EngineRequest("plain", prompt, sampled)])["plain"].tokens
    assert len(set(ref)) > 10, "seeded sampling should give varied tokens"
    text = tiny.tokenizer.decode(ref)
    stop = printable_pair(text)
    cut = next(n for n in range(1, 21) if stop in tiny.tokenizer.decode(ref[:n]))
    no_ignore = dataclasses.replace(sampled, ignore_eos=False)
    res = run(LLMEngine(tiny.model, tiny.tokenizer, config), [
        EngineRequest("s", prompt, dataclasses.replace(sampled, stop=[stop, "\x00\x00never"])),
        EngineRequest("t", prompt, dataclasses.replace(sampled, stop_token_ids=[ref[4]])),
    ])
    assert res["s"].finish_reason == "stop" and res["s"].tokens == ref[:cut] and res["s"].text == text[: text.find(stop)]
    assert res["t"].finish_reason == "stop" and res["t"].tokens == ref[: ref.index(ref[4]) + 1]
    eos_tokenizer = ByteTokenizer()
    eos_tokenizer.eos_token_ids = [ref[5]]
    res = run(LLMEngine(tiny.model, eos_tokenizer, config),
              [EngineRequest("e", prompt, no_ignore), EngineRequest("i", prompt, sampled)])
    assert res["e"].finish_reason == "stop" and res["e"].tokens == ref[: ref.index(ref[5]) + 1]
    assert res["e"].text == eos_tokenizer.decode(ref[: ref.index(ref[5])])
    assert res["i"].tokens == ref and res["i"].finish_reason == "length"


def test_max_model_len_finishes_with_length(tiny) -> None:
    engine = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=16, max_model_len=20))
    res = run(engine, [EngineRequest("a", list(range(15)), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))])
    assert res["a"].finish_reason == "length" and len(res["a"].tokens) == 5


def test_abort_frees_blocks_and_reports_once(tiny) -> None:
    engine = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=16, max_num_batched_tokens=8))
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, list(range(30)), SamplingParams(max_tokens=20, temperature=0.0)))
    engine.step()
    assert engine.abort("a") and engine.abort("b") and not engine.abort("a") and not engine.abort("zzz")
    assert engine.stats()["free_blocks"] == 16 and engine.has_unfinished()
    outputs = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.finished) for o in outputs) == [("a", "abort", True), ("b", "abort", True)]
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": list(range(64))}, "max_model_len"),
        ({"prompt_token_ids": [300]}, "token ids"),
        ({"params": SamplingParams(top_p=0.0)}, "top_p"),
        ({"kv": torch.zeros(1), "output_token_ids": [1]}, "kv has shape"),
        ({"output_token_ids": [1, 2], "params": SamplingParams(max_tokens=2)}, "already has"),
    ],
)
def test_add_request_rejects_bad_requests(tiny, request_kwargs: dict, message: str) -> None:
    engine = LLMEngine(tiny.model, tiny.tokenizer, EngineConfig(num_blocks=2, max_model_len=64))
    kwargs = {"request_id": "x", "prompt_token_ids": [1, 2, 3], **request_kwargs}
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest(**kwargs))
    engine.add_request(EngineRequest("dup", [1]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("dup", [1]))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(EngineRequest("big", list(range(40))))
