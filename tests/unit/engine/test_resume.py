"""A migrated request, as the engine sees it: output tokens sampled elsewhere (the client's resumed
ones) given with the prompt. On a prefill worker (``prefill_only``) the engine computes prompt and
resumed tokens, samples the next token (and only reports that one), and exports the KV of every
computed token; a decode engine taking that hand-off, or prefilling prompt and resumed tokens
itself, goes on token-exact and text-exact with the undisturbed run: greedy, seeded sampling,
penalties, ``min_tokens`` and a stop string, cut at every kind of place (before ``min_tokens`` is
reached, on and around a block edge).

Run: ``python3 -m pytest -q tests/unit/engine/test_resume.py``.
"""

from __future__ import annotations

import pytest
from factories import make_engine, make_prompts

from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.protocol.serving import SamplingParams

PARAMS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=40, temperature=0.8, seed=5, repetition_penalty=1.3,
                                presence_penalty=0.6, frequency_penalty=0.4, min_tokens=12, ignore_eos=True),
    "stop string": SamplingParams(max_tokens=40, temperature=0.7, seed=3, stop=["e", "in"], min_tokens=6),
}
CUTS = [1, 5, 7, 16, 17]  # resumed tokens: before min_tokens, on and around a 16-token block edge


def outputs_of(engine, request: EngineRequest) -> list[tuple[list[int], str, str | None]]:
    """Every output of ``request`` in order: (its new tokens, its text delta, its finish reason, its KV)."""
    engine.add_request(request)
    outputs = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        outputs += [(out.new_token_ids, out.text_delta, out.finish_reason, out.kv) for out in engine.step()]
    assert not engine.has_unfinished()
    return outputs


def undisturbed(tiny, prompt: list[int], params: SamplingParams):
    outputs = outputs_of(make_engine(tiny), EngineRequest("whole", prompt, params))
    tokens = [t for new, *_ in outputs for t in new]
    # The text a client had after k tokens: the deltas of the outputs up to the k-th token.
    text_after, text, count = {0: ""}, "", 0
    for new, delta, *_ in outputs:
        count, text = count + len(new), text + delta
        text_after[count] = text
    return tokens, text, outputs[-1][2], text_after


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("cut", CUTS)
def test_a_resumed_request_goes_on_token_exact_through_a_hand_off(tiny, kind: str, cut: int) -> None:
    prompt, params = make_prompts()[6], PARAMS[kind]
    tokens, text, reason, text_after = undisturbed(tiny, prompt, params)
    if cut >= len(tokens):
        pytest.skip(f"the undisturbed run ended after {len(tokens)} tokens")
    resumed = tokens[:cut]
    prefill = outputs_of(make_engine(tiny), EngineRequest("r", prompt, params, output_token_ids=resumed,
                                                          prefill_only=True))
    (new, first_text, first_reason, kv), = prefill
    assert new == [tokens[cut]], "the prefill worker samples the next token and reports only that one"
    if first_reason != "prefilled":  # that token ended the request
        assert (first_reason, text_after[cut] + first_text) == (reason, text)
        return
    block = 16
    assert kv.shape[0] == -(-(len(prompt) + cut) // block), "the KV of the prompt and the resumed tokens"
    rest = outputs_of(make_engine(tiny), EngineRequest("r", prompt, params, kv=kv, output_token_ids=resumed + new))
    assert resumed + new + [t for n, *_ in rest for t in n] == tokens
    assert text_after[cut] + first_text + "".join(d for _, d, *_ in rest) == text, "text deltas continue, no gap"
    assert rest[-1][2] == reason


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("cut", CUTS)
def test_a_resumed_request_goes_on_token_exact_prefilled_locally(tiny, kind: str, cut: int) -> None:
    prompt, params = make_prompts()[9], PARAMS[kind]
    tokens, text, reason, text_after = undisturbed(tiny, prompt, params)
    if cut >= len(tokens):
        pytest.skip(f"the undisturbed run ended after {len(tokens)} tokens")
    rest = outputs_of(make_engine(tiny), EngineRequest("r", prompt, params, output_token_ids=tokens[:cut]))
    assert tokens[:cut] + [t for n, *_ in rest for t in n] == tokens
    assert text_after[cut] + "".join(d for _, d, *_ in rest) == text
    assert rest[-1][2] == reason
