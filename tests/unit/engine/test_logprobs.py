"""Per-token logprobs from the engine against a plain PyTorch computation: ``torch.log_softmax`` of
the contiguous-cache reference model's logits at the same positions (teacher-forced on the tokens
the engine produced), for greedy and seeded rows, with overlapped steps and async output on and
off, and in batches that mix rows with and without logprobs (whose tokens must not change)."""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, make_prompts

from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.model_runner import ModelRunner
from tandem.shared.engine.sampling import gather_logprobs, sample_rows_alone
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.reference import reference_logits
from tandem.shared.protocol.serving import SamplingParams, TokenLogprobs


def run_with_logprobs(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list]]:
    """Step to the end; per request its tokens and the logprobs entry reported with each (None when
    the output carried none)."""
    for request in requests:
        engine.add_request(request)
    got: dict[str, tuple[list[int], list]] = {r.request_id: ([], []) for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, entries = got[out.request_id]
            tokens += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                entries += out.logprobs
            else:
                entries += [None] * len(out.new_token_ids)
    return got


def check_against_reference(tiny, prompt: list[int], tokens: list[int], entries: list[TokenLogprobs],
                            top_n: int) -> None:
    expected = torch.log_softmax(reference_logits(tiny.model, prompt + tokens[:-1])[len(prompt) - 1:], dim=-1)
    assert len(entries) == len(tokens) == expected.shape[0]
    for index, (token, entry, row) in enumerate(zip(tokens, entries, expected)):
        assert entry is not None, f"token {index} has no logprobs"
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4), f"logprob of token {index}"
        assert len(entry.top) == top_n
        want_values, want_ids = row.topk(top_n)
        assert [v for _, v in entry.top] == pytest.approx(want_values.tolist(), abs=1e-4)
        # Ties aside (values equal within the tolerance), the same tokens in the same order.
        for (token_id, value), want_id in zip(entry.top, want_ids.tolist()):
            assert token_id == want_id or row[want_id].item() == pytest.approx(value, abs=1e-4)


MIXED = [
    ("greedy-lp", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)),
    ("seeded-lp", SamplingParams(max_tokens=12, temperature=0.8, top_k=30, seed=4, ignore_eos=True, logprobs=5)),
    ("greedy-plain", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    ("seeded-plain", SamplingParams(max_tokens=12, temperature=1.1, seed=8, ignore_eos=True)),
    ("chosen-only", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)),
]


@pytest.mark.parametrize("overlap_steps", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("async_output", [False, True], ids=["sync-out", "async-out"])
def test_logprobs_match_log_softmax_of_reference(tiny, overlap_steps: bool, async_output: bool) -> None:
    prompts = make_prompts()
    requests = [EngineRequest(name, prompts[i + 2], params) for i, (name, params) in enumerate(MIXED)]
    engine = make_engine(tiny, overlap_steps=overlap_steps, async_output=async_output)
    got = run_with_logprobs(engine, requests)
    if overlap_steps:
        assert engine.num_overlapped_steps > 0
    for request in requests:
        tokens, entries = got[request.request_id]
        assert len(tokens) == request.params.max_tokens
        if request.params.logprobs is None:
            assert entries == [None] * len(tokens)
        else:
            check_against_reference(tiny, request.prompt_token_ids, tokens, entries, request.params.logprobs)

    # The same requests without logprobs anywhere: every token the same.
    plain = [EngineRequest(r.request_id, r.prompt_token_ids, r.params.model_copy(update={"logprobs": None}))
             for r in requests]
    baseline = run_with_logprobs(make_engine(tiny, overlap_steps=overlap_steps, async_output=async_output), plain)
    assert {k: v[0] for k, v in baseline.items()} == {k: v[0] for k, v in got.items()}


def test_prefill_only_first_token_carries_logprobs(tiny) -> None:
    prompt = make_prompts()[4]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = make_engine(tiny)
    engine.add_request(EngineRequest("h", prompt, params, prefill_only=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (out,) = outputs
    assert out.finish_reason == "prefilled"
    check_against_reference(tiny, prompt, out.new_token_ids, out.logprobs, 2)


def test_no_row_asking_does_no_logprob_work(tiny) -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0)] * 3
    assert gather_logprobs(logits, logits.argmax(-1), params) is None
    engine = make_engine(tiny)
    engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0)))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.logprobs is None
            tokens += out.new_token_ids
    assert len(tokens) == 2


def test_rows_sampled_alone_get_the_batch_logprobs() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 40)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=0.7, seed=2, logprobs=4), SamplingParams(temperature=0.0, logprobs=0)]
    ids, failed = sample_rows_alone(logits, params, [0, 0, 0, 0])
    assert not failed
    entries = gather_logprobs(logits, ids, params).per_row(4)
    expected = torch.log_softmax(logits, dim=-1)
    assert entries[1] is None
    for row in (0, 2, 3):
        assert entries[row].logprob == pytest.approx(expected[row, ids[row]].item(), abs=1e-6)
        values, top_ids = expected[row].topk(params[row].logprobs)
        assert entries[row].top == [(i, pytest.approx(v, abs=1e-6)) for i, v in zip(top_ids.tolist(), values.tolist())]


def test_sample_async_fallback_keeps_logprobs(tiny, monkeypatch) -> None:
    """A batch whose sampling raised and was sampled row by row still reports its logprobs."""
    import tandem.shared.engine.model_runner as model_runner

    def failing_sample(*args, **kwargs):
        raise RuntimeError("batch sampling failed")

    monkeypatch.setattr(model_runner, "sample", failing_sample)
    monkeypatch.setattr(model_runner, "sample_rows_alone",
                        lambda logits, params, indices, gen: (logits.argmax(-1), {1: RuntimeError("row 1")}))
    runner = ModelRunner.__new__(ModelRunner)
    runner.generator, runner.eos_token_ids = None, ()
    logits = torch.randn(2, 30)
    pending = model_runner.PendingStep(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 2, [0, 0])
    tokens = runner.sample_async(pending)
    assert set(tokens.failed_rows) == {1}
    entries = tokens.wait_logprobs()
    assert entries[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1).max().item(), abs=1e-6)
