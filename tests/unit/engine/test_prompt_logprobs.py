"""Prompt logprobs from the engine against a plain full forward: ``torch.log_softmax`` of the
contiguous-cache reference model's logits over the whole prompt, position j scoring prompt token
j + 1. In one chunk and across chunk boundaries (a small ``max_num_batched_tokens``), across the
runner's row slices, with prefix caching on (a second identical prompt still gets them), on the
first output only, for prefill-only hand-offs (the decode side owes none) and in batches whose
other rows must not change."""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, make_prompts, run

from tandem.shared.engine import prompt_logprobs as prompt_logprobs_module
from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.sequence import EngineRequest, RequestOutput
from tandem.shared.model.reference import reference_logits
from tandem.shared.protocol.serving import SamplingParams, TokenLogprobs

TOLERANCE = 1e-5  # fp32 on the CPU: the paged path and the reference agree this closely


def step_to_the_end(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[RequestOutput]]:
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def check_against_full_forward(tiny, prompt: list[int], entries: list[TokenLogprobs | None], top_n: int) -> None:
    expected = torch.log_softmax(reference_logits(tiny.model, prompt), dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        row = expected[position - 1]  # the logits before a token score it
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=TOLERANCE), f"token {position}"
        assert len(entry.top) == top_n
        want_values, want_ids = row.topk(top_n)
        assert [v for _, v in entry.top] == pytest.approx(want_values.tolist(), abs=TOLERANCE)
        for (token_id, value), want_id in zip(entry.top, want_ids.tolist()):  # ties aside, the same tokens
            assert token_id == want_id or row[want_id].item() == pytest.approx(value, abs=TOLERANCE)


def asking(top_n: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=top_n, **fields)


@pytest.mark.parametrize("budget", [1000, 16, 7], ids=["one-chunk", "16-token-chunks", "7-token-chunks"])
def test_prompt_logprobs_match_a_full_forward(tiny, budget: int) -> None:
    """Three prompts asking for 0, 3 and 5 alternatives in one batch, beside one that asks nothing."""
    prompts = make_prompts()
    requests = [EngineRequest(f"p{len(p)}", p, asking(top_n))
                for p, top_n in ((prompts[4], 3), (prompts[8], 0), (prompts[10], 5))]
    requests.append(EngineRequest("plain", prompts[9], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    outputs = step_to_the_end(make_engine(tiny, budget=budget), requests)
    for request in requests[:-1]:
        first, *rest = outputs[request.request_id]
        check_against_full_forward(tiny, request.prompt_token_ids, first.prompt_logprobs,
                                   request.params.prompt_logprobs)
        assert all(out.prompt_logprobs is None for out in rest), "only the first output carries them"
    assert all(out.prompt_logprobs is None for out in outputs["plain"])
    # Asking changes no token, of the asking rows or of the others.
    plain = [EngineRequest(r.request_id, r.prompt_token_ids, r.params.model_copy(update={"prompt_logprobs": None}))
             for r in requests]
    baseline = run(make_engine(tiny, budget=budget), plain)
    assert {k: [t for o in v for t in o.new_token_ids] for k, v in outputs.items()} == \
        {k: v.tokens for k, v in baseline.items()}


def test_row_slices_join_seamlessly(tiny, monkeypatch) -> None:
    monkeypatch.setattr(prompt_logprobs_module, "ROWS_PER_SLICE", 5)
    prompt = make_prompts()[10]
    outputs = step_to_the_end(make_engine(tiny, budget=20), [EngineRequest("s", prompt, asking(2))])
    check_against_full_forward(tiny, prompt, outputs["s"][0].prompt_logprobs, 2)


def test_prefix_caching_does_not_skip_them(tiny) -> None:
    prompt = make_prompts()[10]  # 47 tokens: two full blocks to cache
    engine = make_engine(tiny, caching=True)
    first = step_to_the_end(engine, [EngineRequest("a", prompt, asking(2))])["a"][0]
    hits = engine.stats()["prefix_cache_hits"]
    second = step_to_the_end(engine, [EngineRequest("b", prompt, asking(2))])["b"][0]
    assert engine.stats()["prefix_cache_hits"] == hits, "a sequence owing prompt logprobs claims no cached prefix"
    check_against_full_forward(tiny, prompt, second.prompt_logprobs, 2)
    assert second.prompt_logprobs == first.prompt_logprobs
    # The blocks it computed are cached for everyone else.
    step_to_the_end(engine, [EngineRequest("c", prompt, SamplingParams(max_tokens=2, temperature=0.0))])
    assert engine.stats()["prefix_cache_hits"] > hits


def test_a_prompt_preempted_mid_prefill_is_scored_again(tiny) -> None:
    """Six blocks, two tokens a step: the decoding A outgrows the pool while B's 47-token prompt is
    two thirds computed, so B (the youngest) loses its blocks and prefills again from the start."""
    prompts = make_prompts()
    engine = make_engine(tiny, num_blocks=6, budget=2)
    preempted = []
    preempt = engine.scheduler.preempt

    def note(seq):
        preempted.append((seq.request_id, seq.num_computed_tokens, seq.num_output_tokens))
        preempt(seq)

    engine.scheduler.preempt = note
    outputs = step_to_the_end(engine, [
        EngineRequest("A", prompts[8], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
        EngineRequest("B", prompts[10], asking(1))])
    assert [(name, out) for name, _, out in preempted] == [("B", 0)]
    assert 0 < preempted[0][1] < len(prompts[10])
    check_against_full_forward(tiny, prompts[10], outputs["B"][0].prompt_logprobs, 1)


def test_a_one_token_prompt_has_only_its_none(tiny) -> None:
    outputs = step_to_the_end(make_engine(tiny), [EngineRequest("one", [65], asking(3))])
    assert outputs["one"][0].prompt_logprobs == [None]


def test_hand_off_carries_them_from_the_prefill_side_only(tiny) -> None:
    prompt = make_prompts()[7]
    params = asking(2).model_copy(update={"max_tokens": 6})
    prefill = step_to_the_end(make_engine(tiny, budget=16), [EngineRequest("h", prompt, params, prefill_only=True)])
    (handed,) = prefill["h"]
    assert handed.finish_reason == "prefilled"
    check_against_full_forward(tiny, prompt, handed.prompt_logprobs, 2)
    decode = step_to_the_end(make_engine(tiny), [EngineRequest("h", prompt, params, kv=handed.kv,
                                                               output_token_ids=handed.new_token_ids)])
    assert all(out.prompt_logprobs is None for out in decode["h"])
    assert sum(len(out.new_token_ids) for out in decode["h"]) == 5


def test_a_prefix_import_with_prompt_logprobs_is_refused(tiny) -> None:
    prompt = make_prompts()[10]
    handed = step_to_the_end(make_engine(tiny), [EngineRequest("h", prompt, asking(1), prefill_only=True)])["h"][0]
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request(EngineRequest("x", prompt, asking(1), kv=handed.kv[:2]))


def test_a_recomputed_prompt_replaces_what_was_kept() -> None:
    def chunk(first: int, values: list[float]) -> prompt_logprobs_module.PromptLogprobsChunk:
        n = len(values)
        return prompt_logprobs_module.PromptLogprobsChunk(first, 0, torch.tensor(values), torch.zeros(n, 0),
                                                          torch.zeros(n, 0))

    kept = prompt_logprobs_module.PromptLogprobs()
    kept.add(chunk(1, [-1.0, -2.0]))
    kept.add(chunk(3, [-3.0]))
    kept.add(chunk(1, [-4.0, -5.0]))  # preempted and prefilled again from the start
    with pytest.raises(RuntimeError, match="cover 3 of 4"):
        kept.entries(4)
    kept.add(chunk(3, [-6.0]))
    assert [e.logprob for e in kept.take(4)[1:]] == [-4.0, -5.0, -6.0]
    assert kept.take(4) is None, "taken once"
