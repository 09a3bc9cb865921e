"""A request's structured-output fields as the one :class:`StructuredOutput` the engine constrains to.

OpenAI's ``response_format`` (``json_object``; ``json_schema`` with its ``schema``) and vLLM's
extensions (``structured_outputs``: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``;
and the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``) all become
one spec; asking for two at once is a 400. The spec is compiled here, without a vocabulary, by the
code the workers compile it with, so a schema or grammar that cannot compile, an unsupported keyword,
or one past the size bounds is a 400 naming the problem before any bus work.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from tandem.services.frontend import schemas
from tandem.services.frontend.errors import bad_request
from tandem.shared.protocol.base import first_error
from tandem.shared.protocol.serving import MAX_STRUCTURED_SPEC_CHARS, StructuredOutput, grammar_syntax
from tandem.shared.structured.grammars import StructuredOutputError, check

SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs: one of them
# vLLM's structured_outputs keys that change nothing here (the backend is llguidance, whitespace is
# compact): taken and ignored, as vLLM takes them; any other key is refused by name.
IGNORED_KEYS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties")


def asked_structured_output(request: schemas.SamplingFields) -> tuple[StructuredOutput, str] | None:
    """The request's spec and the field it came from, checked (a 400 otherwise); None for free text."""
    asked = [(field, value) for field, value in _candidates(request) if value is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"{asked[0][0]} and {asked[1][0]}: ask for one structured output at a time", asked[1][0])
    field, value = asked[0]
    spec = _spec(field, value)
    try:
        check(spec)
    except StructuredOutputError as exc:
        raise bad_request(f"{field}: {exc}", field) from None
    return spec, field


def _candidates(request: schemas.SamplingFields) -> list[tuple[str, Any]]:
    fmt = request.response_format
    if fmt is not None and fmt.get("type") in (None, "text"):
        fmt = None
    return [("response_format", fmt), ("structured_outputs", request.structured_outputs),
            ("guided_json", request.guided_json), ("guided_regex", request.guided_regex),
            ("guided_choice", request.guided_choice), ("guided_grammar", request.guided_grammar)]


def _spec(field: str, value: Any) -> StructuredOutput:
    if field == "response_format":
        return _from_response_format(value)
    if field == "structured_outputs":
        return _from_structured_outputs(value)
    return _built(field, _kind_of(field.removeprefix("guided_"), value, field))


def _from_response_format(fmt: dict) -> StructuredOutput:
    kind = fmt.get("type")
    if kind == "json_object":
        return _built("response_format", {"kind": "json_object"})
    if kind != "json_schema":
        raise bad_request(f"response_format.type: one of text, json_object, json_schema, not {kind!r}",
                          "response_format")
    body = fmt.get("json_schema")
    if not isinstance(body, dict) or not isinstance(body.get("schema", {}), dict):
        raise bad_request("response_format.json_schema: an object with the schema under 'schema'", "response_format")
    # OpenAI's schema is optional ("any JSON"); its name and strict flag change nothing here: the
    # output is always held to the schema.
    return _built("response_format", {"kind": "json_schema", "spec": _schema_text(body.get("schema") or {})})


def _from_structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs: an object such as {\"json\": {...}} or {\"regex\": \"...\"}",
                          "structured_outputs")
    unknown = [key for key in value if key not in (*SPEC_KEYS, *IGNORED_KEYS)]
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]}: not supported (json, regex, choice, grammar or "
                          "json_object)", "structured_outputs")
    asked = [key for key in SPEC_KEYS if value.get(key) not in (None, False)]
    if len(asked) != 1:
        raise bad_request("structured_outputs: exactly one of json, regex, choice, grammar, json_object",
                          "structured_outputs")
    key = asked[0]
    if key == "json_object":
        return _built("structured_outputs", {"kind": "json_object"})
    return _built("structured_outputs", _kind_of(key, value[key], f"structured_outputs.{key}"))


def _kind_of(key: str, value: Any, where: str) -> dict:
    """vLLM's names (json, regex, choice, grammar) as a spec's fields."""
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{where}: not JSON ({exc})", where.split(".")[0]) from None
        if not isinstance(value, dict):
            raise bad_request(f"{where}: a JSON schema object", where.split(".")[0])
        return {"kind": "json_schema", "spec": _schema_text(value)}
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{where}: a list of strings", where.split(".")[0])
        return {"kind": "choice", "choices": value}
    if not isinstance(value, str):
        raise bad_request(f"{where}: a string", where.split(".")[0])
    if key == "regex":
        return {"kind": "regex", "spec": value}
    return {"kind": grammar_syntax(value), "spec": value}


def _schema_text(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"))


def _built(field: str, fields: dict) -> StructuredOutput:
    try:
        return StructuredOutput(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        if error["type"] == "string_too_long" and error["loc"] == ("spec",):
            raise bad_request(f"{field}: the schema or grammar is {len(fields['spec'])} characters; at most "
                              f"{MAX_STRUCTURED_SPEC_CHARS} are taken", field) from None
        raise bad_request(f"{field}: {first_error(exc)}", field) from None
