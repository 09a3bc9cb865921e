"""The frontend's request handling without a bus: prompt forms, refused fields, error shapes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.client import (
    InvalidRequestError,
    NoWorkersError,
    OverloadedError,
    PromptTooLongError,
    ShuttingDownError,
    UnknownModelError,
    WorkerFailureError,
)
from tandem.services.frontend.errors import APIError, from_tandem, from_validation
from tandem.services.frontend.logprobs import TokenText, asked_logprobs, chat_logprobs, completion_logprobs
from tandem.services.frontend.schemas import ChatCompletionRequest, CompletionRequest, unsupported
from tandem.shared.protocol.serving import SamplingParams, TokenLogprobs
from tandem.shared.text.tokenizer import ByteTokenizer


@pytest.mark.parametrize("prompt,expected", [
    ("text", ["text"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_openai_prompt_form_is_a_list_of_prompts(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("field,value", [("echo", True), ("suffix", "x")])
def test_completion_fields_the_engine_lacks_are_named(field, value):
    assert unsupported(CompletionRequest(prompt="x", **{field: value})) == field


@pytest.mark.parametrize("field,value", [
    ("n", 2), ("best_of", 3), ("presence_penalty", 0.1), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2),
    ("logit_bias", {"1": 2.0}), ("min_tokens", 2), ("use_beam_search", True), ("prompt_logprobs", 1),
])
def test_fields_the_engine_has_now_are_not_refused(field, value):
    assert unsupported(CompletionRequest(prompt="x", **{field: value})) is None


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function"}]), ("tool_choice", "required"),
                                         ("response_format", {"type": "json_object"}), ("guided_regex", "a+")])
def test_tools_and_structured_outputs_are_not_refused_as_unsupported(field, value):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **{field: value})
    assert unsupported(request) is None


@pytest.mark.parametrize("fields", [{}, {"n": 1, "logprobs": False, "presence_penalty": 0, "best_of": 1},
                                    {"unknown_field": 3, "user": "me"}])
def test_defaults_and_unknown_fields_are_accepted(fields):
    assert unsupported(CompletionRequest(prompt="x", **fields)) is None


def test_chat_prefers_max_completion_tokens():
    both = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7)
    assert both.asked_max_tokens() == 7
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).asked_max_tokens() is None


def test_a_check_across_fields_names_the_field_it_blames():
    with pytest.raises(ValidationError) as caught:
        SamplingParams(n=3, best_of=2)
    error = from_validation(caught.value)
    assert (error.status, error.body.error.param) == (400, "best_of")
    assert error.message == "best_of (2) must be at least n (3)"


def test_a_bound_error_names_the_field_as_the_client_sent_it():
    with pytest.raises(ValidationError) as caught:
        SamplingParams(max_tokens=0)
    error = from_validation(caught.value, {"max_tokens": "max_completion_tokens"})
    assert error.status == 400 and error.body.error.param == "max_completion_tokens"
    assert error.message == "max_completion_tokens: Input should be greater than or equal to 1"


@pytest.mark.parametrize("exc,param,status,code", [
    (UnknownModelError("unknown_model: x"), None, 404, "model_not_found"),
    (PromptTooLongError("prompt_too_long: x"), "prompt", 400, "context_length_exceeded"),
    (InvalidRequestError("invalid_request: max_tokens is 9"), "max_tokens", 400, "context_length_exceeded"),
    (InvalidRequestError("invalid_request: x"), None, 400, "invalid_value"),
    (NoWorkersError("no_workers: x"), None, 503, "no_workers"),
    (OverloadedError("overloaded: x"), None, 429, "overloaded"),
    (ShuttingDownError("shutting_down: x"), None, 503, "shutting_down"),  # the deployment is stopping
    (WorkerFailureError("worker_failure: x"), None, 500, "worker_failure"),
])
def test_bus_errors_map_to_openai_statuses(exc, param, status, code):
    error = from_tandem(exc, param)
    assert (error.status, error.body.error.code, error.body.error.param) == (status, code, param or
                                                                             ("model" if status == 404 else None))


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


@pytest.mark.parametrize("request_,expected", [
    (CompletionRequest(prompt="x"), None),
    (CompletionRequest(prompt="x", logprobs=0), 0),
    (CompletionRequest(prompt="x", logprobs=3), 3),
    (chat(), None),
    (chat(logprobs=False), None),
    (chat(logprobs=True), 0),
    (chat(logprobs=True, top_logprobs=4), 4),
], ids=lambda v: repr(v)[:40])
def test_logprobs_asked_the_openai_way(request_, expected):
    assert asked_logprobs(request_) == expected


@pytest.mark.parametrize("request_,param", [
    (CompletionRequest(prompt="x", logprobs=True), "logprobs"),
    (CompletionRequest(prompt="x", logprobs="2"), "logprobs"),
    (chat(logprobs=2), "logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logprobs=False, top_logprobs=2), "top_logprobs"),
], ids=lambda v: repr(v)[:40])
def test_logprobs_of_the_wrong_kind_are_refused_by_field(request_, param):
    with pytest.raises(APIError) as caught:
        asked_logprobs(request_)
    assert caught.value.status == 400 and caught.value.body.error.param == param


ENTRIES = [TokenLogprobs(logprob=-0.5, top=[(104, -0.5), (105, -1.5)]),
           TokenLogprobs(logprob=-2.0, top=[(33, -0.25), (105, -1.75)])]


def test_completion_logprobs_shape_offsets_and_sampled_token_in_top():
    text_of = TokenText(ByteTokenizer())
    shaped = completion_logprobs([104, 105], ENTRIES, text_of, text_offset=7)
    assert shaped.tokens == ["h", "i"]
    assert shaped.token_logprobs == [-0.5, -2.0]
    assert shaped.top_logprobs == [{"h": -0.5, "i": -1.5}, {"!": -0.25, "i": -1.75}]
    assert shaped.text_offset == [7, 8]


def test_chat_logprobs_shape_has_bytes_and_exactly_the_top():
    shaped = chat_logprobs([104, 105], ENTRIES, TokenText(ByteTokenizer())).model_dump()
    first = shaped["content"][0]
    assert first == {"token": "h", "logprob": -0.5, "bytes": [104],
                     "top_logprobs": [{"token": "h", "logprob": -0.5, "bytes": [104]},
                                      {"token": "i", "logprob": -1.5, "bytes": [105]}]}
    assert [t["token"] for t in shaped["content"][1]["top_logprobs"]] == ["!", "i"]
