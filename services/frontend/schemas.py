"""The OpenAI API's request and response bodies, as pydantic models (what crosses the HTTP boundary).

Requests take OpenAI's fields and vLLM's extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``min_tokens``, ``prompt_logprobs``, ``priority``, the older vLLM server's beam search:
``use_beam_search`` with ``length_penalty`` and ``early_stopping``, and structured outputs:
``structured_outputs`` and ``guided_*``, see :mod:`.structured`). Fields the engine has no support
for yet (``echo``, ``suffix``) are declared, so that :func:`unsupported` can refuse them with
a 400 naming the field, instead of silently ignoring what a client asked for. Unknown fields are
ignored, as OpenAI's API and vLLM do. Value bounds are not repeated here: they are the bus's own
(:class:`tandem.shared.protocol.serving.SamplingParams`), checked when the request is built
(:mod:`tandem.services.frontend.sampling`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[int]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Completions: an int, the top alternatives per token; chat: a bool, with ``top_logprobs``
    # (see ``logprobs.asked_logprobs``).
    logprobs: Any = None
    top_logprobs: int | None = None
    # None: the bus's default (one output, no penalty, ...), as for the fields above.
    n: int | None = None
    best_of: int | None = None  # candidates to draw the n best from; with use_beam_search, the beam width
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    prompt_logprobs: Any = None  # an int (see sampling.asked_prompt_logprobs)
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # vLLM's extension: the order in the router's admission queue while the workers are saturated
    # (lower first, -100..100; the bus checks the bound).
    priority: int = 0
    # Structured outputs (see structured.py): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields.
    response_format: dict | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | TokenIds]:
        """One entry per prompt (OpenAI takes a string, strings, token ids, or lists of token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: handed to the template as they are

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's extension: more variables for the template (enable_thinking)

    def asked_max_tokens(self) -> int | None:
        """OpenAI deprecated ``max_tokens`` for chat in favour of ``max_completion_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


def unsupported(request: SamplingFields) -> str | None:
    """The first field asking for something the engine cannot do yet, or None."""
    if isinstance(request, CompletionRequest):
        if request.echo:
            return "echo"
        if request.suffix:
            return "suffix"
    return None


# -- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completion logprobs: per token its text, logprob, top alternatives (text to
    logprob, the sampled token included) and where its text starts in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's logprob at a prompt position, its rank there (1: the most
    likely; None: the prompt's own token when it is not among the top asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (None for the first): token id (a string, as JSON keys are) -> its logprob there.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with prompt_logprobs asked


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is tool calls only
    reasoning_content: str | None = None  # vLLM's field: a thinking model's <think> section
    tool_calls: list[dict] | None = None  # OpenAI's: {id, type: "function", function: {name, arguments}}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension: chat has one prompt for every choice


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # OpenAI's tool-call deltas: a call's first carries index, id, type and function.name, the
    # later ones only index and a piece of function.arguments.
    tool_calls: list[dict] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str | None = None  # the model the router loads (a directory, or "tiny"); an adapter's directory
    parent: str | None = None  # an adapter's base model (None: a base model)
    max_model_len: int | None = None
    vocab_size: int | None = None  # token ids in a prompt must be below it (a benchmark's random prompts)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
