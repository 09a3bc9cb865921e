"""Logits processing (penalties, ``min_tokens``, ``logit_bias``) against a plain PyTorch computation
written here token by token: ``process_logits`` on its own (each processor, mixed batches, rows that
ask nothing left bit for bit as they were, no work when no row asks), then the engine: every
sampled token equals what the sampler draws from the reference-processed raw logits of its step
(greedy and seeded, with overlapped steps and async output on and off), ``min_tokens`` holding back
eos, stop token ids and stop strings, ``logit_bias`` deciding greedy tokens, out-of-vocabulary bias
ids refused."""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, make_prompts, make_sequence, record_logits, run

from tandem.shared.engine import logits_processors
from tandem.shared.engine.logits_processors import process_logits
from tandem.shared.engine.sampling import sample
from tandem.shared.engine.sequence import EngineRequest, Sequence
from tandem.shared.protocol.serving import SamplingParams

VOCAB = 64
EOS = 7


def reference_processing(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                         eos_token_ids: list[int]) -> torch.Tensor:
    """vLLM V1's order and definitions, one token at a time: min_tokens, logit_bias, then the
    repetition, frequency and presence penalties."""
    row = row.clone()
    if len(output) < params.min_tokens:
        for token in [*eos_token_ids, *params.stop_token_ids]:
            if token < row.shape[0]:  # a stop id outside the vocabulary is never sampled anyway
                row[token] = float("-inf")
    for token, bias in dict(params.logit_bias).items():
        row[token] += bias
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token)
        row[token] -= params.presence_penalty
    return row


def history_sequence(request_id: str, prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    seq = make_sequence(request_id, prompt=prompt)
    seq.token_ids += output
    seq.params = params
    return seq


def random_history(seed: int, prompt_len: int, output_len: int) -> tuple[list[int], list[int]]:
    """Few distinct tokens, so that repeats (what the penalties count) are common."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 20, (prompt_len,), generator=gen).tolist(),
            torch.randint(10, 30, (output_len,), generator=gen).tolist())


PROCESSORS = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition<1": SamplingParams(repetition_penalty=0.4),
    "frequency": SamplingParams(frequency_penalty=1.3),
    "frequency<0": SamplingParams(frequency_penalty=-0.8),
    "presence": SamplingParams(presence_penalty=1.1),
    "presence<0": SamplingParams(presence_penalty=-2.0),
    "every-penalty": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.3),
    "logit_bias": SamplingParams(logit_bias=[(3, 4.5), (12, -100.0), (EOS, 2.0)]),
    "min_tokens": SamplingParams(max_tokens=None, min_tokens=50, stop_token_ids=[5, 9, 500]),
    "min_tokens-met": SamplingParams(min_tokens=3, stop_token_ids=[5]),
    "everything": SamplingParams(max_tokens=None, min_tokens=50, logit_bias=[(EOS, 50.0), (15, 1.0)],
                                 repetition_penalty=2.0, frequency_penalty=0.2, presence_penalty=0.1),
}


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_each_processor_matches_plain_pytorch(name: str) -> None:
    """Row 1 and 3 ask; rows 0 and 2 ask nothing and must come back bit for bit; the input is not written."""
    params = PROCESSORS[name]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    before = logits.clone()
    histories = [random_history(row, 5 + 3 * row, 4 * row) for row in range(4)]
    row_params = [SamplingParams(), params, SamplingParams(temperature=0.3), params]
    seqs = [history_sequence(f"r{row}", *histories[row], row_params[row]) for row in range(4)]
    out = process_logits(logits, row_params, seqs, [len(h[1]) for h in histories], [EOS])
    assert torch.equal(logits, before), "the raw logits must not be written"
    for row in (0, 2):
        assert torch.equal(out[row], logits[row]), f"row {row} asked nothing"
    for row in (1, 3):
        expected = reference_processing(logits[row], params, *histories[row], [EOS])
        torch.testing.assert_close(out[row], expected, rtol=1e-6, atol=1e-5)


def test_rows_with_different_penalties_in_one_batch() -> None:
    names = ["repetition", "frequency", "presence<0", "every-penalty", "logit_bias", "min_tokens"]
    logits = torch.randn(len(names), VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    histories = [random_history(10 + row, 1 + 7 * row, 2 * row) for row in range(len(names))]
    params = [PROCESSORS[name] for name in names]
    seqs = [history_sequence(f"r{row}", *histories[row], params[row]) for row in range(len(names))]
    out = process_logits(logits, params, seqs, [len(h[1]) for h in histories], [EOS])
    for row, name in enumerate(names):
        expected = reference_processing(logits[row], params[row], *histories[row], [EOS])
        torch.testing.assert_close(out[row], expected, rtol=1e-6, atol=1e-5, msg=name)


def test_no_row_asking_costs_nothing(monkeypatch) -> None:
    def no_upload(*args, **kwargs):
        raise AssertionError("a batch where no row asks must send nothing to the device")

    monkeypatch.setattr(logits_processors, "host_values_to", no_upload)
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(seed=1)]
    # Row 1's min_tokens is met already (output index 2): nothing to mask.
    assert process_logits(logits, params, [], [0, 2, 5], [EOS]) is logits


def test_min_tokens_reads_the_output_index_not_the_history() -> None:
    """A row queued before its newest token is on the host (overlapped decode) still masks right."""
    logits = torch.zeros(2, VOCAB)
    params = [SamplingParams(min_tokens=4)] * 2
    seqs = [make_sequence("a", prompt=[1, 2]), make_sequence("b", prompt=[1, 2])]  # no output tokens known
    out = process_logits(logits, params, seqs, [3, 4], [EOS])
    assert out[0, EOS] == float("-inf") and out[1, EOS] == 0.0


def test_a_token_biased_twice_counts_once_with_its_last_bias() -> None:
    logits = torch.zeros(1, VOCAB)
    out = process_logits(logits, [SamplingParams(logit_bias=[(4, 1.0), (4, 3.0)])], [], [0], [])
    assert out[0, 4] == 3.0 and out[0].count_nonzero() == 1


def test_penalties_refuse_a_history_missing_tokens() -> None:
    seq = make_sequence("a", prompt=[1, 2, 3])
    with pytest.raises(ValueError, match="penalties need every token"):
        process_logits(torch.zeros(1, VOCAB), [SamplingParams(frequency_penalty=1.0)], [seq], [1], [])


# ---------------------------------------------------------------- in the engine

ENGINE_MIX = [
    ("repetition", SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, repetition_penalty=1.6)),
    ("frequency", SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, frequency_penalty=1.2)),
    ("presence", SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, presence_penalty=0.9)),
    ("seeded-penalties", SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=3, ignore_eos=True,
                                        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2)),
    ("bias", SamplingParams(max_tokens=14, temperature=0.8, seed=6, ignore_eos=True, logit_bias=[(32, 3.0)])),
    ("min-tokens", SamplingParams(max_tokens=14, temperature=1.0, seed=8, min_tokens=10, stop_token_ids=[32, 101])),
    ("plain-greedy", SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)),
    ("plain-seeded", SamplingParams(max_tokens=14, temperature=1.1, seed=9, ignore_eos=True)),
]
PLAIN = ("plain-greedy", "plain-seeded")


@pytest.mark.parametrize("overlap_steps", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("async_output", [False, True], ids=["sync-out", "async-out"])
def test_engine_samples_from_the_processed_logits(tiny, overlap_steps: bool, async_output: bool) -> None:
    prompts = make_prompts()
    requests = [EngineRequest(name, prompts[i + 2], params) for i, (name, params) in enumerate(ENGINE_MIX)]
    engine = make_engine(tiny, overlap_steps=overlap_steps, async_output=async_output)
    raw = record_logits(engine)
    results = run(engine, requests)
    eos = tiny.tokenizer.eos_token_ids
    for request in requests:
        tokens, params = results[request.request_id].tokens, request.params
        for index, token in enumerate(tokens):
            expected = reference_processing(raw[(request.request_id, index)], params, request.prompt_token_ids,
                                            tokens[:index], eos)
            again = sample(expected[None], [params], [index]).item()
            assert token == again, f"{request.request_id}: token {index} is not the reference-processed draw"
    assert not set(results["min-tokens"].tokens[:10]) & {32, 101, *eos}
    # The rows that ask nothing get exactly the tokens of a batch where nobody asks.
    plain = [r for r in requests if r.request_id in PLAIN]
    baseline = run(make_engine(tiny, overlap_steps=overlap_steps, async_output=async_output), plain)
    assert {k: baseline[k].tokens for k in PLAIN} == {k: results[k].tokens for k in PLAIN}


def test_penalties_turn_overlap_off_and_min_tokens_does_not(tiny) -> None:
    prompt = make_prompts()[5]
    penalized = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    engine = make_engine(tiny, overlap_steps=True)
    run(engine, [EngineRequest("p", prompt, penalized)])
    assert engine.num_overlapped_steps == 0, "a penalized row needs its newest token before its next step"
    held = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=12)
    engine = make_engine(tiny, overlap_steps=True)
    results = run(engine, [EngineRequest("m", prompt, held)])
    assert engine.num_overlapped_steps > 0 and len(results["m"].tokens) == 12


def test_min_tokens_holds_back_eos_and_stop_ids_even_when_biased_to_the_top(tiny) -> None:
    eos = tiny.tokenizer.eos_token_ids[0]
    prompt = make_prompts()[4]
    bias = [(eos, 100.0), (65, 90.0), (66, 80.0)]  # eos first, then stop id 65, then 66
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5, stop_token_ids=[65], logit_bias=bias)
    result = run(make_engine(tiny), [EngineRequest("m", prompt, params)])["m"]
    assert result.tokens == [66] * 5 + [eos] and result.finish_reason == "stop"
    # ignore_eos: eos is masked until min_tokens all the same (as vLLM), then sampled without ending it.
    params = params.model_copy(update={"ignore_eos": True, "stop_token_ids": [], "max_tokens": 8})
    result = run(make_engine(tiny), [EngineRequest("i", prompt, params)])["i"]
    assert result.tokens == [65] * 5 + [eos] * 3 and result.finish_reason == "length"


@pytest.mark.parametrize("async_output", [False, True], ids=["sync-out", "async-out"])
def test_stop_strings_do_not_end_a_sequence_before_min_tokens(tiny, async_output: bool) -> None:
    prompt, x = make_prompts()[3], ord("x")
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=["x"], logit_bias=[(x, 100.0)])
    result = run(make_engine(tiny, async_output=async_output), [EngineRequest("s", prompt, free)])["s"]
    assert (result.tokens, result.text, result.finish_reason) == ([x], "", "stop")
    held = free.model_copy(update={"min_tokens": 4})
    result = run(make_engine(tiny, async_output=async_output), [EngineRequest("s", prompt, held)])["s"]
    # The first four x are output text; the fifth completes a stop string past min_tokens.
    assert (result.tokens, result.text, result.finish_reason) == ([x] * 5, "xxxx", "stop")


def test_logit_bias_makes_a_token_certain_under_greedy(tiny) -> None:
    prompt = make_prompts()[6]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = run(make_engine(tiny), [EngineRequest("g", prompt, greedy)])["g"].tokens
    forced = greedy.model_copy(update={"logit_bias": [(200, 100.0)]})
    assert run(make_engine(tiny), [EngineRequest("f", prompt, forced)])["f"].tokens == [200] * 8
    banned = greedy.model_copy(update={"logit_bias": [(free[0], -100.0)]})
    assert run(make_engine(tiny), [EngineRequest("b", prompt, banned)])["b"].tokens[0] != free[0]


def test_logit_bias_outside_the_vocabulary_is_refused(tiny) -> None:
    vocab = tiny.model.config.vocab_size
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=2, logit_bias=[(3, 1.0), (vocab, 2.0)])
    with pytest.raises(ValueError, match=f"logit_bias names token id {vocab}"):
        engine.add_request(EngineRequest("bad", [1, 2, 3], params))
    assert not engine.has_unfinished()
