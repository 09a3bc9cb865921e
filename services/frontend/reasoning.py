"""Reasoning models' thinking, split from their answer: ``<think>...</think>`` becomes ``reasoning_content``.

Qwen3 and the DeepSeek-R1 family think before they answer, between ``<think>`` and ``</think>``;
the HTTP API returns that text as the message's ``reasoning_content`` and the rest as its
``content`` (vLLM's field). The output may begin inside the thinking without writing ``<think>``:
Qwen3's template (and R1's) put it in the generation prompt, which :func:`reasoning_state` reads
off the rendered prompt. Otherwise an output that opens with ``<think>`` thinks first, and one that
does not is all answer.

Newlines around the thinking are dropped (those that open and close it, and those between
``</think>`` and the answer), as Qwen3's template drops them when it renders a past turn. An output
cut short while thinking is all reasoning. One machine, :class:`ReasoningStream`, reads outputs
streamed or whole (:func:`split_reasoning`), so the two agree.
"""

from __future__ import annotations

import re
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING = "reasoning_content"
CONTENT = "content"

Field = Literal["reasoning_content", "content"]
_WS = " \t\n\r"
_CLOSED = re.compile(r"<think>\s*</think>\s*\Z")
_INSIDE = re.compile(r"<think>\s*\Z")


def reasoning_markers(template_source: str | None) -> bool:
    """Whether a chat template knows thinking sections (its model may write ``<think>``)."""
    return bool(template_source) and (THINK_OPEN in template_source or THINK_CLOSE in template_source)


def reasoning_state(prompt_text: str) -> Literal["inside", "closed", "none"]:
    """What the rendered prompt's end says about thinking: "inside" (it opened ``<think>``: the
    output begins in the thinking), "closed" (an empty ``<think></think>``, as Qwen3 renders
    ``enable_thinking=False``: the model answers directly), or "none"."""
    if _CLOSED.search(prompt_text):
        return "closed"
    if _INSIDE.search(prompt_text):
        return "inside"
    return "none"


def split_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str | None]:
    """A finished output's (reasoning_content, content), each None where empty."""
    stream = ReasoningStream(starts_in_reasoning)
    parts = stream.feed(text) + stream.finish()
    reasoning = "".join(piece for name, piece in parts if name == REASONING)
    content = "".join(piece for name, piece in parts if name == CONTENT)
    return reasoning or None, content or None


class ReasoningStream:
    """Reads an output delta by delta into (field, text) pieces, ``field`` being "reasoning_content"
    or "content". Held back: what may be the start of a marker, an opening that may still become
    ``<think>``, and newlines that may turn out to end the thinking."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        # start: is there a <think> opening? reasoning, then answer_start (drop leading newlines), answer.
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""
        self._reasoning_shown = False  # newlines that open the thinking are dropped
        self._newlines = ""  # newlines inside the thinking, shown once more thinking follows them
        self._out: list[tuple[Field, str]] = []
        self._finished = False

    def feed(self, delta_text: str) -> list[tuple[Field, str]]:
        if self._finished:
            raise RuntimeError("the stream is finished")
        self._buffer += delta_text
        self._run(final=False)
        return self._flush()

    def finish(self) -> list[tuple[Field, str]]:
        if self._finished:
            return []
        self._run(final=True)
        self._finished = True
        return self._flush()

    def _run(self, final: bool) -> None:
        while self._buffer and self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._state == "start":
            opening = self._buffer.lstrip(_WS)
            if opening.startswith(THINK_OPEN):
                self._buffer = opening[len(THINK_OPEN):]
                self._state = "reasoning"
                return True
            if not final and THINK_OPEN.startswith(opening):
                return False
            self._state = "answer"
            return True
        if self._state == "reasoning":
            end = self._buffer.find(THINK_CLOSE)
            if end >= 0:
                self._reasoning(self._buffer[:end], closing=True)
                self._buffer = self._buffer[end + len(THINK_CLOSE):]
                self._state = "answer_start"
                return True
            keep = 0 if final else partial_suffix(self._buffer, THINK_CLOSE)
            self._reasoning(self._buffer[:len(self._buffer) - keep], closing=final)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        if self._state == "answer_start":
            answer = self._buffer.lstrip(_WS)
            if not answer:
                self._buffer = ""
                return False
            self._buffer = answer
            self._state = "answer"
            return True
        self._out.append((CONTENT, self._buffer))
        self._buffer = ""
        return False

    def _reasoning(self, text: str, closing: bool) -> None:
        if not self._reasoning_shown:
            text = text.lstrip("\n")
        if not text:
            return
        self._reasoning_shown = True
        body = text.rstrip("\n")
        if body:
            self._out.append((REASONING, self._newlines + body))
            self._newlines = ""
        self._newlines += text[len(body):]
        if closing:
            self._newlines = ""

    def _flush(self) -> list[tuple[Field, str]]:
        merged: list[tuple[Field, str]] = []
        for name, text in self._out:
            if merged and merged[-1][0] == name:
                merged[-1] = (name, merged[-1][1] + text)
            else:
                merged.append((name, text))
        self._out = []
        return merged


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (and is shorter than it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
