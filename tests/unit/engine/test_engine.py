"""Engine tests on the tiny model (CPU, float32) against the contiguous-cache reference: chunked
prefill, preemption, the prefill -> decode KV hand-off (greedy and seeded sampling, text held back
across it), stop strings / stop tokens / eos, abort, validation, and a fully free pool at the end."""

from __future__ import annotations

import pydantic
import pytest
import torch
from factories import make_engine, make_prompts, record_logits, run
from support import BAD_SAMPLING, value_id

from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.reference import reference_generate
from tandem.shared.protocol.serving import SamplingParams
from tandem.shared.text.tokenizer import ByteTokenizer


def greedy_requests(prompts: list[list[int]], **extra) -> list[EngineRequest]:
    return [
        EngineRequest(f"p{i}", prompt, SamplingParams(max_tokens=8 + i % 9, temperature=0.0, ignore_eos=True), **extra)
        for i, prompt in enumerate(prompts)
    ]


@pytest.mark.parametrize(
    "num_blocks,budget,expect_preemption",
    [(64, 24, False), (64, 1000, False), (6, 24, True), (5, 40, True)],
    ids=["chunked", "whole-prompts", "tiny-pool", "tinier-pool"],
)
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_greedy_matches_reference(tiny, num_blocks: int, budget: int, expect_preemption: bool, caching: bool) -> None:
    engine = make_engine(tiny, num_blocks=num_blocks, budget=budget, caching=caching)
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
    config = dict(num_blocks=48, max_seqs=4, budget=24)
    prompts = make_prompts()[:8]
    base = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.2, top_k=40, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),  # the first token finishes it
    ]
    plain = run(make_engine(tiny, **config),
                [EngineRequest(f"r{i}", p, base[i % 4]) for i, p in enumerate(prompts)])
    # Stop strings placed from the plain run: greedy rows repeat one printable character, so
    # "<char>\0" holds token 0's text back across the hand-off; seeded rows hit a stop midway.
    params = []
    for i in range(len(prompts)):
        text = plain[f"r{i}"].text
        stop = [text[0] + "\x00"] if i % 4 == 0 else [printable_pair(text)] if i % 4 in (1, 2) else []
        params.append(base[i % 4].model_copy(update={"stop": stop}))
    single = run(make_engine(tiny, **config),
                 [EngineRequest(f"r{i}", p, params[i]) for i, p in enumerate(prompts)])
    assert [single[f"r{i}"].finish_reason for i in range(4)] == ["length", "stop", "stop", "length"]
    prefilled = run(make_engine(tiny, **config),
                    [EngineRequest(f"r{i}", p, params[i], prefill_only=True) for i, p in enumerate(prompts)])
    handoffs = []
    for i, prompt in enumerate(prompts):
        first, rid = prefilled[f"r{i}"], f"r{i}"
        assert first.tokens == single[rid].tokens[:1]
        if first.finish_reason != "prefilled":  # the first token already ended the request
            assert first.kv is None and ((first.finish_reason, first.text)
                                         == (single[rid].finish_reason, single[rid].text))
            continue
        assert first.kv is not None and first.kv.device.type == "cpu"
        assert first.kv.shape[0] == -(-len(prompt) // 16)
        if i % 4 == 0:
            assert first.text == "", "a possible stop prefix must be held back across the hand-off"
        handoffs.append(EngineRequest(rid, prompt, params[i], kv=first.kv, output_token_ids=first.tokens))
    assert len(handoffs) >= 5
    decoded = run(make_engine(tiny, **config), handoffs)
    for request in handoffs:
        rid = request.request_id
        assert prefilled[rid].tokens + decoded[rid].tokens == single[rid].tokens, f"{rid}: split run diverged"
        assert prefilled[rid].text + decoded[rid].text == single[rid].text
        assert decoded[rid].finish_reason == single[rid].finish_reason


def test_stop_string_stop_token_and_eos(tiny) -> None:
    prompt = make_prompts()[6]
    config = dict(num_blocks=16, budget=24)
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=6, ignore_eos=True)
    ref = run(make_engine(tiny, **config), [EngineRequest("plain", prompt, sampled)])["plain"].tokens
    assert len(set(ref)) > 10, "seeded sampling should give varied tokens"
    text = tiny.tokenizer.decode(ref)
    stop = printable_pair(text)
    cut = next(n for n in range(1, 21) if stop in tiny.tokenizer.decode(ref[:n]))
    no_ignore = sampled.model_copy(update={"ignore_eos": False})
    res = run(make_engine(tiny, **config), [
        EngineRequest("s", prompt, sampled.model_copy(update={"stop": [stop, "\x00\x00never"]})),
        EngineRequest("t", prompt, sampled.model_copy(update={"stop_token_ids": [ref[4]]})),
    ])
    assert (res["s"].finish_reason == "stop" and res["s"].tokens == ref[:cut]
            and res["s"].text == text[: text.find(stop)])
    assert res["t"].finish_reason == "stop" and res["t"].tokens == ref[: ref.index(ref[4]) + 1]
    eos_tokenizer = ByteTokenizer()
    eos_tokenizer.eos_token_ids = [ref[5]]
    res = run(make_engine(tiny, tokenizer=eos_tokenizer, **config),
              [EngineRequest("e", prompt, no_ignore), EngineRequest("i", prompt, sampled)])
    assert res["e"].finish_reason == "stop" and res["e"].tokens == ref[: ref.index(ref[5]) + 1]
    assert res["e"].text == eos_tokenizer.decode(ref[: ref.index(ref[5])])
    assert res["i"].tokens == ref and res["i"].finish_reason == "length"


def test_max_model_len_finishes_with_length(tiny) -> None:
    engine = make_engine(tiny, num_blocks=16, max_model_len=20)
    res = run(engine, [EngineRequest("a", list(range(15)),
                                     SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))])
    assert res["a"].finish_reason == "length" and len(res["a"].tokens) == 5


def test_abort_frees_blocks_and_reports_once(tiny) -> None:
    engine = make_engine(tiny, num_blocks=16, budget=8)
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, list(range(30)), SamplingParams(max_tokens=20, temperature=0.0)))
    engine.step()
    assert engine.abort("a") and engine.abort("b") and not engine.abort("a") and not engine.abort("zzz")
    assert engine.stats()["free_blocks"] == 16 and engine.has_unfinished()
    outputs = engine.step()
    assert (sorted((o.request_id, o.finish_reason, o.finished) for o in outputs)
            == [("a", "abort", True), ("b", "abort", True)])
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": list(range(64))}, "max_model_len"),
        ({"prompt_token_ids": [300]}, "token ids"),
        ({"params": SamplingParams.model_construct(top_p=0.0)}, "top_p"),  # model_construct skips validation
        ({"params": {"max_tokens": 4}}, "SamplingParams"),
        ({"kv": torch.zeros(1), "output_token_ids": [1]}, "kv has shape"),
        ({"output_token_ids": [1, 2], "params": SamplingParams(max_tokens=2)}, "already has"),
    ],
)
def test_add_request_rejects_bad_requests(tiny, request_kwargs: dict, message: str) -> None:
    engine = make_engine(tiny, num_blocks=2, max_model_len=64)
    kwargs = {"request_id": "x", "prompt_token_ids": [1, 2, 3], **request_kwargs}
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest(**kwargs))
    engine.add_request(EngineRequest("dup", [1]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("dup", [1]))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(EngineRequest("big", list(range(40))))


@pytest.mark.parametrize("name,value", BAD_SAMPLING, ids=[f"{n}={value_id(v)}" for n, v in BAD_SAMPLING])
def test_out_of_bounds_sampling_is_refused_in_process(tiny, name: str, value: object) -> None:
    """Constructing the params refuses the value; params that skipped validation (model_construct,
    model_copy) are refused by add_request, naming the field, and the engine keeps serving."""
    with pytest.raises(pydantic.ValidationError, match=name):
        SamplingParams(**{name: value})
    engine = make_engine(tiny, num_blocks=4, max_model_len=64)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for bypassed in (SamplingParams.model_construct(**{name: value}), greedy.model_copy(update={name: value})):
        with pytest.raises(ValueError, match=f"invalid sampling parameters: {name}"):
            engine.add_request(EngineRequest("bad", [1, 2, 3], bypassed))
    results = run(engine, [EngineRequest("good", [1, 2, 3], greedy)])
    assert len(results["good"].tokens) == 3, f"the engine stopped serving after refusing {name}={value_id(value)}"
    assert engine.stats()["free_blocks"] == 4, "a refused request must not hold blocks"
