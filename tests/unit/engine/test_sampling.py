"""Sampling tests (greedy, top-k / top-p edge cases, per-request seeds independent of the batch and
of the worker, distribution sanity for temperature, SamplingParams validation) and incremental
detokenizer tests (UTF-8 split across tokens, stop strings split across tokens, eos, stop ids)."""

from __future__ import annotations

import pydantic
import pytest
import torch

from tandem.shared.engine.detokenizer import IncrementalDetokenizer, check_stop
from tandem.shared.engine.sampling import mix_seed, sample
from tandem.shared.engine.sequence import Sequence
from tandem.shared.protocol.serving import GREEDY_TEMPERATURE, SamplingParams
from tandem.shared.text.tokenizer import ByteTokenizer

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0)] * 8
    assert torch.equal(sample(logits, params, [0] * 8), logits.argmax(-1))


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = sample(logits, params, [0] * 6)
    assert torch.equal(out[::2], logits.argmax(-1)[::2])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5, seed=3),
    ],
    ids=["top_k=1", "tiny top_p", "both, seeded"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(16, seed=1)
    for trial in range(5):
        out = sample(logits, [params] * 16, [trial] * 16)
        assert torch.equal(out, logits.argmax(-1)), f"{params} must reduce to argmax"


def test_top_k_and_top_p_restrict_the_support() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().repeat(4000, 1)
    top_k = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 4000, [0] * 4000)
    assert set(top_k.tolist()) == {2, 3}, "top_k=2 keeps the two most likely tokens"
    # Mass before tokens (sorted): 0, .4, .7, .9 -> top_p=.5 keeps 3 and 2; .4 keeps only 3.
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)] * 4000, [0] * 4000)
    assert set(top_p.tolist()) == {2, 3}
    only = sample(logits, [SamplingParams(temperature=1.0, top_p=0.4)] * 4000, [0] * 4000)
    assert set(only.tolist()) == {3}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 40_000
    logits = probs.log().repeat(rows, 1)
    generator = torch.Generator().manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=temperature)] * rows, [0] * rows, generator)
    freq = torch.bincount(out, minlength=4).float() / rows
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    assert torch.allclose(freq, expected, atol=0.015), f"T={temperature}: {freq} vs {expected}"


def test_seeded_rows_sample_the_right_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 3000
    logits = probs.log().repeat(rows, 1)
    params = [SamplingParams(temperature=1.0, seed=i % 7) for i in range(rows)]
    out = sample(logits, params, [i // 7 for i in range(rows)])  # distinct (seed, index) pairs
    freq = torch.bincount(out, minlength=4).float() / rows
    assert torch.allclose(freq, probs, atol=0.04), f"{freq} vs {probs}"


def test_seed_makes_token_independent_of_batch_composition() -> None:
    logits = random_logits(5, seed=2)
    target = logits[2:3]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = sample(target, [seeded], [3])
    for other_seed in range(5):
        neighbours = [
            SamplingParams(temperature=1.0, seed=other_seed),
            SamplingParams(temperature=0.7),
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=2.0, top_k=3),
        ]
        batch = torch.cat([logits[:other_seed], target, random_logits(4 - other_seed, seed=other_seed + 10)])
        params = neighbours[:other_seed] + [seeded] + neighbours[other_seed:]
        indices = [0] * other_seed + [3] + [1] * (4 - other_seed)
        out = sample(batch, params, indices, torch.Generator().manual_seed(other_seed))
        assert out[other_seed] == alone[0], "a seeded row must not depend on the rest of the batch"


def test_prefill_and_decode_split_matches_one_worker() -> None:
    """Token 0 sampled in one batch and token 1 in another == both sampled in one batch."""
    logits = random_logits(4, seed=3)
    seeded = SamplingParams(temperature=1.3, top_k=20, seed=99)
    step0 = logits[0:1]  # logits the request sees for its output token 0
    step1 = logits[1:2]  # ... and for its output token 1
    prefill = sample(torch.cat([step0, logits[3:]]), [seeded, SamplingParams(temperature=1.0)], [0, 0])
    decode = sample(torch.cat([logits[2:3], step1]), [SamplingParams(temperature=1.0, seed=5), seeded], [4, 1])
    together = sample(torch.cat([step1, step0]), [seeded, seeded], [1, 0])
    assert (prefill[0].item(), decode[1].item()) == (together[1].item(), together[0].item())


def test_seeded_draws_vary_with_output_index_and_seed() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: the noise alone picks the token
    by_index = {sample(logits, [SamplingParams(temperature=1.0, seed=7)], [i]).item() for i in range(40)}
    by_seed = {sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0]).item() for s in range(40)}
    assert len(by_index) > 10 and len(by_seed) > 10, "seeded noise must change with index and seed"
    assert mix_seed(7, 0) != mix_seed(0, 7) and 0 <= mix_seed(-1, 2**40) < 2**63


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_construction_rejects_bad_params(kwargs: dict, field: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        SamplingParams(**kwargs)


def test_construction_accepts_defaults_and_edges() -> None:
    edges = dict(max_tokens=2**31 - 1, temperature=100.0, top_p=1e-300, top_k=2**31 - 1, seed=2**63 - 1,
                 stop_token_ids=[0, 2**31 - 1])
    for kwargs in [{}, dict(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=0), edges]:
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),  # float32 keeps it (a denormal): 1/T overflows the logits
        SamplingParams(temperature=GREEDY_TEMPERATURE / 2, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-300),  # 0 in float32: the top token must survive anyway
        SamplingParams(temperature=1.0, top_p=1e-46, top_k=3),
        SamplingParams(temperature=1.0, top_k=2**31 - 1, top_p=1e-40),  # top_k past the vocabulary keeps all
    ],
    ids=["denormal-temperature", "below-greedy-temperature", "top-p-underflows", "top-p-underflows-top-k",
         "huge-top-k"],
)
def test_extreme_valid_params_sample_the_top_token(params: SamplingParams) -> None:
    """Values at the far ends of the bounds sample like greedy, never an arbitrary token (token 0
    used to come out of NaN probabilities)."""
    logits = random_logits(16, seed=4)
    out = sample(logits, [params] * 16, list(range(16)))
    assert out.tolist() == logits.argmax(dim=-1).tolist(), f"{params} did not sample the most likely tokens"


# Detokenizer: byte-level tokens, so every multi-byte character is split across tokens.
def feed(tokens: list[int], params: SamplingParams,
         eos: tuple[int, ...] = (257,)) -> tuple[list[str], str | None, Sequence]:
    tokenizer = ByteTokenizer()
    prompt = list(b"hi ")
    seq = Sequence("r", list(prompt), len(prompt), params, 0,
                   detokenizer=IncrementalDetokenizer(tokenizer, len(prompt), params.stop))
    deltas, reason = [], None
    for token in tokens:
        seq.token_ids.append(token)
        reason = check_stop(seq, eos, max_model_len=10_000)
        deltas.append(seq.detokenizer.take_delta(finished=reason is not None))
        if reason:
            break
    return deltas, reason, seq


def test_multibyte_utf8_split_across_tokens_is_held_back() -> None:
    text = "aé€😀b"
    deltas, reason, _ = feed(list(text.encode()), SamplingParams(max_tokens=100))
    assert "".join(deltas) == text and reason is None
    assert all("\ufffd" not in d for d in deltas), f"incomplete characters leaked: {deltas}"
    assert deltas[:4] == ["a", "", "é", ""], "the first byte of a 2-byte char emits nothing"


@pytest.mark.parametrize(
    "text,stop,expected",
    [
        ("hello STOP world", ["STOP"], "hello "),
        ("abcSTxSTOP", ["STOP", "xyz"], "abcSTx"),
        ("no stop here", ["STOP"], "no stop here"),
        ("aé€b", ["€"], "aé"),
    ],
)
def test_stop_strings_split_across_tokens_are_never_emitted(text: str, stop: list[str], expected: str) -> None:
    params = SamplingParams(max_tokens=len(text.encode()), stop=stop)
    deltas, reason, seq = feed(list(text.encode()), params)
    assert "".join(deltas) == expected
    assert reason == ("stop" if expected != text else "length")
    assert seq.output_text == expected


def test_stop_prefix_is_held_back_until_it_cannot_be_a_stop() -> None:
    deltas, _, _ = feed(list(b"abSTx"), SamplingParams(max_tokens=100, stop=["STOP"]))
    assert deltas == ["a", "b", "", "", "STx"]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_finishes_with_stop_and_is_not_in_text(ignore_eos: bool) -> None:
    deltas, reason, seq = feed([104, 105, 257, 106], SamplingParams(max_tokens=4, ignore_eos=ignore_eos))
    if ignore_eos:
        assert reason == "length" and "".join(deltas) == "hij"
    else:
        assert reason == "stop" and "".join(deltas) == "hi" and seq.output_token_ids == [104, 105, 257]


def test_stop_token_ids_and_flush_of_incomplete_text() -> None:
    deltas, reason, seq = feed([0xC3, 7], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    assert reason == "stop" and seq.output_token_ids == [0xC3, 7]
    assert "".join(deltas) == "\ufffd", "held-back bytes are flushed when the request ends"
