"""A chat request's answer plan: reasoning split before tool calls, the grammar starting after the
thinking, a forced call's grammar, and the whole and streamed answers agreeing."""

from __future__ import annotations

import json

import pytest

from tandem.services.frontend.chat_answer import ChatAnswer
from tandem.services.frontend.errors import APIError
from tandem.services.frontend.schemas import ChatCompletionRequest
from tandem.shared.protocol.serving import StructuredOutput
from tandem.shared.text.chat_template import ChatTemplate, tiny_template

THINKING_TEMPLATE = ChatTemplate(
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
THINK_END_IDS = list(b"</think>")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def planned(template: ChatTemplate, body: ChatCompletionRequest) -> ChatAnswer:
    answer = ChatAnswer.plan(body, template, "qwen3", THINK_END_IDS)
    prompt = template.render(body.template_messages(), **answer.template_variables(body))
    return answer.after_prompt(prompt)


def test_a_thinking_model_answer_splits_reasoning_from_content() -> None:
    answer = planned(THINKING_TEMPLATE, request())
    assert answer.thinks and answer.starts_in_reasoning and answer.start_after == THINK_END_IDS
    message, reason = answer.message("let me see\n</think>\n\n42", "stop")
    assert (message.reasoning_content, message.content, message.tool_calls, reason) == \
        ("let me see", "42", None, "stop")


def test_a_prompt_that_closed_the_thinking_starts_grammars_at_once() -> None:
    body = request(chat_template_kwargs={"enable_thinking": False},
                   response_format={"type": "json_object"})
    answer = planned(THINKING_TEMPLATE, body)
    assert answer.reasoning_closed and answer.start_after == []
    spec = StructuredOutput(kind="json_object")
    assert answer.constrain({"structured_output": spec}, body)["structured_output"].start_after == []


def test_a_response_format_starts_after_the_thinking() -> None:
    body = request(response_format={"type": "json_object"})
    answer = planned(THINKING_TEMPLATE, body)
    params = answer.constrain({"structured_output": StructuredOutput(kind="json_object")}, body)
    assert params["structured_output"].start_after == THINK_END_IDS


def test_a_forced_call_is_a_grammar_and_refuses_a_response_format_beside_it() -> None:
    body = request(tools=TOOLS, tool_choice="required")
    answer = planned(tiny_template(), body)
    spec = answer.constrain({}, body)["structured_output"]
    assert spec.kind == "lark" and "<tool_call>" in spec.spec and spec.start_after == []
    with pytest.raises(APIError) as raised:
        answer.constrain({"structured_output": StructuredOutput(kind="json_object")}, body)
    assert raised.value.body.error.param == "tool_choice"


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streamed_calls_and_reasoning_equal_the_whole_answer(chunk: int) -> None:
    body = request(tools=TOOLS)
    answer = planned(THINKING_TEMPLATE, body)
    text = 'plan\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    whole, reason = answer.message(text, "stop")
    stream = answer.stream()
    deltas = [d for i in range(0, len(text), chunk) for d in stream.feed(text[i: i + chunk])] + stream.finish()
    assert "".join(d.reasoning_content or "" for d in deltas) == whole.reasoning_content == "plan"
    arguments = "".join(call["function"].get("arguments", "") for d in deltas for call in d.tool_calls or [])
    assert json.loads(arguments) == {"a": 1} == json.loads(whole.tool_calls[0]["function"]["arguments"])
    assert reason == stream.finish_reason("stop") == "tool_calls" and whole.content is None


def test_tool_choice_none_leaves_a_call_as_content() -> None:
    body = request(tools=TOOLS, tool_choice="none")
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    message, reason = planned(tiny_template(), body).message(text, "stop")
    assert (message.content, message.tool_calls, reason) == (text, None, "stop")


def test_bad_tools_are_a_400_naming_the_field() -> None:
    with pytest.raises(APIError) as raised:
        ChatAnswer.plan(request(tools=[{"type": "function", "function": {}}]), tiny_template(), "tiny", [])
    assert raised.value.status == 400 and raised.value.body.error.param == "tools"
