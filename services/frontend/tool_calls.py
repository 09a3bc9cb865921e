"""OpenAI tool calls: reading them out of a model's text, and the grammar that forces a model to make them.

A model calls a tool by writing text in the format its family was trained on; the HTTP API returns
that text as ``tool_calls`` instead of ``content``. Two formats are known (:func:`tool_call_format`
picks one from the chat template):

- **hermes** (Qwen2.5, Qwen3, tandem's tiny model): text, then any number of calls, each
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one per line.
- **llama3_json** (Llama 3.1 to 3.3): the whole message is ``{"name": "f", "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls joined by ``; ``.

One state machine, :class:`ToolCallStream`, reads both, streamed or whole (:func:`parse_tool_calls`
feeds it the whole text), so the two never disagree. A call is taken once its header is read, up
to the opening brace of its arguments: the marker, ``"name"`` naming one of the request's tools,
then ``"arguments"`` (or ``"parameters"``). Text that falls short of that (not JSON, an unknown
function, another key order) stays content. From then on the arguments stream as they arrive, and
only as far as they are a valid JSON prefix: a comma, a number or a literal is held until what
follows it shows it valid. Arguments that break off (the output was cut at max_tokens, or
the JSON goes wrong) are closed with the fewest characters that make them valid JSON (open strings
and brackets closed, a key given ``null``), so a client always receives parseable arguments; the
text after a break is content again. Whitespace-only text beside calls is dropped, and so is the
whitespace that opens the text after a call.

:func:`forced_tool_grammar` builds the llguidance Lark grammar for ``tool_choice="required"`` or a
named function: each call's text exactly as the parser reads it, its arguments constrained by the
function's ``parameters`` schema through llguidance's ``%json``, compact in the separators the
templates' ``tojson`` writes (``", "`` and ``": "``), so a forced call looks like the calls the
model saw in training. The request's ``tools`` and ``tool_choice`` are checked by
:func:`validate_tools` and :func:`validate_tool_choice`, whose :class:`ToolError` names the field.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.services.frontend.reasoning import partial_suffix
from tandem.shared.protocol.serving import MAX_STRUCTURED_SPEC_CHARS, StructuredOutput

MAX_TOOLS = 128  # tools per request: each is rendered into the prompt and may become a grammar rule
MAX_TOOL_NAME_CHARS = 64  # OpenAI's bound
# OpenAI's characters, plus the '.' and ':' of namespaced (MCP-style) tool names.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
TOOL_CHOICE_MODES = ("none", "auto", "required")

_WS = " \t\n\r"
# Whitespace a call's header or closing may hold between its tokens: more is not a call, and the
# bound keeps a header short enough to be re-read whole at every delta.
MAX_HEADER_WS = 64
_MAX_RAW_NAME = 4 * MAX_TOOL_NAME_CHARS  # a quoted name, escapes and all
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-|-?(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
# How forced JSON is written: the separators of json.dumps, which the chat templates' tojson uses
# (the calls the model saw in its prompts), and no other whitespace (free whitespace lets a sampling
# model pad until max_tokens). A schema keyword llguidance does not implement is refused, as for
# response_format, so no schema is ever followed only in part.
GRAMMAR_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


# --- formats --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes tool calls.

    ``call_open`` + ``{"name": ..., "<arguments_key>": {...}}`` + ``call_close`` is one call and
    ``separator`` joins calls. ``after_text``: a call may follow text (hermes); otherwise calls
    are the whole message, optionally after one of ``prefixes``.
    """

    name: str
    arguments_key: str
    call_open: str
    call_close: str
    separator: str
    after_text: bool
    prefixes: tuple[str, ...] = ()

    @property
    def marker(self) -> str:
        return self.call_open.strip(_WS)


HERMES = ToolCallFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", after_text=True)
LLAMA3_JSON = ToolCallFormat("llama3_json", "parameters", "", "", "; ", after_text=False,
                             prefixes=("<|python_tag|>",))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}
_LLAMA_HINTS = ("<|python_tag|>", "ipython", '"parameters"')


def tool_call_format(template_source: str | None, model_name: str) -> ToolCallFormat:
    """The format a model writes calls in, read off its chat template (what it was trained to see
    in past turns): ``<tool_call>`` is hermes; Llama 3.1's ``<|python_tag|>``, ``ipython`` role or
    ``"parameters"`` key is llama3_json. Without a template, a Llama 3 name is llama3_json;
    hermes otherwise (the tiny model's template is hermes)."""
    if template_source:
        if HERMES.marker in template_source:
            return HERMES
        if any(hint in template_source for hint in _LLAMA_HINTS):
            return LLAMA3_JSON
        return HERMES
    if re.search(r"llama[-_ ]?3", model_name, re.IGNORECASE):
        return LLAMA3_JSON
    return HERMES


# --- the request's tools --------------------------------------------------------------------------


class ToolError(ValueError):
    """A request's ``tools`` or ``tool_choice`` is wrong; ``param`` is the field, the message one line."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"{param}: {problem}")
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call. ``parameters`` is its arguments' JSON schema (a function
    declared without one takes no arguments, as in OpenAI's API)."""

    name: str
    parameters: Mapping[str, Any]
    description: str | None = None


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` "function" forces a call to ``name``; "required" a call to any tool."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


# Where only the names matter (parsing): validated tools, the request's raw tool objects, or names.
ToolNames = Iterable[Tool | Mapping[str, Any] | str]
NO_ARGUMENTS: Mapping[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def validate_tools(tools: Any) -> list[Tool]:
    """The request's ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``), checked."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools", "must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools, not {len(tools)}")
    checked: list[Tool] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if isinstance(tool, Tool):
            checked.append(tool)
            continue
        if not isinstance(tool, Mapping):
            raise ToolError(where, "must be an object")
        if "type" not in tool:
            raise ToolError(f"{where}.type", "required")
        if tool["type"] != "function":
            raise ToolError(f"{where}.type", f'must be "function", not {_shown(tool["type"])}')
        function = tool.get("function")
        if function is None:
            raise ToolError(f"{where}.function", "required")
        if not isinstance(function, Mapping):
            raise ToolError(f"{where}.function", "must be an object")
        name = function.get("name")
        if name is None:
            raise ToolError(f"{where}.function.name", "required")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name",
                            f"must be 1 to {MAX_TOOL_NAME_CHARS} letters, digits, '_', '-', '.' or ':', "
                            f"not {_shown(name)}")
        if name in seen:
            raise ToolError(f"{where}.function.name", f'"{name}" is declared twice')
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_ARGUMENTS
        elif not isinstance(parameters, Mapping):
            raise ToolError(f"{where}.function.parameters", "not a JSON schema object")
        elif parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.function.parameters",
                            f'must describe an object (type "object"), not type {_shown(parameters["type"])}')
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolError(f"{where}.function.strict", "must be a boolean")
        checked.append(Tool(name, parameters, description))
    return checked


def validate_tool_choice(tool_choice: Any, tools: ToolNames) -> ToolChoice:
    """The request's ``tool_choice``, checked against its tools (validated, raw, or names). Left
    out, it is "auto" with tools and "none" without, as in OpenAI's API."""
    names = tool_names(tools)
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, ToolChoice):
        choice = tool_choice
    elif isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise ToolError("tool_choice",
                            f'must be "none", "auto", "required" or a function, not {_shown(tool_choice)}')
        choice = ToolChoice(tool_choice)  # type: ignore[arg-type]
    elif isinstance(tool_choice, Mapping):
        if tool_choice.get("type") != "function":
            raise ToolError("tool_choice.type", f'must be "function", not {_shown(tool_choice.get("type"))}')
        function = tool_choice.get("function")
        if not isinstance(function, Mapping):
            raise ToolError("tool_choice.function", "must be an object with the function's name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError("tool_choice.function.name", "required")
        choice = ToolChoice("function", name)
    else:
        raise ToolError("tool_choice", 'must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if choice.mode == "required" and not names:
        raise ToolError("tool_choice", '"required" needs tools')
    if choice.mode == "function" and choice.name not in names:
        raise ToolError("tool_choice", f'function "{choice.name}" is not among tools')
    return choice


def _shown(value: Any) -> str:
    """A client's value in an error message: JSON for a scalar, the type's name otherwise, shortened."""
    if isinstance(value, str | int | float | bool | None):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


# --- the forcing grammar --------------------------------------------------------------------------


def forced_tool_grammar(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None,
                        format: ToolCallFormat, *, start_after: Sequence[int] = (),
                        check: Callable[[str], str] | None = None) -> StructuredOutput | None:
    """The structured output that forces ``tool_choice``'s calls, or None where nothing is forced.

    "required": one call to any of ``tools`` (one or more when ``parallel_tool_calls``, which is
    OpenAI's default); a named function: one call to it. Each call's arguments satisfy that
    function's ``parameters``. ``tools`` and ``tool_choice`` are the request's, validated here, or
    what :func:`validate_tools` and :func:`validate_tool_choice` returned. ``start_after``: the
    token ids (``</think>``) after which the calls begin. ``check``, given a Lark grammar, returns
    llguidance's error ('' where it compiles), e.g.
    ``lambda lark: LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark), None)``: with it, a
    schema llguidance cannot compile is a ToolError naming its tool.
    """
    checked = validate_tools(tools)
    choice = validate_tool_choice(tool_choice, checked)
    if not choice.forced:
        return None
    indexed = [(index, tool) for index, tool in enumerate(checked)
               if choice.mode == "required" or tool.name == choice.name]
    several = choice.mode == "required" and parallel_tool_calls is not False
    lark = _call_grammar(indexed, format, several)
    if len(lark) > MAX_STRUCTURED_SPEC_CHARS:
        param = "tools" if choice.mode == "required" else f"tools[{indexed[0][0]}].function.parameters"
        raise ToolError(param, f"too large to force a call: its grammar would be {len(lark)} characters, "
                               f"over the {MAX_STRUCTURED_SPEC_CHARS} a request may carry")
    if check is not None and (error := check(lark)):
        for index, tool in indexed:
            if own := check(_call_grammar([(index, tool)], format, several=False)):
                error, param = own, f"tools[{index}].function.parameters"
                break
        else:
            param = "tools"
        raise ToolError(param, f"cannot be forced: {_first_line(error)}")
    return StructuredOutput(kind="lark", spec=lark, start_after=list(start_after))


def _call_grammar(indexed: Sequence[tuple[int, Tool]], format: ToolCallFormat, several: bool) -> str:
    """Lark text: ``start`` is one call (or several, joined by the format's separator) to one of
    the tools, each written exactly as :class:`ToolCallStream` reads it. A call's frame is literal
    text and its arguments an embedded schema of their own (rules named after the tool's index), so
    a schema's ``$ref`` to its own ``$defs`` still resolves."""
    lines = [f"start: {'LEAD? ' if format.after_text else ''}call"
             + (f" ({_lark_literal(format.separator)} call)*" if several else "")]
    if format.after_text:
        # After a reasoning section the model writes a blank line before its calls.
        lines.append(r"LEAD: /\n\n?/")
    lines.append("call: " + " | ".join(f"call_{index}" for index, _ in indexed))
    for index, tool in indexed:
        head = f'{format.call_open}{{"name": {json.dumps(tool.name)}, "{format.arguments_key}": '
        tail = "}" + format.call_close
        lines.append(f"call_{index}: {_lark_literal(head)} args_{index} {_lark_literal(tail)}")
        schema = {**tool.parameters, "x-guidance": GRAMMAR_JSON_OPTIONS}
        lines.append(f"args_{index}: %json {json.dumps(schema, separators=(',', ':'))}")
    return "\n".join(lines) + "\n"


def _lark_literal(text: str) -> str:
    """A Lark string literal: JSON's escapes are Lark's."""
    return json.dumps(text)


def _first_line(text: str) -> str:
    """llguidance's error without the place in the grammar or the grammar's lines quoted after it
    (text the client never saw), also where they were joined onto one line."""
    line = next((line.strip() for line in str(text).splitlines() if line.strip()), "invalid grammar")
    line = re.sub(r"^(?:lark: )?at \d+\(\d+\): ", "", line)
    return re.split(r";\s+\d+\s+\|", line)[0]


# --- parsing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One call, as OpenAI returns it: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    """A finished output as an assistant message: ``content`` None where there is none."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: its first piece has ``id`` and ``name``, the later ones only
    more ``arguments`` text (what OpenAI's stream helpers accumulate)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Delta:
    """One chat-chunk delta: content text or a piece of a tool call."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None

    def openai(self) -> dict[str, Any]:
        """The chunk's ``delta`` object."""
        if self.tool_call is not None:
            return {"tool_calls": [self.tool_call.openai()]}
        return {"content": self.content}


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, format: ToolCallFormat, tools: ToolNames) -> ParsedMessage:
    """A finished output's content and calls. Never raises: what is not a call is content."""
    stream = ToolCallStream(format, tools)
    stream.feed(text)
    stream.finish()
    return stream.result()


def tool_names(tools: ToolNames) -> frozenset[str]:
    """The callable names among validated tools, the request's raw tool objects, or names."""
    names = set()
    for tool in tools or ():
        if isinstance(tool, Tool):
            names.add(tool.name)
        elif isinstance(tool, str):
            names.add(tool)
        elif isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping):
            name = tool["function"].get("name")
            if isinstance(name, str):
                names.add(name)
    return frozenset(names)


# A header or closing is a short sequence of pieces, matched again from its start at every delta.
@dataclass(frozen=True)
class _Piece:
    kind: Literal["text", "ws", "name"]
    texts: tuple[str, ...] = ()


def _text(*texts: str) -> _Piece:
    return _Piece("text", texts)


_SPACE = _Piece("ws")
_HEADER = (_text("{"), _SPACE, _text('"name"'), _SPACE, _text(":"), _SPACE, _Piece("name"), _SPACE, _text(","),
           _SPACE, _text('"arguments"', '"parameters"'), _SPACE, _text(":"), _SPACE, _text("{"))


@dataclass(frozen=True)
class _Match:
    status: Literal["match", "partial", "fail"]
    end: int  # match: past the pieces; fail: past the pieces matched whole before the failure
    name: str | None = None


def _match(pieces: Sequence[_Piece], text: str, final: bool) -> _Match:
    """Whether ``text`` starts with the pieces, may still (partial: it ends inside them), or cannot."""
    pos, name = 0, None
    for piece in pieces:
        start = pos
        if piece.kind == "ws":
            while pos < len(text) and text[pos] in _WS:
                pos += 1
            if pos - start > MAX_HEADER_WS:
                return _Match("fail", start)
            if pos == len(text) and not final:
                return _Match("partial", start)
        elif piece.kind == "name":
            end = _string_end(text, pos)
            if end == -1 and not final:
                return _Match("partial", start)
            if end < 0:
                return _Match("fail", start)
            name = json.loads(text[pos:end])
            pos = end
        else:
            rest = text[pos:]
            hit = next((t for t in piece.texts if rest.startswith(t)), None)
            if hit is not None:
                pos += len(hit)
            elif not final and any(t.startswith(rest) for t in piece.texts):
                return _Match("partial", start)
            else:
                return _Match("fail", start)
    return _Match("match", pos, name)


def _string_end(text: str, pos: int) -> int:
    """Past the JSON string at ``pos``; -1: it may go on past the text; -2: not a string (or too long)."""
    if pos >= len(text):
        return -1
    if text[pos] != '"':
        return -2
    i = pos + 1
    while i < len(text):
        if i - pos > _MAX_RAW_NAME:
            return -2
        char = text[i]
        if char == '"':
            return i + 1
        if char == "\\":
            escape = text[i + 1:i + 2]
            if escape == "u":
                digits = text[i + 2:i + 6]
                if any(d not in _HEX for d in digits):
                    return -2
                if len(digits) < 4:
                    return -1
                i += 6
                continue
            if not escape:
                return -1
            if escape not in _ESCAPES:
                return -2
            i += 2
            continue
        if ord(char) < 0x20:
            return -2
        i += 1
    return -1


class _JsonValue:
    """One JSON value's text, checked as it arrives.

    ``safe`` is how much of the text may be shown: a prefix that ``completion`` turns into valid
    JSON. A comma (with the whitespace after it), a number, a literal or an escape is held back until
    what follows shows it valid, so a break never leaves a dangling comma or a half number. Only the
    text not yet taken is kept (``pending``), so long arguments cost no more than short ones per delta.
    """

    def __init__(self) -> None:
        self.pending = ""  # consumed and not yet taken
        self.length = 0  # characters consumed
        self.taken = 0  # characters taken (shown)
        self.stack: list[str] = []
        self.state = "value"  # value, first_key, key, colon, after, array_first, string, number, literal, done
        self.in_key = False
        self.escape = ""  # a string escape in progress
        self.token = ""  # a number or literal in progress
        self.after_comma = False
        self.safe = 0
        self.completion = ""

    @property
    def done(self) -> bool:
        return self.state == "done"

    def feed(self, chunk: str) -> tuple[int, bool]:
        """Consume ``chunk`` until the value ends or goes wrong: (characters consumed, went wrong)."""
        for index, char in enumerate(chunk):
            if self.done:
                self.pending += chunk[:index]
                return index, False
            if not self._step(char):
                self.pending += chunk[:index]
                return index, True
            self.length += 1
            self._mark()
        self.pending += chunk
        return len(chunk), False

    def take(self, upto: int) -> str:
        """The pending text up to ``upto`` characters from the start, no longer pending."""
        text, self.pending = self.pending[:upto - self.taken], self.pending[upto - self.taken:]
        self.taken = upto
        return text

    def close(self) -> None:
        """The text has ended: a number that is whole counts, whatever else is held is dropped."""
        if self.state == "number" and _NUMBER.fullmatch(self.token):
            self.token = ""
            self._end_value()
            self._mark()

    def _step(self, char: str) -> bool:
        state = self.state
        if state == "string":
            return self._string(char)
        if state == "number":
            if char in "0123456789+-.eE" and _NUMBER_PREFIX.fullmatch(self.token + char):
                self.token += char
                return True
            if not _NUMBER.fullmatch(self.token):
                return False
            self.token = ""
            self._end_value()
            self._mark()  # the number is shown even when a held comma follows it
            return self._step(char)
        if state == "literal":
            word = _LITERALS[self.token[0]]
            if not word.startswith(self.token + char):
                return False
            self.token += char
            if self.token == word:
                self.token = ""
                self._end_value()
            return True
        if char in _WS:
            return True
        if state in ("value", "array_first"):
            if state == "array_first" and char == "]":
                return self._close_container("[")
            return self._value(char)
        if state in ("first_key", "key"):
            if char == '"':
                self.state, self.in_key, self.after_comma = "string", True, False
                return True
            return state == "first_key" and char == "}" and self._close_container("{")
        if state == "colon":
            if char == ":":
                self.state = "value"
                return True
            return False
        if state == "after":
            if char == ",":
                self.state = "key" if self.stack[-1] == "{" else "value"
                self.after_comma = True
                return True
            return char in "}]" and self._close_container("{" if char == "}" else "[")
        return False

    def _value(self, char: str) -> bool:
        if char in "{[":
            self.stack.append(char)
            self.state = "first_key" if char == "{" else "array_first"
        elif char == '"':
            self.state, self.in_key = "string", False
        elif char == "-" or char.isdigit() and char.isascii():
            self.state, self.token = "number", char
            return True  # held until it ends, comma and all
        elif char in _LITERALS:
            self.state, self.token = "literal", char
            return True
        else:
            return False
        self.after_comma = False
        return True

    def _string(self, char: str) -> bool:
        if self.escape:
            if self.escape == "\\":
                if char not in _ESCAPES + "u":
                    return False
                self.escape = "" if char != "u" else "\\u"
                return True
            if char not in _HEX:
                return False
            self.escape = "" if len(self.escape) == 5 else self.escape + char
            return True
        if char == "\\":
            self.escape = "\\"
        elif char == '"':
            if self.in_key:
                self.state = "colon"
            else:
                self._end_value()
        elif ord(char) < 0x20:
            return False
        return True

    def _close_container(self, opener: str) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self.after_comma = False
        self._end_value()
        return True

    def _end_value(self) -> None:
        self.state = "after" if self.stack else "done"
        self.after_comma = False  # a whole value follows the comma

    def _mark(self) -> None:
        """Record the text so far as safe to show, with the characters that would close it, where it is so."""
        if self.after_comma or self.escape or self.state in ("number", "literal"):
            return
        closers = "".join("}" if opener == "{" else "]" for opener in reversed(self.stack))
        ending = {"string": '": null' if self.in_key else '"', "colon": ": null", "value": "null"}
        self.safe = self.length
        self.completion = ending.get(self.state, "") + closers


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallStream:
    """Reads a model's output delta by delta into chat-chunk deltas: content, and tool calls.

    Content is held back only while it may be the start of a call (a partial marker, or whitespace
    that would be dropped beside a call); a call's arguments stream as they arrive, as far as they
    are valid JSON (see the module's docstring). ``finish`` flushes what was held. The concatenated
    ``arguments`` of one call's deltas is its arguments' JSON text.
    """

    def __init__(self, format: ToolCallFormat, tools: ToolNames) -> None:
        self.format = format
        self.names = tool_names(tools)
        self._buffer = ""  # received, not yet decided
        self._state = "content" if format.after_text else "start"
        self._json: _JsonValue | None = None
        self._calls: list[_Call] = []
        self._content: list[str] = []
        self._held_space = ""  # whitespace that opens a segment: dropped if a call comes before other text
        self._segment_shown = False  # the current stretch of content between calls has shown text
        self._out: list[Delta] = []
        self._finished = False
        self._start_pieces = [[_SPACE, _text(prefix), _SPACE, *_HEADER] for prefix in format.prefixes]
        self._start_pieces.append([_SPACE, *_HEADER])
        self._next_pieces = [[_SPACE, _text(format.separator.strip(_WS)), _SPACE, *_HEADER]]
        closing = format.call_close.strip(_WS)
        self._close_pieces = [[_SPACE, _text("}")]]
        if closing:
            # A call that forgot its object's brace still ends at the format's end marker.
            self._close_pieces = [[_SPACE, _text("}"), _SPACE, _text(closing)], [_SPACE, _text(closing)]]

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls begun so far (their arguments as far as they have streamed)."""
        return [ToolCall(call.id, call.name, "".join(call.arguments)) for call in self._calls]

    def feed(self, delta_text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("the stream is finished")
        self._buffer += delta_text
        self._run(final=False)
        return self._flush()

    def finish(self) -> list[Delta]:
        if self._finished:
            return []
        self._run(final=True)
        if self._held_space and not self._calls:
            self._show(self._held_space)
        self._held_space = ""
        self._finished = True
        return self._flush()

    def result(self) -> ParsedMessage:
        """The message so far: its content (None when empty) and its calls."""
        content = "".join(self._content)
        return ParsedMessage(content or None, self.tool_calls)

    # -- the machine: each step consumes the buffer's head or waits for more --

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == "args":
            return self._step_args(final)
        if not self._buffer:
            return False
        if state == "content":
            return self._step_content(final)
        if state == "plain":
            self._text_content(self._buffer)
            self._buffer = ""
            return False
        if state == "header":
            return self._step_header([[_text(self.format.marker), _SPACE, *_HEADER]], final, on_fail="marker")
        if state == "start":
            return self._step_header(self._start_pieces, final, on_fail="plain")
        if state == "next":
            return self._step_header(self._next_pieces, final, on_fail="plain")
        if state == "close":
            return self._step_close(final)
        raise AssertionError(state)

    def _step_content(self, final: bool) -> bool:
        marker = self.format.marker
        found = self._buffer.find(marker)
        if found >= 0:
            self._text_content(self._buffer[:found])
            self._buffer = self._buffer[found:]
            self._state = "header"
            return True
        keep = 0 if final else partial_suffix(self._buffer, marker)
        self._text_content(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _step_header(self, alternatives: list[list[_Piece]], final: bool, on_fail: str) -> bool:
        matches = [_match(pieces, self._buffer, final) for pieces in alternatives]
        hit = next((m for m in matches if m.status == "match"), None)
        if hit is None and any(m.status == "partial" for m in matches):
            return False
        if hit is not None and hit.name in self.names:
            self._begin_call(hit.name)
            self._buffer = self._buffer[hit.end - 1:]  # from the arguments' opening brace
            self._json = _JsonValue()
            self._state = "args"
            return True
        if on_fail == "marker":  # not a call: the marker is content, and what follows is read again
            self._text_content(self.format.marker)
            self._buffer = self._buffer[len(self.format.marker):]
            self._state = "content"
        else:
            self._state = "plain"
        return True

    def _step_args(self, final: bool) -> bool:
        value = self._json
        assert value is not None
        consumed, broke = value.feed(self._buffer)
        rest = self._buffer[consumed:]
        self._buffer = ""
        if value.done:
            self._arguments(value.take(value.length))
            self._buffer = rest
            self._state = "close"
            self._json = None
            return True
        if not broke and not final:
            self._arguments(value.take(value.safe))
            return False
        if not broke:
            value.close()
        # Broken off: close what was shown; what was held, and what follows, is content again.
        self._arguments(value.take(value.safe) + value.completion)
        self._buffer = (value.pending + rest) if broke else ""
        self._json = None
        self._end_call()
        return bool(self._buffer)

    def _step_close(self, final: bool) -> bool:
        """Past the call's closing, or as much of it as was written (what follows is content)."""
        matches = [_match(pieces, self._buffer, final) for pieces in self._close_pieces]
        hit = next((m for m in matches if m.status == "match"), None)
        if hit is None and any(m.status == "partial" for m in matches):
            return False
        self._buffer = self._buffer[(hit or max(matches, key=lambda m: m.end)).end:]
        self._end_call()
        if hit is not None and not self.format.after_text:
            self._state = "next"
        return True

    def _begin_call(self, name: str) -> None:
        self._held_space = ""  # whitespace-only content before a call is dropped
        call = _Call(new_tool_call_id(), name)
        self._calls.append(call)
        self._out.append(Delta(tool_call=ToolCallDelta(len(self._calls) - 1, "", call.id, name)))

    def _end_call(self) -> None:
        self._state = "content" if self.format.after_text else "plain"
        self._segment_shown = False

    def _arguments(self, text: str) -> None:
        if text:
            self._calls[-1].arguments.append(text)
            self._out.append(Delta(tool_call=ToolCallDelta(len(self._calls) - 1, text)))

    def _text_content(self, text: str) -> None:
        if not text:
            return
        if not self._segment_shown:
            if self._calls:  # whitespace after a call separates it from what follows
                text = text.lstrip(_WS)
            elif not text.strip(_WS):  # before any call: dropped if a call follows, the text's own if not
                self._held_space += text
                return
            else:
                text, self._held_space = self._held_space + text, ""
            if not text:
                return
            self._segment_shown = True
        self._show(text)

    def _show(self, text: str) -> None:
        self._content.append(text)
        self._out.append(Delta(content=text))

    def _flush(self) -> list[Delta]:
        """The deltas since the last flush, neighbours of one kind merged."""
        merged: list[Delta] = []
        for delta in self._out:
            last = merged[-1] if merged else None
            if last is not None and delta.content is not None and last.content is not None:
                merged[-1] = Delta(content=last.content + delta.content)
            elif (last is not None and delta.tool_call is not None and last.tool_call is not None
                  and delta.tool_call.id is None and last.tool_call.index == delta.tool_call.index):
                previous = last.tool_call
                arguments = previous.arguments + delta.tool_call.arguments
                merged[-1] = Delta(tool_call=ToolCallDelta(previous.index, arguments, previous.id, previous.name))
            else:
                merged.append(delta)
        self._out = []
        return merged
