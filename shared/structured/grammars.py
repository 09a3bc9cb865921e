"""A :class:`StructuredOutput` as the grammar llguidance compiles, and the one-line errors of a bad one.

Torch-free and tokenizer-free, so the HTTP front end checks a request's schema or grammar (a 400
naming the problem) before any bus work, with the same code the workers compile it with.

JSON comes out compact (no whitespace between tokens, ``,`` and ``:`` separators): free whitespace
lets a sampling model pad its output with newlines until ``max_tokens`` runs out, which no caller
wants; the output is still any JSON parser's JSON.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

from tandem.shared.protocol.serving import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A structured output spec that cannot be compiled; the message is one line naming the problem."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for ``spec`` (raises :class:`StructuredOutputError` for a bad one)."""
    from llguidance import LLMatcher

    try:
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.kind == "json_schema":
            schema = parse_schema(spec.spec)
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # Each choice is a literal: Lark strings take JSON's escapes.
            alternatives = " | ".join(json.dumps(choice) for choice in spec.choices)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if spec.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return LLMatcher.grammar_from_lark(gbnf_to_lark(spec.spec))
        return LLMatcher.grammar_from_lark(spec.spec)
    except StructuredOutputError:
        raise
    except Exception as exc:  # llguidance and the GBNF converter raise ValueError, AssertionError, ...
        raise StructuredOutputError(f"{spec.kind}: {one_line(str(exc))}") from None


def check(spec: StructuredOutput) -> None:
    """Raise :class:`StructuredOutputError` unless ``spec`` compiles (without a vocabulary)."""
    error = _validate(grammar_text(spec))
    if error:
        raise StructuredOutputError(f"{spec.kind}: {error}")


@lru_cache(maxsize=256)
def _validate(grammar: str) -> str:
    """Why llguidance refuses ``grammar``, or "" (cached: a client repeats its schema)."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    return one_line(messages[0]) if is_error else ""


def parse_schema(text: str) -> dict:
    """A JSON schema's text as a dict. Keywords llguidance does not enforce it refuses itself
    ("Unimplemented keys"), so no schema is ever followed only in part."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise StructuredOutputError(f"json_schema: not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"json_schema: a schema is a JSON object, not {type(schema).__name__}")
    return schema


def spec_key(spec: StructuredOutput) -> str:
    """The compile cache's key: equal for specs that compile to the same grammar."""
    payload = json.dumps([spec.kind, spec.spec, spec.choices], separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def one_line(text: str) -> str:
    """llguidance's messages span lines (a caret under the spot): the first lines, joined."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip() and set(line.strip()) != {"^"}]
    return "; ".join(lines[:3])[:500]
