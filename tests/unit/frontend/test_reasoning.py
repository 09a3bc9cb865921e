"""Thinking split from the answer (services/frontend/reasoning.py): whole outputs, streamed ones
(which must agree for every way the text can arrive), and what a rendered prompt and a template
say about thinking."""

from __future__ import annotations

import random

import pytest

from tandem.services.frontend.reasoning import (
    CONTENT,
    REASONING,
    ReasoningStream,
    reasoning_markers,
    reasoning_state,
    split_reasoning,
)

# (id, starts_in_reasoning, output, reasoning_content, content)
SPLITS = [
    ("qwen3 after an opened prompt", True, "\nThe user wants 2+2.\n</think>\n\n4", "The user wants 2+2.", "4"),
    ("r1 opening itself", False, "<think>\nHmm.\nLet me see.\n\n</think>\n\nParis.", "Hmm.\nLet me see.", "Paris."),
    ("opening after whitespace", False, "\n<think>a</think>b", "a", "b"),
    ("no thinking", False, "Just the answer.\n", None, "Just the answer.\n"),
    ("answer keeps its own spaces", False, "  indented\n", None, "  indented\n"),
    ("empty thinking", False, "<think>\n\n</think>\n\nHi", None, "Hi"),
    ("cut while thinking", True, "Still thinking\n\n", "Still thinking", None),
    ("cut while opening", False, "<thi", None, "<thi"),
    ("cut in the closing", True, "abc</thi", "abc</thi", None),
    ("angle brackets in thinking", True, "a < b </ c <think>?\n</think>ok", "a < b </ c <think>?", "ok"),
    ("a later <think> is answer", False, "x <think>y</think>", None, "x <think>y</think>"),
    ("second close is answer", True, "r</think>c</think>d", "r", "c</think>d"),
    ("nothing", True, "", None, None),
    ("only whitespace", False, " \n", None, " \n"),
    ("thinking only", False, "<think>deep</think>", "deep", None),
    ("newlines inside kept", True, "one\n\ntwo\n</think>", "one\n\ntwo", None),
    ("tool call after thinking", True, "plan\n</think>\n\n<tool_call>\n{}\n</tool_call>", "plan",
     "<tool_call>\n{}\n</tool_call>"),
]


@pytest.mark.parametrize(("starts", "text", "reasoning", "content"), [s[1:] for s in SPLITS],
                         ids=[s[0] for s in SPLITS])
def test_split(starts: bool, text: str, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(text, starts) == (reasoning, content), f"{text!r} (starts in reasoning: {starts})"


def streamed(chunks: list[str], starts: bool) -> tuple[str | None, str | None]:
    stream = ReasoningStream(starts)
    pieces = [piece for chunk in chunks for piece in stream.feed(chunk)] + stream.finish()
    for name, text in pieces:
        assert name in (REASONING, CONTENT) and text, f"an empty or unnamed piece in {pieces}"
    reasoning = "".join(text for name, text in pieces if name == REASONING)
    content = "".join(text for name, text in pieces if name == CONTENT)
    return reasoning or None, content or None


@pytest.mark.parametrize(("starts", "text"), [s[1:3] for s in SPLITS], ids=[s[0] for s in SPLITS])
def test_streamed_split_agrees_for_every_chunking(starts: bool, text: str) -> None:
    whole = split_reasoning(text, starts)
    rng = random.Random(len(text))
    chunkings = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for chunks in chunkings:
        assert streamed(chunks, starts) == whole, f"{text!r} fed as {chunks}"


def test_reasoning_streams_before_the_answer() -> None:
    stream = ReasoningStream(starts_in_reasoning=True)
    assert stream.feed("\nFirst, ") == [(REASONING, "First, ")]
    assert stream.feed("add.\n</th") == [(REASONING, "add.")], "the newline and the partial marker wait"
    assert stream.feed("ink>\n\n") == [], "the newlines after </think> are dropped"
    assert stream.feed("4") == [(CONTENT, "4")]
    assert stream.finish() == []


@pytest.mark.parametrize(("prompt", "expected"), [
    ("<|im_start|>assistant\n<think>\n", "inside"),
    ("<｜Assistant｜><think>\n", "inside"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
    ("<|im_start|>assistant\n", "none"),
    ("<think>\nold</think>\n<|im_start|>assistant\n", "none"),
    ("", "none"),
], ids=["qwen3 thinking", "r1", "qwen3 enable_thinking=False", "plain", "past turn's thinking", "empty"])
def test_reasoning_state_of_the_prompt(prompt: str, expected: str) -> None:
    assert reasoning_state(prompt) == expected


@pytest.mark.parametrize(("source", "expected"), [
    ("{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}", True),
    ("{% set content = content.split('</think>')[-1] %}", True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    (None, False),
], ids=["qwen3", "r1", "plain", "no template"])
def test_reasoning_markers_of_the_template(source: str | None, expected: bool) -> None:
    assert reasoning_markers(source) is expected
