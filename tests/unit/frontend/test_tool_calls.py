"""Tool calls (services/frontend/tool_calls.py): a model's text read into OpenAI tool calls, whole
and streamed, and the grammar that forces calls; the tiny model's template carrying tools.

The streamed reading must agree with the whole one for every way the text can arrive (split at
every position, byte by byte, random chunk sizes), a call's arguments must always be JSON, and
what is not a call (not JSON, an unknown function) stays content. OpenAI's own stream helper must
assemble the deltas. The forcing grammar is driven by random allowed bytes through llguidance over
the tiny model's byte vocabulary: what it admits must parse into calls whose arguments satisfy
their function's schema, and what the template writes for a past call must be what it admits.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from tandem.services.frontend.tool_calls import (
    GRAMMAR_JSON_OPTIONS,
    HERMES,
    LLAMA3_JSON,
    MAX_TOOLS,
    Delta,
    ToolCallFormat,
    ToolCallStream,
    ToolChoice,
    ToolError,
    forced_tool_grammar,
    parse_tool_calls,
    tool_call_format,
    validate_tool_choice,
    validate_tools,
)
from tandem.shared.protocol.serving import MAX_STRUCTURED_SPEC_CHARS
from tandem.shared.text.chat_template import TINY_TEMPLATE, ChatTemplate, tiny_template
from tandem.shared.text.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE


def function(name: str, parameters: dict | None = None, **extra: Any) -> dict:
    body = {"name": name, **extra}
    if parameters is not None:
        body["parameters"] = parameters
    return {"type": "function", "function": body}


# Small bounds keep randomly generated arguments short.
WEATHER = function("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}, description="Today's weather in a city")
ADD = function("add", {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50},
                   "b": {"type": "number", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
})
ROUTE = function("plan.route", {
    "type": "object",
    "$defs": {"stop": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                          "wait": {"type": "boolean"}},
                       "required": ["name"], "additionalProperties": False}},
    "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}, "minItems": 1, "maxItems": 2}},
    "required": ["stops"],
    "additionalProperties": False,
})
NOW = function("now")  # no parameters: no arguments
TOOLS = [WEATHER, ADD, ROUTE, NOW]
NAMES = [tool["function"]["name"] for tool in TOOLS]


# --- choosing the format --------------------------------------------------------------------------

QWEN_TEMPLATE = ('{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>'
                 '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>{% endif %}')
LLAMA_TEMPLATE = ('{%- if message.role == "ipython" %}<|start_header_id|>ipython<|end_header_id|>{% endif %}'
                  '{{- \'{"name": "\' + tool_call.name + \'", \' + \'"parameters": \' + tool_call.arguments | tojson }}'
                  '<|python_tag|>')


@pytest.mark.parametrize(("template", "model", "expected"), [
    (QWEN_TEMPLATE, "Qwen/Qwen2.5-7B-Instruct", HERMES),
    (LLAMA_TEMPLATE, "meta-llama/Llama-3.1-8B-Instruct", LLAMA3_JSON),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "some-model", HERMES),
    (TINY_TEMPLATE, "tiny", HERMES),
    (None, "meta-llama/Llama-3.2-1B-Instruct", LLAMA3_JSON),
    (None, "tiny", HERMES),
], ids=["qwen", "llama 3.1", "no tools in template", "tiny", "llama name, no template", "no template"])
def test_the_format_is_read_off_the_template(template: str | None, model: str, expected: ToolCallFormat) -> None:
    assert tool_call_format(template, model) == expected, f"{model}: expected {expected.name}"


# --- parsing --------------------------------------------------------------------------------------


def call(name: str, arguments: str, fmt: ToolCallFormat = HERMES) -> str:
    if fmt is HERMES:
        return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
    return f'{{"name": "{name}", "parameters": {arguments}}}'


# (id, format, text, expected content, expected [(name, arguments)])
PARSES = [
    ("plain", HERMES, "Paris is in France.", "Paris is in France.", []),
    ("angle brackets", HERMES, "a <b> c <tool d </tool_call> <tool_cal", "a <b> c <tool d </tool_call> <tool_cal", []),
    ("empty", HERMES, "", None, []),
    ("one call", HERMES, call("get_weather", '{"city": "Paris"}'), None, [("get_weather", '{"city": "Paris"}')]),
    ("text then call", HERMES, "Let me look.\n" + call("get_weather", '{"city": "Oslo", "unit": "c"}'),
     "Let me look.\n", [("get_weather", '{"city": "Oslo", "unit": "c"}')]),
    ("two calls", HERMES, call("add", '{"a": 1, "b": 2.5}') + "\n" + call("now", "{}") + "\n",
     None, [("add", '{"a": 1, "b": 2.5}'), ("now", "{}")]),
    ("rich arguments", HERMES,
     call("plan.route", '{"stops": [{"name": "q\\"u\\u00e9\\n", "wait": true}, {"name": "é", "x": null, '
                        '"n": -0.5e+3}], "e": {}, "l": []}'),
     None, [("plan.route", '{"stops": [{"name": "q\\"u\\u00e9\\n", "wait": true}, {"name": "é", "x": null, '
                           '"n": -0.5e+3}], "e": {}, "l": []}')]),
    ("loose whitespace", HERMES, '<tool_call>{ "name" :"now" ,\n "arguments":{ } }</tool_call>', None,
     [("now", "{ }")]),
    ("parameters key", HERMES, '<tool_call>\n{"name": "now", "parameters": {}}\n</tool_call>', None, [("now", "{}")]),
    ("unknown function", HERMES, call("delete_everything", "{}"), call("delete_everything", "{}"), []),
    ("not json", HERMES, "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
     "<tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    ("arguments first", HERMES, '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
     '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>', []),
    ("arguments as a string", HERMES, '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>',
     '<tool_call>\n{"name": "now", "arguments": "{}"}\n</tool_call>', []),
    ("bad then good", HERMES, "<tool_call>" + call("now", "{}"), "<tool_call>", [("now", "{}")]),
    ("text after a call", HERMES, call("now", "{}") + "\nDone.", "Done.", [("now", "{}")]),
    ("call without its brace", HERMES, '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>', None,
     [("now", "{}")]),
    ("call without its end", HERMES, '<tool_call>\n{"name": "now", "arguments": {}}', None, [("now", "{}")]),
    ("cut in a string", HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None,
     [("get_weather", '{"city": "Par"}')]),
    ("cut in an escape", HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\\u00', None,
     [("get_weather", '{"city": "a"}')]),
    ("cut in a key", HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b', None,
     [("add", '{"a": 1, "b": null}')]),
    ("cut after a comma", HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": [1, 2, ', None,
     [("add", '{"a": [1, 2]}')]),
    ("cut in a literal", HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": tr', None,
     [("add", '{"a": null}')]),
    ("broken arguments", HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1,,}}\n</tool_call>',
     ',,}}\n</tool_call>', [("add", '{"a": 1}')]),
    ("spaces beside calls", HERMES, "\n\n" + call("now", "{}") + "\n \n" + call("now", "{}") + "\n\n", None,
     [("now", "{}"), ("now", "{}")]),
    ("only whitespace", HERMES, "\n \n", "\n \n", []),
    ("llama call", LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", '{"city": "Rome"}')]),
    ("llama python tag", LLAMA3_JSON, '<|python_tag|>{"name": "now", "parameters": {}}', None, [("now", "{}")]),
    ("llama two calls", LLAMA3_JSON,
     call("add", '{"a": 2, "b": 0}', LLAMA3_JSON) + "; " + call("now", "{}", LLAMA3_JSON), None,
     [("add", '{"a": 2, "b": 0}'), ("now", "{}")]),
    ("llama arguments key", LLAMA3_JSON, '{"name": "now", "arguments": {}}', None, [("now", "{}")]),
    ("llama text", LLAMA3_JSON, "It is sunny in Rome.", "It is sunny in Rome.", []),
    ("llama json answer", LLAMA3_JSON, '{"answer": 42}', '{"answer": 42}', []),
    ("llama unknown function", LLAMA3_JSON, '{"name": "rm", "parameters": {}}', '{"name": "rm", "parameters": {}}', []),
    ("llama call after text", LLAMA3_JSON, 'Sure: {"name": "now", "parameters": {}}',
     'Sure: {"name": "now", "parameters": {}}', []),
    ("llama text after a call", LLAMA3_JSON, '{"name": "now", "parameters": {}} and more', "and more",
     [("now", "{}")]),
    ("llama cut", LLAMA3_JSON, '{"name": "plan.route", "parameters": {"stops": [{"name": "ab', None,
     [("plan.route", '{"stops": [{"name": "ab"}]}')]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [p[1:] for p in PARSES], ids=[p[0] for p in PARSES])
def test_whole_parse(fmt: ToolCallFormat, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parsed = parse_tool_calls(text, fmt, TOOLS)
    assert parsed.content == content, f"content of {text!r}"
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls, f"calls of {text!r}"
    for parsed_call in parsed.tool_calls:
        json.loads(parsed_call.arguments)  # always JSON, even when the output broke off
        assert parsed_call.id.startswith("call_") and len(parsed_call.id) == 29, parsed_call.id


def streamed(fmt: ToolCallFormat, chunks: list[str], tools: list = TOOLS) -> tuple[str | None, list[tuple[str, str]]]:
    """The stream's deltas assembled as a client would, checking OpenAI's delta shapes on the way."""
    stream = ToolCallStream(fmt, tools)
    deltas: list[Delta] = []
    for piece in chunks:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    content, calls = "", []
    for delta in deltas:
        body = delta.openai()
        if delta.tool_call is None:
            assert body == {"content": delta.content} and delta.content, f"empty content delta in {deltas}"
            content += delta.content
            continue
        (piece,) = body["tool_calls"]
        if "id" in piece:
            assert piece["index"] == len(calls), f"call indices run 0, 1, ...: {deltas}"
            assert piece["type"] == "function" and piece["id"].startswith("call_"), piece
            calls.append([piece["function"]["name"], piece["function"]["arguments"]])
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}, piece
            assert piece["index"] == len(calls) - 1 and piece["function"]["arguments"], f"a stray fragment: {piece}"
            calls[-1][1] += piece["function"]["arguments"]
    result = stream.result()
    assert [c.name for c in result.tool_calls] == [name for name, _ in calls]
    return content or None, [tuple(c) for c in calls]


def chunkings(text: str, seed: int) -> list[list[str]]:
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(seed)
    rough = []
    for _ in range(4):
        pieces, at = [], 0
        while at < len(text):
            size = rng.randint(1, 9)
            pieces.append(text[at:at + size])
            at += size
        rough.append(pieces)
    return [*splits, list(text), *rough]


@pytest.mark.parametrize(("fmt", "text"), [p[1:3] for p in PARSES], ids=[p[0] for p in PARSES])
def test_streamed_parse_agrees_with_the_whole_for_every_chunking(fmt: ToolCallFormat, text: str) -> None:
    parsed = parse_tool_calls(text, fmt, TOOLS)
    whole = (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
    for chunks in chunkings(text, seed=len(text)):
        assert streamed(fmt, chunks) == whole, f"{text!r} fed as {chunks}"


@pytest.mark.parametrize(("fmt", "text"), [
    (HERMES, "I will look both up.\n" + call("plan.route", '{"stops": [{"name": "a\\"b", "wait": false}]}') + "\n"
     + call("add", '{"a": -12, "b": 3.25e1}')),
    (LLAMA3_JSON, '<|python_tag|>{"name": "add", "parameters": {"a": [1, {"b": "c"}], "d": 0.5}}; '
                  '{"name": "get_weather", "parameters": {"city": "Kyiv"}}'),
], ids=["hermes", "llama3_json"])
def test_every_cut_of_an_output_streams_as_it_parses(fmt: ToolCallFormat, text: str) -> None:
    """An output cut anywhere (max_tokens) still agrees, and its arguments are still JSON."""
    for end in range(len(text) + 1):
        prefix = text[:end]
        parsed = parse_tool_calls(prefix, fmt, TOOLS)
        for parsed_call in parsed.tool_calls:
            assert isinstance(json.loads(parsed_call.arguments), dict), f"cut at {end}: {parsed_call.arguments!r}"
        whole = (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
        assert streamed(fmt, list(prefix)) == whole, f"cut at {end}: {prefix!r}"


def test_arguments_stream_as_they_arrive() -> None:
    stream = ToolCallStream(HERMES, TOOLS)
    assert stream.feed("Checking.\n<tool_") == [Delta(content="Checking.\n")], "content before a marker flows"
    (header,) = stream.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert header.openai()["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert [d.openai() for d in stream.feed('ty": "Lo')] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Lo'}}]}]
    assert stream.feed('ndon", "unit": "c"}}\n</tool_call>') != [], "the rest of the arguments"
    assert stream.finish() == []
    assert stream.result().tool_calls[0].arguments == '{"city": "London", "unit": "c"}'


def test_unknown_names_need_the_request_tools() -> None:
    text = call("get_weather", '{"city": "Paris"}')
    assert parse_tool_calls(text, HERMES, []).content == text, "no tools: nothing is a call"
    assert parse_tool_calls(text, HERMES, ["get_weather"]).tool_calls, "names work as tools"
    assert parse_tool_calls(text, HERMES, validate_tools([WEATHER])).tool_calls, "validated tools work"


def test_openai_stream_helper_assembles_the_deltas() -> None:
    openai_streaming = pytest.importorskip("openai.lib.streaming.chat")
    from openai.types.chat import ChatCompletionChunk

    text = "Two calls.\n" + call("get_weather", '{"city": "Nice", "unit": "f"}') + "\n" + call("now", "{}")
    stream = ToolCallStream(HERMES, TOOLS)
    deltas = [d for i in range(0, len(text), 5) for d in stream.feed(text[i:i + 5])] + stream.finish()
    state = openai_streaming.ChatCompletionStreamState(input_tools=TOOLS)

    def send(delta: dict, finish_reason: str | None = None) -> None:
        chunk = ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})
        list(state.handle_chunk(chunk))

    send({"role": "assistant", "content": ""})
    for delta in deltas:
        send(delta.openai())
    send({}, "tool_calls")
    message = state.get_final_completion().choices[0].message
    assert message.content == "Two calls.\n"
    got = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    assert got == [(c.id, c.name, c.arguments) for c in stream.result().tool_calls]
    assert [json.loads(arguments) for _, _, arguments in got] == [{"city": "Nice", "unit": "f"}, {}]


# --- validating the request -----------------------------------------------------------------------


@pytest.mark.parametrize(("tools", "message"), [
    ({"type": "function"}, "tools: must be a list of tools"),
    (["x"], "tools[0]: must be an object"),
    ([{"function": {"name": "f"}}], "tools[0].type: required"),
    ([{"type": "retrieval", "function": {"name": "f"}}], 'tools[0].type: must be "function", not "retrieval"'),
    ([WEATHER, {"type": "function"}], "tools[1].function: required"),
    ([WEATHER, {"type": "function", "function": {"description": "x"}}], "tools[1].function.name: required"),
    ([function("has space")], "tools[0].function.name: must be 1 to 64 letters, digits, '_', '-', '.' or ':', "
                              'not "has space"'),
    ([function("f" * 65)], "tools[0].function.name: must be 1 to 64"),
    ([WEATHER, WEATHER], 'tools[1].function.name: "get_weather" is declared twice'),
    ([function("f", description=3)], "tools[0].function.description: must be a string"),
    ([function("f", "{}")], "tools[0].function.parameters: not a JSON schema object"),
    ([function("f", {"type": "string"})], 'tools[0].function.parameters: must describe an object (type "object"), '
                                          'not type "string"'),
    ([function("f", strict="yes")], "tools[0].function.strict: must be a boolean"),
    ([function(f"f{i}") for i in range(MAX_TOOLS + 1)], f"tools: at most {MAX_TOOLS} tools, not {MAX_TOOLS + 1}"),
], ids=["not a list", "not an object", "no type", "other type", "no function", "no name", "bad name", "long name",
        "twice", "description", "parameters not an object", "parameters not an object schema", "strict", "too many"])
def test_bad_tools_are_named(tools: Any, message: str) -> None:
    with pytest.raises(ToolError) as caught:
        validate_tools(tools)
    assert str(caught.value).startswith(message), f"{caught.value} should start with {message!r}"
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(caught.value.param + ": ")


@pytest.mark.parametrize(("choice", "tools", "message"), [
    ("sometimes", TOOLS, 'tool_choice: must be "none", "auto", "required" or a function, not "sometimes"'),
    ("required", [], 'tool_choice: "required" needs tools'),
    ({"type": "function", "function": {"name": "g"}}, TOOLS, 'tool_choice: function "g" is not among tools'),
    ({"type": "allowed_tools"}, TOOLS, 'tool_choice.type: must be "function", not "allowed_tools"'),
    ({"type": "function"}, TOOLS, "tool_choice.function: must be an object"),
    ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name: required"),
    (3, TOOLS, 'tool_choice: must be "none", "auto", "required" or {"type": "function"'),
], ids=["unknown mode", "required without tools", "unknown function", "other type", "no function", "no name",
        "a number"])
def test_bad_tool_choice_is_named(choice: Any, tools: list, message: str) -> None:
    with pytest.raises(ToolError, match="^" + re.escape(message)):
        validate_tool_choice(choice, validate_tools(tools))


@pytest.mark.parametrize(("choice", "tools", "expected"), [
    (None, TOOLS, ToolChoice("auto")),
    (None, [], ToolChoice("none")),
    ("none", TOOLS, ToolChoice("none")),
    ("auto", [], ToolChoice("auto")),
    ("required", TOOLS, ToolChoice("required")),
    ({"type": "function", "function": {"name": "add"}}, TOOLS, ToolChoice("function", "add")),
])
def test_tool_choice(choice: Any, tools: list, expected: ToolChoice) -> None:
    assert validate_tool_choice(choice, validate_tools(tools)) == expected


def test_no_parameters_means_no_arguments() -> None:
    (tool,) = validate_tools([NOW])
    assert tool.parameters == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_nothing_is_forced_unless_asked(choice: Any) -> None:
    assert forced_tool_grammar(TOOLS, choice, True, HERMES) is None


# --- the forcing grammar --------------------------------------------------------------------------


class ByteVocabulary:
    """The tiny model's vocabulary as llguidance's TokenizerWrapper reads one."""

    eos_token_id = BYTE_EOS_ID
    bos_token_id = BYTE_BOS_ID
    tokens = [bytes([i]) for i in range(256)] + [b"<bos>", b"<eos>", b"<pad>"]
    special_token_ids = [BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@pytest.fixture(scope="module")
def llguidance() -> Any:
    return pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def byte_tokenizer(llguidance: Any) -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocabulary()))


def matcher(llguidance: Any, tokenizer: Any, spec: str) -> Any:
    grammar = llguidance.LLMatcher.grammar_from_lark(spec)
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == "", "the grammar compiles"
    built = llguidance.LLMatcher(tokenizer, grammar)
    assert not built.is_error(), built.get_error()
    return built


def sample(built: Any, seed: int, max_tokens: int = 600) -> tuple[str, bool]:
    """Random allowed tokens until eos or the cap: (the text, whether it ended with eos)."""
    rng = random.Random(seed)
    out = []
    for _ in range(max_tokens):
        mask = built.compute_bitmask()
        allowed = [t for t in range(BYTE_VOCAB_SIZE) if mask[t // 8] >> (t % 8) & 1]
        assert allowed, f"nothing allowed after {bytes(out)!r}"
        token = rng.choice(allowed)
        if token == BYTE_EOS_ID:
            return bytes(out).decode("utf-8"), True
        assert token < 256, f"a special token was allowed: {token}"
        assert built.consume_token(token), built.get_error()
        out.append(token)
    return bytes(out).decode("utf-8", errors="replace"), False


def check_with(llguidance: Any):
    return lambda lark: llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), None)


FORCED = [
    ("required", True, None),
    ("required", False, None),
    ({"type": "function", "function": {"name": "plan.route"}}, True, "plan.route"),
    ({"type": "function", "function": {"name": "add"}}, False, "add"),
    ({"type": "function", "function": {"name": "now"}}, True, "now"),
]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize(("choice", "parallel", "only"), FORCED,
                         ids=["required parallel", "required one", "named route", "named add", "named now"])
@pytest.mark.parametrize("seed", range(6))
def test_forced_output_parses_into_valid_calls(llguidance: Any, byte_tokenizer: Any, fmt: ToolCallFormat,
                                               choice: Any, parallel: bool, only: str | None, seed: int) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    structured = forced_tool_grammar(TOOLS, choice, parallel, fmt, check=check_with(llguidance))
    assert structured is not None and structured.kind == "lark"
    text, ended = sample(matcher(llguidance, byte_tokenizer, structured.spec), seed)
    assert ended, f"no eos within the cap: {text!r}"
    parsed = parse_tool_calls(text, fmt, TOOLS)
    assert parsed.content is None, f"forced output left content {parsed.content!r} in {text!r}"
    assert parsed.tool_calls, f"no call in {text!r}"
    if only is not None or not parallel:
        assert len(parsed.tool_calls) == 1, f"one call expected in {text!r}"
    schemas = {tool.name: tool.parameters for tool in validate_tools(TOOLS)}
    for parsed_call in parsed.tool_calls:
        assert only is None or parsed_call.name == only, text
        arguments = json.loads(parsed_call.arguments)
        errors = [e.message for e in jsonschema.Draft202012Validator(schemas[parsed_call.name]).iter_errors(arguments)]
        assert not errors, f"{parsed_call.name}({parsed_call.arguments}) from {text!r}: {errors}"


def test_several_forced_calls_come_out(llguidance: Any, byte_tokenizer: Any) -> None:
    """Parallel calls are admitted: some seed draws more than one."""
    structured = forced_tool_grammar(TOOLS, "required", None, HERMES)
    counts = {len(parse_tool_calls(sample(matcher(llguidance, byte_tokenizer, structured.spec), seed)[0], HERMES,
                                   TOOLS).tool_calls) for seed in range(12)}
    assert max(counts) > 1, counts


def test_forced_grammar_admits_what_the_template_writes(llguidance: Any, byte_tokenizer: Any) -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": -3, "b": 1.5}'}}]
    prompt = tiny_template().render([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}],
                                    add_generation_prompt=False, tools=TOOLS)
    turn = prompt.split("<|assistant|>\n", 1)[1].removesuffix("\n")
    parsed = parse_tool_calls(turn, HERMES, TOOLS)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": -3, "b": 1.5})]
    structured = forced_tool_grammar(TOOLS, "required", True, HERMES)
    built = matcher(llguidance, byte_tokenizer, structured.spec)
    assert built.consume_tokens(list(turn.encode())), f"the grammar refused {turn!r}: {built.get_error()}"
    assert built.is_accepting()


def test_calls_a_qwen_style_template_writes_parse_back() -> None:
    """What the model saw of its past calls is what the parser reads (chat_support's ChatML template)."""
    from chat_support import QWEN_TEMPLATE as CHATML_TEMPLATE

    assert tool_call_format(CHATML_TEMPLATE, "Qwen/Qwen2.5-0.5B-Instruct") == HERMES
    calls = [{"id": "call_1", "type": "function", "function": {"name": "plan.route",
                                                                "arguments": '{"stops": [{"name": "é"}]}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    prompt = ChatTemplate(CHATML_TEMPLATE).render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure.", "tool_calls": calls}],
        add_generation_prompt=False, tools=TOOLS)
    turn = prompt.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parsed = parse_tool_calls(turn, HERMES, TOOLS)
    assert parsed.content == "Sure.\n", turn
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("plan.route", {"stops": [{"name": "é"}]}), ("now", {})], turn


def test_forced_grammar_carries_start_after_and_the_json_options() -> None:
    structured = forced_tool_grammar(TOOLS, "required", True, HERMES, start_after=[151668])
    assert structured.start_after == [151668]
    assert json.dumps(GRAMMAR_JSON_OPTIONS, separators=(",", ":")) in structured.spec


def test_a_schema_llguidance_refuses_names_its_tool(llguidance: Any) -> None:
    tools = [WEATHER, function("bad", {"type": "object", "properties": {"x": {"type": "wat"}}})]
    with pytest.raises(ToolError, match=r"^tools\[1\]\.function\.parameters: cannot be forced: .*wat"):
        forced_tool_grammar(tools, "required", True, HERMES, check=check_with(llguidance))


def test_unimplemented_schema_keywords_are_refused(llguidance: Any) -> None:
    """A schema is never followed only in part: llguidance's unimplemented keywords are a 400."""
    tools = [WEATHER, function("f", {"type": "object", "properties": {"x": {"not": {"type": "string"}}}})]
    with pytest.raises(ToolError, match=r"^tools\[1\]\.function\.parameters: cannot be forced: .*not"):
        forced_tool_grammar(tools, {"type": "function", "function": {"name": "f"}}, True, HERMES,
                            check=check_with(llguidance))
    assert forced_tool_grammar(tools, {"type": "function", "function": {"name": "get_weather"}}, True, HERMES,
                               check=check_with(llguidance)) is not None, "only the named function's schema counts"


def test_a_grammar_too_large_is_refused() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}}
    too_large = rf"^tools\[0\]\.function\.parameters: too large .* {MAX_STRUCTURED_SPEC_CHARS}"
    with pytest.raises(ToolError, match=too_large):
        forced_tool_grammar([function("f", big)], {"type": "function", "function": {"name": "f"}}, True, HERMES)
    with pytest.raises(ToolError, match=r"^tools: too large"):
        forced_tool_grammar([function("f", big)], "required", True, HERMES)


# --- the tiny model's template --------------------------------------------------------------------

# The template before it took tools: conversations without tools must render exactly as they did.
PLAIN_TEMPLATE = """\
{% for message in messages %}
<|{{ message['role'] }}|>
{{ message['content'] }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "def f():"}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
    [{"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "call_1"}],
], ids=["user", "conversation", "null content", "tool message"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, []], ids=["no tools", "empty tools"])
def test_tiny_template_without_tools_is_unchanged(messages: list, add_generation_prompt: bool, tools: Any) -> None:
    expected = ChatTemplate(PLAIN_TEMPLATE).render(messages, add_generation_prompt=add_generation_prompt)
    assert tiny_template().render(messages, add_generation_prompt=add_generation_prompt, tools=tools) == expected


def test_tiny_template_lists_tools_in_the_system_turn() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    prompt = tiny_template().render(messages, tools=[WEATHER, NOW])
    tools_block = "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(NOW) + "\n</tools>\n"
    assert prompt.startswith("<|system|>\nBe brief.\n\n# Tools\n"), prompt
    assert tools_block in prompt, prompt
    assert "within <tool_call></tool_call> XML tags" in prompt
    assert prompt.count("<|system|>") == 1, "the system message joins the tools' turn"
    assert prompt.endswith("</tool_call>\n<|user|>\nWeather in Paris?\n<|assistant|>\n"), prompt
    without_system = tiny_template().render(messages[1:], tools=[WEATHER])
    assert without_system.startswith("<|system|>\n# Tools\n"), without_system


def test_tiny_template_renders_calls_and_results() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "assistant", "content": "Checking the time.", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
    ]
    prompt = tiny_template().render(messages, tools=[WEATHER, NOW], add_generation_prompt=False)
    assert prompt.endswith(
        "<|user|>\nWeather in Paris?\n"
        '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<|tool|>\n{"sky": "clear"}\n'
        '<|assistant|>\nChecking the time.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'), prompt
