"""An OpenAI request's fields as the bus's sampling parameters (services/frontend/sampling.py): each
field's mapping (``logit_bias``'s map to pairs, ``use_beam_search`` to a beam width, chat's
``top_logprobs``), and every refusal a 400 naming the field as the client sent it. No bus."""

from __future__ import annotations

import pytest

from tandem.services.frontend.errors import APIError
from tandem.services.frontend.sampling import sampling_params
from tandem.services.frontend.schemas import ChatCompletionRequest, CompletionRequest
from tandem.shared.protocol.serving import SamplingParams


def completion(**fields) -> dict:
    return sampling_params(CompletionRequest(prompt="x", **fields), 16, "max_tokens")


def chat(**fields) -> dict:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    return sampling_params(request, request.asked_max_tokens(), "max_completion_tokens"
                           if request.max_completion_tokens is not None else "max_tokens")


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, {}),
    ({"n": 3}, {"n": 3}),
    ({"n": 2, "best_of": 5}, {"n": 2, "best_of": 5}),
    ({"presence_penalty": 0.5, "frequency_penalty": -1.0}, {"presence_penalty": 0.5, "frequency_penalty": -1.0}),
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    ({"min_tokens": 4}, {"min_tokens": 4}),
    ({"seed": 11, "temperature": 0.5}, {"seed": 11, "temperature": 0.5}),
    ({"logit_bias": {"50": 100, "7": -2.5}}, {"logit_bias": [(50, 100), (7, -2.5)]}),
    ({"logprobs": 2, "prompt_logprobs": 3}, {"logprobs": 2, "prompt_logprobs": 3}),
    ({"use_beam_search": True, "n": 3}, {"n": 3, "beam_width": 3}),
    ({"use_beam_search": True, "n": 2, "best_of": 4, "length_penalty": 0.5, "early_stopping": "never"},
     {"n": 2, "beam_width": 4, "length_penalty": 0.5, "early_stopping": "never"}),
    ({"use_beam_search": True, "best_of": 3, "early_stopping": True}, {"beam_width": 3, "early_stopping": True}),
], ids=["defaults", "n", "best_of", "presence+frequency", "repetition", "min_tokens", "seed", "logit_bias",
        "logprobs", "beams=n", "beams=best_of", "early_stopping"])
def test_completion_fields_map_to_the_bus(fields, expected):
    params = completion(**fields)
    assert params == {"max_tokens": 16, "stop": [], "ignore_eos": False, **expected}
    SamplingParams(**params)  # and the bus takes them


def test_chat_asks_top_logprobs_as_the_bus_logprobs():
    assert chat(logprobs=True, top_logprobs=3, n=2)["logprobs"] == 3
    assert chat(n=2, best_of=2)["n"] == 2


BAD = [
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 65}, "n", "less than or equal to 64"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"min_tokens": 20}, "min_tokens", "min_tokens (20) must not exceed max_tokens (16)"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "keys are token ids, not 'x'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "the bias of '5': Input should be less than or equal to 100"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "the token id of '-1'"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt_logprobs": True}, "prompt_logprobs", "an integer"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not with stream"),
    ({"use_beam_search": True}, "n", "more than one beam"),
    ({"use_beam_search": True, "best_of": 1}, "best_of", "more than one beam"),
    ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
    ({"use_beam_search": True, "n": 2, "stop": "\n"}, "stop", "stop strings do not apply to beam search"),
    ({"use_beam_search": True, "best_of": 65}, "best_of", "less than or equal to 64"),
    ({"use_beam_search": True, "n": 2, "presence_penalty": 0.5}, "presence_penalty",
     "presence_penalty does not apply to beam search"),
    ({"use_beam_search": True, "n": 2, "logit_bias": {"5": 1}}, "logit_bias",
     "logit_bias does not apply to beam search"),
    ({"length_penalty": 0.5}, "length_penalty", "applies to beam search only"),
    ({"early_stopping": True}, "early_stopping", "applies to beam search only"),
    ({"echo": True}, "echo", "not supported"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD, ids=[" ".join(f"{k}={v!r}" for k, v in f.items())[:40]
                                                                 for f, *_ in BAD])
def test_bad_fields_are_a_400_naming_the_field(fields, param, says):
    with pytest.raises(APIError) as caught:
        completion(**fields)
    body = caught.value.body.error
    assert (caught.value.status, body.param) == (400, param), body
    assert says in body.message, body.message


def test_a_chat_min_tokens_above_max_completion_tokens_names_it():
    with pytest.raises(APIError) as caught:
        chat(min_tokens=9, max_completion_tokens=4)
    assert caught.value.body.error.param == "min_tokens"
