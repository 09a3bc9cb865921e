"""Structured outputs over HTTP with the official ``openai`` client, against real services.

The tiny model knows Python, not JSON: at temperature 1.0 nearly none of its free outputs would
parse. Constrained, every output must: ``chat.completions.parse`` with a pydantic model, a
``response_format`` schema with nested objects, arrays, enums, patterns and integer ranges over many
seeds, vLLM's ``structured_outputs`` and ``guided_*`` fields on completions, streamed and whole. A
bad schema or grammar is a 400 naming the problem, and none of it disturbs a stream running beside.

The many-seed runs carry the ``slow`` marker; the default run keeps the rest.
Run: ``python3 -m pytest -q tests/e2e/test_structured_outputs.py`` (``-m slow``: the many-seed runs).
"""

from __future__ import annotations

import asyncio
import enum
import json
import re

import jsonschema
import openai
import pydantic
import pytest
from cli_support import launch, run_sync
from test_openai_api import frontend_urls

from tandem.cli.supervisor import wait_until_ready

pytestmark = pytest.mark.e2e

SEEDS = range(16)
ORDER = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "status", "items", "customer"],
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}}}},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                     "properties": {"name": {"type": "string", "maxLength": 10},
                                    "age": {"type": "integer", "minimum": 18, "maximum": 99}}},
    },
}


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=-50, le=50)
    y: int = pydantic.Field(ge=-50, le=50)


class Shape(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    color: Color
    points: list[Point] = pydantic.Field(max_length=3)
    code: str = pydantic.Field(pattern=r"^[A-Z][0-9]{2}$")


@pytest.fixture(scope="module")
def api(start_system):
    # DEBUG: a failure's message carries the services' logs (see the many-seed tests)
    system = start_system(prefill=1, decode=1, decode_args=["--num-blocks", "800", "--max-model-len", "2048"],
                          env={"TANDEM_LOG_LEVEL": "DEBUG"})
    system.processes["frontend-structured"] = launch(system.url, "frontend", "frontend-structured", system.logdir,
                                                     system.env, ["--http-port", "0"])
    run_sync(wait_until_ready(system.url, {"frontend": ["frontend-structured"]}, system.check_alive, 60))
    system.http = run_sync(frontend_urls(system.url))["frontend-structured"]
    yield system


def client_for(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.http}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "an order, as JSON"}]


@pytest.mark.slow
async def test_parse_with_a_pydantic_model_gives_a_valid_object_for_every_seed(api):
    client = client_for(api)
    results = await asyncio.gather(*(client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Shape, temperature=1.0, seed=seed, max_tokens=300)
        for seed in SEEDS))
    for seed, result in zip(SEEDS, results):
        message = result.choices[0].message
        assert result.choices[0].finish_reason == "stop", f"seed {seed}: {message.content!r}"
        assert isinstance(message.parsed, Shape), f"seed {seed}: {message.content!r} did not parse"
    assert len({r.choices[0].message.content for r in results}) > 1, "every seed gave the same output"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_json_schema_response_format_validates_for_every_seed(api, stream: bool):
    client = client_for(api)
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}

    async def one(seed: int) -> tuple[str, str | None]:
        kwargs = dict(model="tiny", messages=MESSAGES, response_format=response_format, temperature=1.0, seed=seed,
                      max_tokens=400)
        if not stream:
            result = await client.chat.completions.create(**kwargs)
            return result.choices[0].message.content, result.choices[0].finish_reason
        text, reason = "", None
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
        return text, reason

    results = await asyncio.gather(*(one(seed) for seed in SEEDS), return_exceptions=True)
    failed = {seed: repr(r) for seed, r in zip(SEEDS, results) if isinstance(r, BaseException)}
    # The services' logs with the failure: a request that never got its answer leaves its trace only there.
    assert not failed, f"requests failed: {failed}\n{api.logs()}"
    for seed, (text, reason) in zip(SEEDS, results):
        assert reason == "stop", f"seed {seed}: ended {reason!r}: {text!r}"
        jsonschema.validate(json.loads(text), ORDER)


async def test_json_object_mode_gives_a_json_object(api):
    result = await client_for(api).chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, temperature=0.0, max_tokens=300)
    text = result.choices[0].message.content
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # free strings: greedy may loop inside one until max_tokens; what came is still a JSON prefix
        assert text.startswith("{"), text


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"regex": r"(up|down) [0-9]{1,2}"}}, lambda t: re.fullmatch(r"(up|down) [0-9]{1,2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"'}},
     lambda t: re.fullmatch(r"\([a-z]+(,[a-z]+)*\)", t) and len(t) < 200),
    ({"structured_outputs": {"grammar": 'start: "f(" NUM ")"\nNUM: /[0-9]{1,3}/'}},
     lambda t: re.fullmatch(r"f\([0-9]{1,3}\)", t)),
    ({"guided_json": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"],
                      "additionalProperties": False}}, lambda t: json.loads(t) in ({"k": True}, {"k": False})),
], ids=["guided_regex", "guided_choice", "regex", "gbnf", "lark", "guided_json"])
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["whole", "streamed"])
async def test_completions_take_vllms_structured_fields(api, extra: dict, check, stream: bool):
    client = client_for(api)
    for seed in range(2):
        kwargs = dict(model="tiny", prompt="x = ", max_tokens=200, temperature=1.0, seed=seed, extra_body=extra)
        if stream:
            pieces = [c async for c in await client.completions.create(stream=True, **kwargs)]
            text = "".join(c.choices[0].text for c in pieces if c.choices)
            reason = next(c.choices[0].finish_reason for c in reversed(pieces) if c.choices)
        else:
            result = await client.completions.create(**kwargs)
            text, reason = result.choices[0].text, result.choices[0].finish_reason
        assert reason == "stop" and check(text), f"seed {seed}: {text!r} ({reason})"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}}}}, "response_format", "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format", "Unsatisfiable"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}}, "structured_outputs", "nowhere"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice", "one structured output"),
    ({"extra_body": {"guided_regex": "a" * 70000}}, "guided_regex", "at most"),
    ({"extra_body": {"guided_choice": ["a"], "use_beam_search": True, "n": 2}}, "guided_choice", "beam search"),
]


# Four cases in the default run (a bad schema, an unsupported keyword, a bad grammar, too large); the rest slow.
DEFAULT_BAD = (0, 1, 5, 8)


@pytest.mark.parametrize("fields, param, words", [
    case if i in DEFAULT_BAD else pytest.param(*case, marks=pytest.mark.slow) for i, case in enumerate(BAD)],
    ids=[str(i) for i in range(len(BAD))])
async def test_a_bad_spec_is_a_400_naming_it_beside_a_live_stream(api, fields: dict, param: str, words: str):
    client = client_for(api)
    live = await client.completions.create(model="tiny", prompt="def f():", max_tokens=60, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True, "guided_regex": "[a-z ]+"})
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, **fields)
    error = raised.value.body
    assert error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"], "an error is one line"
    text = "".join([c.choices[0].text async for c in live if c.choices])
    assert re.fullmatch(r"[a-z ]+", text) and len(text) == 60, f"the live stream was disturbed: {text!r}"


# -- tool calls ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]$"}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def assert_valid_calls(calls, names: set[str], where: str) -> None:
    assert calls, f"{where}: no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_"), f"{where}: {call}"
        assert call.function.name in names, f"{where}: called {call.function.name}"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
], ids=["required", "named"])
async def test_a_forced_tool_call_is_valid_for_every_seed(api, tool_choice, names: set[str]):
    """One call (a named function, or "required" without parallel calls): it always ends, valid."""
    client = client_for(api)
    results = await asyncio.gather(*(client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        temperature=1.0, seed=seed, max_tokens=400) for seed in range(8)))
    for seed, result in enumerate(results):
        choice = result.choices[0]
        assert choice.finish_reason == "tool_calls", f"seed {seed}: {choice.finish_reason} {choice.message}"
        assert_valid_calls(choice.message.tool_calls, names, f"seed {seed}")
        assert len(choice.message.tool_calls) == 1, f"seed {seed}: {choice.message.tool_calls}"


@pytest.mark.slow
async def test_required_with_parallel_calls_makes_valid_calls(api):
    """The tiny model rarely stops calling: every call but one cut by max_tokens is valid."""
    for seed in range(4):
        choice = (await client_for(api).chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=200)).choices[0]
        calls = choice.message.tool_calls
        whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert choice.finish_reason in ("tool_calls", "length") and calls, choice
        if whole:
            assert_valid_calls(whole, {"get_weather", "get_time"}, f"seed {seed}")


async def test_streamed_tool_call_deltas_assemble_to_the_whole_answer(api):
    """The SDK's stream helper assembles OpenAI's tool-call deltas; with one seed the streamed answer
    is the whole one."""
    client = client_for(api)
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  temperature=1.0, seed=5, max_tokens=400)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    async with client.chat.completions.stream(**kwargs) as stream:
        async for _ in stream:
            pass
        streamed = (await stream.get_final_completion()).choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


async def test_auto_reads_a_call_the_model_writes(api):
    """With tool_choice auto nothing is forced; a call the model writes (here steered by the client's
    own grammar, in the tiny model's Hermes format) still comes back as a tool call."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    lark = "start: " + json.dumps(call)
    result = await client_for(api).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.0,
        extra_body={"structured_outputs": {"grammar": lark}})
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Oslo", "days": 2})]
    plain = await client_for(api).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200, temperature=0.0,
        extra_body={"structured_outputs": {"grammar": lark}})
    assert plain.choices[0].message.content == call and not plain.choices[0].message.tool_calls


async def test_tool_results_go_back_through_the_template(api):
    from tandem.shared.text.chat_template import tiny_template

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 1})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"}]
    result = await client_for(api).chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                           max_tokens=5, temperature=0.0)
    rendered = tiny_template().render(messages, tools=TOOLS)
    assert '{"temp": 3}' in rendered and "<tool_call>" in rendered and "get_time" in rendered
    assert result.usage.prompt_tokens == len(rendered.encode()), "the prompt is not the template's rendering"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "not": {"const": "x"}}}}}}], "tool_choice": "required"}, "tools"),
], ids=["no name", "unknown function", "required without tools", "with response_format", "unsupported keyword"])
async def test_bad_tools_are_a_400_naming_the_field(api, fields: dict, param: str):
    with pytest.raises(openai.BadRequestError) as raised:
        await client_for(api).chat.completions.create(model="tiny", messages=ASK, max_tokens=5, **fields)
    error = raised.value.body
    assert error["param"] == param and "\n" not in error["message"], error
