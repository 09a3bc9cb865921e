"""A request whose own part of an engine step raises ends alone; the rest of the batch goes on.

The failures are injected where they happened or could happen: the conversion of one request's
``top_k`` into the batch's sampling tensors (an abuse trial's ``top_k >= 2**63`` overflowed there
and failed every request batched with it; the edge refuses that value now, so the hook hands the
real conversion the overflowing value whenever it meets a marker value that passes validation),
and one request's detokenization. Each test checks that the bad request gets one "error" output,
that every other request gets exactly the greedy tokens, text and finish reason of a run without
it, that the pool is whole again and that the engine serves what comes next.
"""

from __future__ import annotations

import pytest
from factories import Result, engine_config, make_engine, make_prompts, make_request, run

import tandem.shared.engine.sampling as sampling
from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.sequence import EngineRequest, RequestOutput
from tandem.shared.protocol.serving import SamplingParams

CONFIG = engine_config(budget=64)  # prompts prefill over a few steps: batches mix prefill and decode
POISON_TOP_K = 4242  # valid on the wire; the hook turns it into the value that overflowed


def good_requests(tag: str = "g") -> list[EngineRequest]:
    prompts = make_prompts()
    return [make_request(f"{tag}{i}", prompts[i], max_tokens=6 + i) for i in (1, 4, 5, 7, 9)]


def bad_request() -> EngineRequest:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=POISON_TOP_K, seed=3, ignore_eos=True)
    return make_request("bad", make_prompts()[6], params=params)


def poison_top_k(monkeypatch, fail_from_call: int = 1) -> list[int]:
    """From the ``fail_from_call``-th conversion of a list holding ``POISON_TOP_K`` on, convert it as
    the overflowing ``2**63`` instead (the real conversion raises). Returns the calls seen, as a list
    whose length counts them."""
    real = sampling.host_values_to
    calls: list[int] = []

    def convert(device, values, dtype):
        if POISON_TOP_K in values:
            calls.append(1)
            if len(calls) >= fail_from_call:
                values = [2**63 if v == POISON_TOP_K else v for v in values]
        return real(device, values, dtype)

    monkeypatch.setattr(sampling, "host_values_to", convert)
    return calls


def step_to_end(engine: LLMEngine, requests: list[EngineRequest],
                max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    """Add ``requests``, step until nothing is left; every output, by request (those added before
    too). Checks that each request finished exactly once, with its last output."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_unfinished(), "engine did not finish"
    for request_id, outs in outputs.items():
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, f"{request_id} did not end once"
    return outputs


@pytest.fixture(scope="module")
def expected(tiny) -> dict[str, Result]:
    """The good requests run without the bad one (greedy: the same in every engine mode)."""
    return run(make_engine(tiny, CONFIG), good_requests())


def assert_isolated(engine: LLMEngine, got: dict[str, list[RequestOutput]], expected: dict[str, Result],
                    error_fragment: str) -> None:
    """The bad request ended with an error; the others match a run without it; the engine is whole
    and serves new requests exactly."""
    bad = got.pop("bad")
    assert bad[-1].finish_reason == "error" and error_fragment in bad[-1].error, bad[-1]
    assert all(o.error is None for o in bad[:-1])
    assert got.keys() == expected.keys()
    for request_id, want in expected.items():
        outs = got[request_id]
        assert [t for o in outs for t in o.new_token_ids] == want.tokens, f"{request_id}: tokens differ"
        assert "".join(o.text_delta for o in outs) == want.text, f"{request_id}: text differs"
        assert outs[-1].finish_reason == want.finish_reason and outs[-1].error is None
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0, "blocks leaked"
    later = run(engine, good_requests("later")[:2])  # run() checks the pool is whole again at its end
    assert [r.tokens for r in later.values()] == [r.tokens for r in expected.values()][:2]


MODES = pytest.mark.parametrize(("overlap", "async_output"), [(False, False), (False, True), (True, True)],
                                ids=["plain", "text-later", "overlap"])


@MODES
@pytest.mark.parametrize("fail_at", [1, 5], ids=["first-token", "mid-decode"])
def test_a_row_whose_sampling_values_fail_ends_alone(tiny, expected, monkeypatch, overlap, async_output,
                                                     fail_at) -> None:
    calls = poison_top_k(monkeypatch, fail_from_call=fail_at)
    engine = make_engine(tiny, CONFIG, overlap_steps=overlap, async_output=async_output)
    got = step_to_end(engine, [*good_requests(), bad_request()])
    assert len(calls) >= fail_at, "the bad row's top_k was never converted: nothing failed"
    emitted = sum(len(o.new_token_ids) for o in got["bad"])
    if overlap:  # tokens sampled but not yet reported when it failed are dropped with it
        assert emitted <= fail_at - 1
        assert engine.num_overlapped_steps > 0, "no step was overlapped: the test checks nothing"
    else:
        assert emitted == fail_at - 1, "the bad row's tokens before it failed"
    assert_isolated(engine, got, expected, "Overflow")


class FailingDecoder:
    """One request's tokenizer that breaks on its ``fail_at``-th decode (a token it cannot render)."""

    def __init__(self, tokenizer, fail_at: int) -> None:
        self.tokenizer, self.fail_at, self.calls = tokenizer, fail_at, 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise ValueError(f"cannot decode {ids[-1]}")
        return self.tokenizer.decode(ids)


@MODES
def test_a_row_whose_text_fails_ends_alone(tiny, expected, overlap, async_output) -> None:
    """Text is made in postprocessing (stop checks), or a step later with ``async_output``."""
    engine = make_engine(tiny, CONFIG, overlap_steps=overlap, async_output=async_output)
    engine.add_request(make_request("bad", make_prompts()[6], max_tokens=10))
    decoder = FailingDecoder(tiny.tokenizer, fail_at=7)  # two decodes per token: fails at the 4th
    engine.scheduler.requests["bad"].detokenizer.tokenizer = decoder
    got = step_to_end(engine, good_requests())
    assert decoder.calls >= decoder.fail_at, "the bad request's text never failed: the test checks nothing"
    if overlap:
        assert engine.num_overlapped_steps > 0, "no step was overlapped: the test checks nothing"
    assert_isolated(engine, got, expected, "cannot decode")


def test_a_failure_no_row_has_alone_still_fails_the_step(tiny, monkeypatch) -> None:
    """Sampling that fails for the batch but for no row alone (say, device memory) raises as before."""
    real = sampling.host_values_to

    def fail_batched(device, values, dtype):
        if len(values) > 1:
            raise RuntimeError("out of memory")
        return real(device, values, dtype)

    monkeypatch.setattr(sampling, "host_values_to", fail_batched)
    engine = make_engine(tiny, CONFIG)
    sampled = SamplingParams(max_tokens=4, temperature=1.0, top_k=5, seed=1)
    for i, prompt in enumerate(make_prompts()[:3]):
        engine.add_request(make_request(f"s{i}", prompt, params=sampled))
    with pytest.raises(RuntimeError, match="out of memory"):
        while engine.has_unfinished():
            engine.step()

