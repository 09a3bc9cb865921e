"""What a chat request asks of its answer beyond text, and how each choice's text becomes that answer.

A :class:`ChatAnswer` is planned once per request, before the prompt is rendered: the request's
``tools`` and ``tool_choice`` (checked, a 400 naming the field), the model's tool-call format, and
whether the model thinks first. Once the prompt is rendered it knows whether the output begins
inside a ``<think>`` section. It then adds to the sampling parameters what the engine must enforce:
the grammar that forces a call (``tool_choice`` "required" or a named function) and, for a model
that thinks, ``start_after`` (the ``</think>`` token ids), so a grammar constrains the answer and
never the reasoning. Each choice's text is read by the reasoning splitter and then by the tool-call
parser, whole (:meth:`ChatAnswer.message`) or streamed (:class:`ChoiceStream`); a choice that made
calls ends with ``finish_reason`` "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tandem.services.frontend import schemas
from tandem.services.frontend.errors import bad_request
from tandem.services.frontend.reasoning import CONTENT, ReasoningStream, reasoning_markers, reasoning_state
from tandem.services.frontend.tool_calls import (
    Tool,
    ToolCallFormat,
    ToolCallStream,
    ToolChoice,
    ToolError,
    forced_tool_grammar,
    tool_call_format,
    validate_tool_choice,
    validate_tools,
)
from tandem.shared.protocol.serving import StructuredOutput
from tandem.shared.structured.grammars import StructuredOutputError, check
from tandem.shared.text.chat_template import ChatTemplate

THINK_END = "</think>"


def _lark_error(lark: str) -> str:
    try:
        check(StructuredOutput(kind="lark", spec=lark))
    except StructuredOutputError as exc:
        return str(exc)
    return ""


@dataclass
class ChatAnswer:
    """One chat request's answer plan (see the module docstring)."""

    tools: list[Tool] = field(default_factory=list)
    choice: ToolChoice | None = None
    format: ToolCallFormat | None = None
    thinks: bool = False  # the model's template knows <think> sections
    starts_in_reasoning: bool = False  # the rendered prompt opened one
    reasoning_closed: bool = False  # the rendered prompt closed one (the model answers directly)
    think_end_ids: list[int] = field(default_factory=list)

    @classmethod
    def plan(cls, request: schemas.ChatCompletionRequest, template: ChatTemplate | None, model_name: str,
             think_end_ids: list[int]) -> ChatAnswer:
        """The plan for ``request``; a 400 naming the field for bad ``tools`` or ``tool_choice``."""
        try:
            tools = validate_tools(request.tools) if request.tools else []
            choice = validate_tool_choice(request.tool_choice, tools)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param.split("[")[0].split(".")[0]) from None
        source = None if template is None else template.source
        return cls(tools, choice, tool_call_format(source, model_name), reasoning_markers(source),
                   think_end_ids=think_end_ids)

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice is not None and self.choice.mode != "none"

    def template_variables(self, request: schemas.ChatCompletionRequest) -> dict[str, Any]:
        """What the chat template renders with beyond the messages: the tools (as the request sent
        them, which is what HF templates read) and vLLM's ``chat_template_kwargs``."""
        variables = dict(request.chat_template_kwargs or {})
        if self.tools:
            variables["tools"] = request.tools
        return variables

    def after_prompt(self, prompt_text: str) -> ChatAnswer:
        if not self.thinks:
            return self
        state = reasoning_state(prompt_text)
        return replace(self, starts_in_reasoning=state == "inside", reasoning_closed=state == "closed")

    @property
    def start_after(self) -> list[int]:
        """Token ids a grammar waits for: the end of the thinking, unless the prompt closed it."""
        return [] if not self.thinks or self.reasoning_closed else list(self.think_end_ids)

    def constrain(self, params: dict, request: schemas.ChatCompletionRequest) -> dict:
        """``params`` with what the engine must enforce: a forced call's grammar, and the
        reasoning's end as the start of any grammar."""
        try:
            forced = forced_tool_grammar(self.tools, self.choice, request.parallel_tool_calls, self.format,
                                         start_after=self.start_after, check=_lark_error) if self.tools else None
        except ToolError as exc:
            raise bad_request(str(exc), exc.param.split("[")[0].split(".")[0]) from None
        asked = params.get("structured_output")
        if forced is not None and asked is not None:
            raise bad_request("tool_choice: a forced tool call and a structured output (response_format) cannot "
                              "both constrain the answer; ask for one", "tool_choice")
        if forced is not None:
            return {**params, "structured_output": forced}
        if asked is not None and self.start_after:
            return {**params, "structured_output": asked.model_copy(update={"start_after": self.start_after})}
        return params

    def message(self, text: str, finish_reason: str | None) -> tuple[schemas.ChatResponseMessage, str | None]:
        """A whole choice's message and its finish reason."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        reasoning = "".join(d.reasoning_content or "" for d in deltas) or None
        content = "".join(d.content or "" for d in deltas)
        calls = stream.tool_calls()
        message = schemas.ChatResponseMessage(
            content=content if content or not calls else None, reasoning_content=reasoning,
            tool_calls=[call.openai() for call in calls] or None)
        return message, stream.finish_reason(finish_reason)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI chat deltas out (reasoning, content, tool calls)."""

    def __init__(self, answer: ChatAnswer) -> None:
        self.reasoning = ReasoningStream(answer.starts_in_reasoning) if answer.thinks else None
        self.calls = ToolCallStream(answer.format, answer.tools) if answer.parses_calls else None

    def feed(self, text: str) -> list[schemas.ChatDelta]:
        return self._through(self.reasoning.feed(text) if self.reasoning else [(CONTENT, text)], final=False)

    def finish(self) -> list[schemas.ChatDelta]:
        return self._through(self.reasoning.finish() if self.reasoning else [], final=True)

    def tool_calls(self) -> list:
        return [] if self.calls is None else self.calls.tool_calls

    def finish_reason(self, reason: str | None) -> str | None:
        """A choice that ended by itself having made calls ends "tool_calls" (OpenAI's reason)."""
        return "tool_calls" if reason == "stop" and self.tool_calls() else reason

    def _through(self, pieces: list[tuple[str, str]], final: bool) -> list[schemas.ChatDelta]:
        deltas: list[schemas.ChatDelta] = []
        for kind, text in pieces:
            if kind != CONTENT:
                deltas.append(schemas.ChatDelta(reasoning_content=text))
            elif self.calls is None:
                deltas.append(schemas.ChatDelta(content=text))
            else:
                deltas += [_chat_delta(d.openai()) for d in self.calls.feed(text)]
        if final and self.calls is not None:
            deltas += [_chat_delta(d.openai()) for d in self.calls.finish()]
        return [d for d in deltas if d.content or d.reasoning_content or d.tool_calls]


def _chat_delta(delta: dict) -> schemas.ChatDelta:
    return schemas.ChatDelta(content=delta.get("content"), tool_calls=delta.get("tool_calls"))
