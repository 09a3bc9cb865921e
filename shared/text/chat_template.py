"""Chat templates: OpenAI chat ``messages`` -> the prompt text a model was trained on.

A Hugging Face model ships its chat template as Jinja text, and the same conversation must become
the same prompt here as in ``transformers``' ``apply_chat_template`` (and so in vLLM, which calls
it): a prompt that differs by one newline or one special token is a different, worse prompt. This
module renders those templates the way transformers does, without importing it (the frontend runs
no model and must start fast):

- Where the template comes from (:meth:`ChatTemplate.from_model_dir`): ``chat_template.jinja``
  and ``additional_chat_templates/<name>.jinja`` beside the tokenizer win over the
  ``chat_template`` entry of ``tokenizer_config.json`` (a string, or a list of
  ``{"name", "template"}`` dicts); the template named ``default`` is used, or ``tool_use`` when the
  request has tools and the model has one.
- What the template sees: ``messages`` (None-valued keys dropped, text parts joined and tool call
  arguments parsed from JSON, as vLLM does before calling transformers),
  ``add_generation_prompt``, ``tools`` and ``documents`` (None unless given), the tokenizer's named
  special tokens (``bos_token``, ``eos_token``, ... only those it defines: Qwen has no
  ``bos_token``, and ``bos_token + x`` must fail there as it does in transformers) and any extra
  keyword variables; helpers ``raise_exception``, ``strftime_now`` and a ``tojson`` filter that,
  unlike Jinja's own, does not escape HTML and keeps non-ASCII text.
- How it runs: Jinja's immutable sandbox (templates come from model repositories, so they are
  untrusted code; ``dict`` and ``namespace`` are narrowed as transformers narrows them),
  ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, and transformers'
  ``{% generation %}`` block (which marks assistant text for training) rendered as its body.

Every failure is a :class:`ChatTemplateError` whose message is one line a user can act on; the
frontend answers it with HTTP 400. The HTTP front end renders prompts with it and the trainer renders
fine-tuning conversations with it (``shared/train/finetune_data.py``), so a model is trained on
exactly the text it is later served with; it lives in the text layer because of that, and imports
nothing above it (Jinja, the standard library).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one <name>.jinja each (transformers' name)
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # legacy; read only where tokenizer_config lacks added_tokens_decoder
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers refuses older Jinja: it has known sandbox escapes, and templates are untrusted code.
MIN_JINJA = (3, 1, 6)
NO_TEMPLATE = "this model has no chat template; use /v1/completions"
# The names the tiny model is served under (shared/model/meta.py's TINY and TINY_RANDOM, spelt again here
# because the text layer imports nothing from the model package; a test keeps the two equal).
TINY_MODEL_NAMES = ("tiny", "tiny-random")
# Older names for a message's reasoning that transformers copies into reasoning_content (and thinking).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# tandem's tiny model is byte-level and trained on Python source: it has no tokenizer_config and no
# special tokens, so its turns are marked with plain text, readable in logs and in the prompt. Tools
# come in Hermes style, as Qwen2.5 renders them (the frontend's tool-call parser and forcing grammar
# read that format): with ``tools``, a system turn (the conversation's own system message first)
# lists them, one ``tojson`` per line inside <tools></tools>; an assistant turn's calls are
# ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` lines after its text; a tool's
# result is a ``<|tool|>`` turn like any other. A conversation without tools or calls renders as it
# always has.
TINY_TEMPLATE = """\
{% if tools %}
<|system|>
{% if messages[0]['role'] == 'system' %}
{{ messages[0]['content'] }}

{% endif %}
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{% endif %}
{% for message in messages %}
{% if not (tools and loop.first and message['role'] == 'system') %}
<|{{ message['role'] }}|>
{% if message['tool_calls'] is defined %}
{% if message['content'] %}
{{ message['content'] }}
{% endif %}
{% for tool_call in message['tool_calls'] %}
{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}
<tool_call>
{{ {'name': call['name'], 'arguments': call['arguments'] if call['arguments'] is defined else {}} | tojson }}
</tool_call>
{% endfor %}
{% else %}
{{ message['content'] }}
{% endif %}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


class ChatTemplateError(ValueError):
    """A chat template could not be loaded or rendered; the message is one line for the user."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template with the special tokens it renders with.

    ``source`` is the default template's Jinja text; ``tool_use_source`` the template transformers
    picks instead when a request has tools (models that ship one named ``tool_use``).
    ``special_tokens`` maps the variable names of :data:`SPECIAL_TOKEN_NAMES` the tokenizer defines
    to their text. The templates compile on construction, so a broken one fails at load time.
    """

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    tool_use_source: str | None = None

    def __post_init__(self) -> None:
        _compile(self.source)
        if self.tool_use_source is not None:
            _compile(self.tool_use_source)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @classmethod
    def from_model_dir(cls, path: Path) -> ChatTemplate | None:
        """The template a Hugging Face model directory ships, or None where it ships none.

        Files beside the tokenizer win over tokenizer_config.json, as in transformers (whose
        ``save_pretrained`` now writes ``chat_template.jinja`` and leaves the config's entry out).
        """
        path = Path(path)
        config = _read_json(path / TOKENIZER_CONFIG)
        templates = _templates_from_files(path) or _templates_from_config(config, path)
        if not templates:
            return None
        if "default" not in templates:
            names = ", ".join(sorted(templates))
            raise ChatTemplateError(f"{path} has chat templates named {names} but none named 'default'")
        return cls(templates["default"], _special_tokens(path, config), templates.get("tool_use"))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt for ``messages``, ending with the assistant's header if add_generation_prompt.

        Unlike transformers, add_generation_prompt defaults to True: a chat completion always asks
        for the assistant's next turn. ``extra`` become template variables (``tools``, ``documents``,
        ``date_string``, ``enable_thinking``, ...) and override the special tokens of the same name.
        Text parts of a message's content are joined with newlines (vLLM's "string" content format).
        The prompt holds the template's own special tokens (Llama 3's ``<|begin_of_text|>``): encode
        it with add_special_tokens=False, as apply_chat_template does, or the model sees two.
        """
        conversation = _conversation(messages)
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens}
        variables.update(_plain(extra, "a template variable"))
        variables["messages"] = conversation
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        source = self.source
        if self.tool_use_source is not None and variables["tools"] is not None:
            source = self.tool_use_source
        template = _compile(source)
        try:
            return template.render(variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is the model repository's code: whatever it raises is a 400
            raise ChatTemplateError(f"the chat template failed: {_describe(exc)}") from exc


def tiny_template() -> ChatTemplate:
    """The built-in template of tandem's tiny model: ``<|role|>\\ncontent\\n`` per message."""
    return ChatTemplate(TINY_TEMPLATE)


def chat_template_for(checkpoint: Path | None, model_name: str) -> ChatTemplate:
    """The template to serve ``model_name`` with: the checkpoint's own, else the tiny model's built-in
    one for ``tiny``/``tiny-random``, else ChatTemplateError (chat needs a template; completions do not).

    A Hugging Face directory that happens to be named ``tiny`` (its model name is the folder's name)
    is not the tiny model: one with a tokenizer.json never falls back to the tiny template.
    """
    if checkpoint is not None:
        template = ChatTemplate.from_model_dir(checkpoint)
        if template is not None:
            return template
    is_tiny = model_name in TINY_MODEL_NAMES and (
        checkpoint is None or not (Path(checkpoint) / "tokenizer.json").exists()
    )
    if is_tiny:
        return tiny_template()
    raise ChatTemplateError(NO_TEMPLATE)


# --- loading ------------------------------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{file} is not a JSON object")
    return data


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read {file}: {exc}") from exc


def _templates_from_files(path: Path) -> dict[str, str]:
    """chat_template.jinja as "default", then additional_chat_templates/*.jinja by name (a
    default.jinja there replaces the file, the order transformers reads them in)."""
    templates = {}
    if (path / TEMPLATE_FILE).is_file():
        templates["default"] = _read_text(path / TEMPLATE_FILE)
    if (path / TEMPLATE_DIR).is_dir():
        for file in sorted((path / TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
    return templates


def _templates_from_config(config: Mapping[str, Any], path: Path) -> dict[str, str]:
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list) and all(
        isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        for item in entry
    ):
        return {item["name"]: item["template"] for item in entry}
    raise ChatTemplateError(
        f"chat_template in {path / TOKENIZER_CONFIG} must be a string or a list of {{name, template}} objects"
    )


def _special_tokens(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens as text. Each is a string or an AddedToken dict ({"content": ...});
    a null or missing one is left undefined. special_tokens_map.json, a legacy file, overrides the
    config only where the config has no added_tokens_decoder, as in transformers."""
    values: dict[str, Any] = dict(config)
    if "added_tokens_decoder" not in config:
        values.update(_read_json(path / SPECIAL_TOKENS_MAP))
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = values.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


# --- rendering ----------------------------------------------------------------------------------


def _conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fresh plain dicts for the template: None-valued keys dropped (OpenAI clients send
    ``"content": null`` beside tool calls, which templates test with ``is defined``), content parts
    joined, tool call arguments parsed, reasoning under each name templates read it by."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of messages, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object, not {type(message).__name__}")
        plain = {str(key): _plain(value, f"messages[{index}].{key}")
                 for key, value in message.items() if value is not None}
        if "content" in plain:
            plain["content"] = _content_text(plain["content"], index)
        if plain.get("role") == "assistant" and isinstance(plain.get("tool_calls"), list):
            _parse_tool_arguments(plain, index)
        reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        conversation.append(plain)
    return conversation


def _parse_tool_arguments(message: dict[str, Any], index: int) -> None:
    """vLLM's step before the template: OpenAI sends a tool call's arguments as a JSON string, tool-use
    templates (Qwen2.5, Llama 3.1) expect the object (``arguments | tojson`` would quote the string
    again). Empty or missing arguments become {}; an empty tool_calls list is dropped, so the
    template takes its plain assistant path."""
    if not message["tool_calls"]:
        del message["tool_calls"]
        return
    for number, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError as exc:
                where = f"messages[{index}].tool_calls[{number}].function.arguments"
                raise ChatTemplateError(f"{where} is not valid JSON: {exc}") from exc


def _content_text(content: Any, index: int) -> Any:
    """A string stays as it is; a list of text parts becomes their texts joined by newlines."""
    if not isinstance(content, list):
        return content
    texts = []
    for number, part in enumerate(content):
        where = f"messages[{index}].content[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            named = f"type {kind!r}" if kind is not None else f"a {type(part).__name__}, not a text part"
            raise ChatTemplateError(f"{where} is {named}; this model takes only text parts")
        if not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"{where} is a text part without a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _plain(value: Any, where: str) -> Any:
    """``value`` rebuilt from exact JSON types, so the template sees no object whose methods the
    sandbox does not know about (str subclasses such as enums become plain str); Pydantic models
    become their dumps."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key, where): _plain(item, where) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item, where) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item, where) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(), where)
    raise ChatTemplateError(f"{where} holds a {type(value).__name__}, which a chat template cannot take")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error at line {exc.lineno}: {exc.message}"
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"blocked by the sandbox: {exc}"
    if isinstance(exc, jinja2.TemplateError):
        return str(exc.message or type(exc).__name__)
    return f"{type(exc).__name__}: {exc}"


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


# --- the Jinja environment ----------------------------------------------------------------------


def _raise_exception(message: Any) -> None:
    """The template's own refusal (e.g. "Conversation roles must alternate"): its text, as is."""
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' tojson: plain json.dumps (Jinja's escapes <, >, & and ' for HTML and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """Today's date in the template (Llama 3.x's "Today Date"), in the server's local time."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: building dicts, not the type itself (whose attributes lead out)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace() refusing underscore-prefixed names, which could reach its internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's text with it
    (for training masks); a template using it must compile here too. Rendered, it is its body, in a
    scope of its own as in transformers."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    version = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA:
        raise ChatTemplateError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates need jinja2>=3.1.6"
        )
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    """The compiled template, once per distinct text (every request renders the same one)."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template must be text, not {type(source).__name__}")
    try:
        return _environment().from_string(source)
    except ChatTemplateError:
        raise
    except Exception as exc:
        raise ChatTemplateError(f"the chat template does not compile: {_describe(exc)}") from exc
