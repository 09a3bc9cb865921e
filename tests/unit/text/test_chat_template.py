"""Chat templates (shared/text/chat_template.py) against transformers' ``apply_chat_template``.

Two model directories are built here, offline (``chat_support``): a Llama-3-style one and a
Qwen2.5-style (ChatML) one, each a byte-level BPE tokenizer.json trained in-process with the models'
special tokens plus a tokenizer_config.json whose chat template is written in the style of those
models' published templates. A conversation must render to the same text and, through tandem's own tokenizer, to the
same token ids as transformers gives. The rest checks where templates come from, the helpers
templates call, the sandbox, the errors users see, and the tiny model's built-in template.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from chat_support import FAMILIES, write_byte_bpe, write_word_tokenizer

from tandem.shared.model.meta import TINY, TINY_RANDOM, shipped_checkpoint
from tandem.shared.text.chat_template import (
    NO_TEMPLATE,
    TINY_MODEL_NAMES,
    ChatTemplate,
    ChatTemplateError,
    chat_template_for,
    tiny_template,
)
from tandem.shared.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, family in FAMILIES.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        write_byte_bpe(dirs[name], family)
    return dirs


@pytest.fixture(scope="module")
def hf_tokenizers(model_dirs: dict[str, Path]) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    return {name: transformers.AutoTokenizer.from_pretrained(path) for name, path in model_dirs.items()}


# --- conversations ------------------------------------------------------------------------------

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville — <b>today</b> & tomorrow",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


@dataclass(frozen=True)
class Chat:
    id: str
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    hf_messages: list[dict[str, Any]] | None = None  # what transformers gets where it differs (parts pre-joined)
    families: tuple[str, ...] = tuple(FAMILIES)


CHATS = [
    Chat("system+user", [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]),
    Chat("user only", [{"role": "user", "content": "The quick brown fox: 1234567 times?"}]),
    Chat("multi-turn", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "And print(add(2, 3))?"},
    ]),
    Chat("text parts", [
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "the lazy dog."}]},
    ], hf_messages=[{"role": "user", "content": "Describe\nthe lazy dog."}]),
    Chat("no generation prompt", [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ], add_generation_prompt=False),
    Chat("whitespace and unicode", [
        {"role": "user", "content": "  Cafe\u0301 at 18°C \n\n"},  # a combining accent: Qwen's NFC must apply
    ]),
    Chat("tools", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [  # OpenAI clients send content: null here
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": "18°C"}'},
    ], extra={"tools": TOOLS}, families=("qwen2",), hf_messages=[  # vLLM hands transformers the arguments parsed
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": "18°C"}'},
    ]),
]
PARITY_CASES = [
    pytest.param(name, chat, id=f"{name}-{chat.id}") for name in FAMILIES for chat in CHATS if name in chat.families
]


@pytest.mark.parametrize(("family", "chat"), PARITY_CASES)
def test_render_matches_transformers_text_and_tokens(family: str, chat: Chat, model_dirs, hf_tokenizers) -> None:
    template = ChatTemplate.from_model_dir(model_dirs[family])
    assert template is not None, f"no template found in {model_dirs[family]}"
    extra = {**FAMILIES[family].extra, **chat.extra}
    untouched = copy.deepcopy(chat.messages)

    ours = template.render(chat.messages, add_generation_prompt=chat.add_generation_prompt, **extra)

    assert chat.messages == untouched, "render() modified the caller's messages"
    hf = hf_tokenizers[family]
    kwargs = dict(add_generation_prompt=chat.add_generation_prompt, **extra)
    theirs = hf.apply_chat_template(chat.hf_messages or chat.messages, tokenize=False, **kwargs)
    assert ours == theirs, f"prompt differs from transformers'\n ours:   {ours!r}\n theirs: {theirs!r}"
    our_ids = load_tokenizer(model_dirs[family]).encode(ours, add_special_tokens=False)
    their_ids = hf.apply_chat_template(chat.hf_messages or chat.messages, tokenize=True, return_dict=False, **kwargs)
    assert our_ids == their_ids, f"token ids differ from transformers'\n ours:   {our_ids}\n theirs: {their_ids}"


@pytest.mark.parametrize("family", FAMILIES)
def test_special_tokens_match_transformers(family: str, model_dirs, hf_tokenizers) -> None:
    template = ChatTemplate.from_model_dir(model_dirs[family])
    assert dict(template.special_tokens) == hf_tokenizers[family].special_tokens_map
    assert template.bos_token == FAMILIES[family].named_tokens["bos_token"]
    assert template.eos_token == FAMILIES[family].named_tokens["eos_token"]


def test_llama3_prompt_holds_exactly_one_bos(model_dirs) -> None:
    """The template writes <|begin_of_text|>; encoding with special tokens would add a second."""
    tokenizer = load_tokenizer(model_dirs["llama3"])
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    prompt = ChatTemplate.from_model_dir(model_dirs["llama3"]).render([{"role": "user", "content": "hi"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == bos and ids.count(bos) == 1, ids
    assert tokenizer.encode(prompt)[:2] == [bos, bos], "the post-processor should prepend its own bos"


def test_qwen_default_system_prompt(model_dirs) -> None:
    prompt = ChatTemplate.from_model_dir(model_dirs["qwen2"]).render([{"role": "user", "content": "hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# --- the helpers templates call, against transformers ------------------------------------------

HELPER_MESSAGES = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "question"},
    {"role": "assistant", "content": None, "reasoning": "because", "tool_calls": [{"function": {"name": "f"}}]},
    {"role": "user", "content": "again"},
]
HELPER_TEMPLATES = {
    "tojson keeps non-ASCII and HTML": "{{ tools | tojson }}",
    "tojson indent": "{{ tools | tojson(indent=2) }}",
    "tojson separators sort_keys": "{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}"
                    "{% if loop.index0 > 2 %}{% break %}{% endif %}{{ m.role }};{% endfor %}",
    "generation block": "{% for m in messages %}{% generation %}{% set x = 1 %}{{ m.role }}{% endgeneration %}"
                        "|{% endfor %}[{{ x }}]",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "dict": "{{ dict(a=1, b='x') | tojson }} {{ dict.fromkeys(['k'], 0) | tojson }}",
    "trim and lstrip blocks": "  {% for m in messages %}\n    {{ m.role }}\n  {% endfor %}\n"
                              "{% if add_generation_prompt %}\n  go\n{% endif %}\n",
    "variables": "{{ tools is none }} {{ documents is none }} {{ missing is defined }} [{{ missing }}] "
                 "{{ bos_token is defined }} {{ eos_token }} {{ add_generation_prompt }}",
    "null keys dropped": "{% for m in messages %}{{ m.role }}:{{ 'content' in m }};{% endfor %}",
    "reasoning aliases": "{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.reasoning }};"
                         "{% endfor %}",
}


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no tools"])
@pytest.mark.parametrize("source", HELPER_TEMPLATES.values(), ids=HELPER_TEMPLATES.keys())
def test_helpers_match_transformers(source: str, tools, model_dirs, hf_tokenizers) -> None:
    template = ChatTemplate(source, ChatTemplate.from_model_dir(model_dirs["qwen2"]).special_tokens)
    ours = template.render(HELPER_MESSAGES, tools=tools)
    theirs = hf_tokenizers["qwen2"].apply_chat_template(
        HELPER_MESSAGES, tools=tools, chat_template=source, add_generation_prompt=True, tokenize=False)
    assert ours == theirs, f"\n ours:   {ours!r}\n theirs: {theirs!r}"


@pytest.mark.parametrize(("tool_calls", "expected"), [
    ([{"function": {"name": "f", "arguments": '{"x": [1, "é"]}'}}],
     '[{"function": {"name": "f", "arguments": {"x": [1, "é"]}}}]'),
    ([{"function": {"name": "f", "arguments": ""}}], '[{"function": {"name": "f", "arguments": {}}}]'),
    ([{"function": {"name": "f"}}], '[{"function": {"name": "f", "arguments": {}}}]'),
    ([], "no tool_calls"),
], ids=["JSON string", "empty string", "missing", "empty list"])
def test_tool_call_arguments_are_parsed_as_vllm_does(tool_calls, expected: str) -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.tool_calls | tojson if m.tool_calls is defined "
                            "else 'no tool_calls' }}{% endfor %}")
    assert template.render([{"role": "assistant", "content": None, "tool_calls": tool_calls}]) == expected


def test_tool_call_arguments_that_are_not_json_are_a_chat_template_error() -> None:
    calls = [{"function": {"name": "f", "arguments": "{oops"}}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        tiny_template().render([{"role": "assistant", "tool_calls": calls}])


def test_strftime_now_is_local_time() -> None:
    before = datetime.now().strftime("%d %b %Y %H")
    rendered = ChatTemplate("{{ strftime_now('%d %b %Y %H') }}").render([{"role": "user", "content": "hi"}])
    assert rendered in (before, datetime.now().strftime("%d %b %Y %H"))


# --- where the template comes from --------------------------------------------------------------

NAMED = [{"name": "default", "template": "{{ 'config default' }}"},
         {"name": "tool_use", "template": "{{ 'config tools' }}"}]
# layout id -> (tokenizer_config's chat_template, files beside it, rendered without tools, with tools)
LAYOUTS = {
    "config string": ("{{ 'config' }}", {}, "config", "config"),
    "config named list": (NAMED, {}, "config default", "config tools"),
    "jinja file over config string": ("{{ 'config' }}", {"chat_template.jinja": "{{ 'file' }}"}, "file", "file"),
    "jinja file over config list": (NAMED, {"chat_template.jinja": "{{ 'file' }}"}, "file", "file"),
    "jinja file alone": (None, {"chat_template.jinja": "{{ 'file' }}"}, "file", "file"),
    "jinja files with tool_use": (None, {"chat_template.jinja": "{{ 'file' }}",
                                         "additional_chat_templates/tool_use.jinja": "{{ 'file tools' }}"},
                                  "file", "file tools"),
}


def write_layout(directory: Path, config_entry: Any, files: dict[str, str]) -> Path:
    write_word_tokenizer(directory)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                              "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"}}
    if config_entry is not None:
        config["chat_template"] = config_entry
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    return directory


@pytest.mark.parametrize(("entry", "files", "plain", "with_tools"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_template_source_as_transformers_picks_it(entry, files, plain, with_tools, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = write_layout(tmp_path, entry, files)
    template = ChatTemplate.from_model_dir(directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "user", "content": "hi"}]

    assert template.render(chat) == plain == hf.apply_chat_template(chat, tokenize=False)
    assert template.render(chat, tools=TOOLS) == with_tools == hf.apply_chat_template(chat, tools=TOOLS,
                                                                                      tokenize=False)
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")  # a string and an AddedToken dict


def test_special_tokens_map_json_is_read_without_added_tokens_decoder(tmp_path: Path) -> None:
    directory = write_layout(tmp_path, "{{ bos_token }}", {})
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<B>"}}), "utf-8")
    assert ChatTemplate.from_model_dir(directory).special_tokens == {"bos_token": "<B>", "eos_token": "</s>"}


def test_no_template_in_directory_is_none(tmp_path: Path) -> None:
    assert ChatTemplate.from_model_dir(write_layout(tmp_path, None, {})) is None


@pytest.mark.parametrize(("entry", "expected"), [
    ([{"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}],
     "rag, tool_use but none named 'default'"),
    (42, "must be a string or a list"),
    ([{"name": "default"}], "must be a string or a list"),
], ids=["no default", "a number", "an entry without template"])
def test_malformed_config_entry_is_a_chat_template_error(entry, expected: str, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=expected) as caught:
        ChatTemplate.from_model_dir(write_layout(tmp_path, entry, {}))
    assert_one_line(caught.value)


# --- errors -------------------------------------------------------------------------------------


def assert_one_line(error: BaseException) -> None:
    text = str(error)
    assert text and "\n" not in text, f"error message is not one line: {text!r}"


ALTERNATING = """\
{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
[{{ message['role'] }}] {{ message['content'] }}
{% endfor %}
"""


def test_raise_exception_gives_the_templates_message() -> None:
    template = ChatTemplate(ALTERNATING)
    assert template.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == (
        "[user] a\n[assistant] b\n"
    )
    with pytest.raises(ChatTemplateError) as caught:
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert str(caught.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


def test_raise_exception_message_is_made_one_line() -> None:
    with pytest.raises(ChatTemplateError) as caught:
        ChatTemplate("{{ raise_exception('first line\\n  second line') }}").render([{"role": "user", "content": "a"}])
    assert str(caught.value) == "first line second line"


@pytest.mark.parametrize("source", [
    "{% for message in messages %}{{ message.content }}",
    "{{ messages[0] }",
    "{% if %}yes{% endif %}",
    "{% generation %}unclosed",
], ids=["unclosed for", "unclosed expression", "empty if", "unclosed generation"])
def test_syntax_error_is_a_chat_template_error_at_load(source: str, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match=r"does not compile: syntax error at line \d+") as caught:
        ChatTemplate(source)
    assert_one_line(caught.value)
    assert isinstance(caught.value.__cause__, jinja2.TemplateSyntaxError)
    (tmp_path / "chat_template.jinja").write_text(source, encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_model_dir(tmp_path)


@pytest.mark.parametrize(("source", "expected"), [
    ("{{ bos_token + 'x' }}", "'bos_token' is undefined"),  # Qwen's case: no bos_token at all
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ dict.mro() }}", "has no attribute 'mro'"),  # dict is a dict maker, not the type
], ids=["undefined", "type error", "zero division", "dict is not the type"])
def test_render_failure_is_a_chat_template_error(source: str, expected: str) -> None:
    with pytest.raises(ChatTemplateError, match=expected) as caught:
        ChatTemplate(source).render([{"role": "user", "content": "a"}])
    assert_one_line(caught.value)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ (''|attr('__class__')).__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append({'role': 'system'}) }}",
    "{{ messages[0].update(role='system') }}",
    "{% set ns = namespace(_private=1) %}",
    "{% set ns = namespace() %}{% set ns._private = 1 %}",
])
def test_sandbox_escape_is_a_chat_template_error(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="blocked by the sandbox") as caught:
        ChatTemplate(source).render([{"role": "user", "content": "a"}])
    assert isinstance(caught.value.__cause__, jinja2.exceptions.SecurityError)
    assert_one_line(caught.value)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}", "{{ lipsum.__globals__ }}", "{{ self._TemplateReference__context }}",
    "{{ ''.format.__self__ }}", "{{ '{0.__class__}'.format('') }}",
])
def test_sandbox_renders_unsafe_attributes_as_nothing(source: str) -> None:
    """Jinja's sandbox makes these undefined rather than failing: nothing of the object shows."""
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}]) == ""


@pytest.mark.parametrize(("content", "expected"), [
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     r"messages\[0\].content\[1\] is type 'image_url'; this model takes only text parts"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "type 'input_audio'"),
    (["bare string"], r"content\[0\] is a str, not a text part"),
    ([{"text": "no type"}], r"content\[0\] is a dict, not a text part"),
    ([{"type": "text"}], r"content\[0\] is a text part without a string 'text'"),
], ids=["image", "audio", "bare string", "no type", "no text"])
def test_bad_content_part_is_a_chat_template_error(content, expected: str) -> None:
    with pytest.raises(ChatTemplateError, match=expected) as caught:
        tiny_template().render([{"role": "user", "content": content}])
    assert_one_line(caught.value)


@pytest.mark.parametrize(("messages", "expected"), [
    ([], "messages is empty"),
    ("hello", "must be a list of messages, not str"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object, not str"),
    ([{"role": "user", "content": {1, 2}}], r"messages\[0\].content holds a set"),
], ids=["empty", "a string", "a non-object message", "a set"])
def test_bad_messages_are_a_chat_template_error(messages, expected: str) -> None:
    with pytest.raises(ChatTemplateError, match=expected):
        tiny_template().render(messages)


# --- the tiny model -----------------------------------------------------------------------------


@pytest.mark.parametrize(("messages", "add_generation_prompt", "expected"), [
    ([{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fizzbuzz(n):"}], True,
     "<|system|>\nYou write Python.\n<|user|>\ndef fizzbuzz(n):\n<|assistant|>\n"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "print('hi')"}], False,
     "<|user|>\nhi\n<|assistant|>\nprint('hi')\n"),
    ([{"role": "user", "content": [{"type": "text", "text": "import os"}, {"type": "text", "text": "os."}]}], True,
     "<|user|>\nimport os\nos.\n<|assistant|>\n"),
], ids=["system+user", "no generation prompt", "text parts"])
def test_tiny_template_renders_known_prompt(messages, add_generation_prompt: bool, expected: str) -> None:
    assert tiny_template().render(messages, add_generation_prompt=add_generation_prompt) == expected


def hf_dir(directory: Path, template: str | None) -> Path:
    directory.mkdir(parents=True)
    return write_layout(directory, template, {})


def trained_tiny_dir(tmp: Path) -> Path:
    """What ``tandem train --default`` leaves in <data_dir>/models/tiny: a config and weights, no tokenizer."""
    directory = tmp / "models" / "tiny"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}", encoding="utf-8")
    return directory


@pytest.mark.parametrize(("make", "name", "expected"), [
    (lambda tmp: None, "tiny", "tiny"),
    (lambda tmp: None, "tiny-random", "tiny"),
    (trained_tiny_dir, "tiny", "tiny"),
    (lambda tmp: shipped_checkpoint("tiny"), "tiny", "tiny"),  # None where the package lacks it: tiny all the same
    (lambda tmp: hf_dir(tmp / "my-model", "{{ 'own' }}"), "my-model", "{{ 'own' }}"),
    (lambda tmp: hf_dir(tmp / "my-model", None), "my-model", None),
    (lambda tmp: hf_dir(tmp / "tiny", None), "tiny", None),  # a Hugging Face folder that is named tiny
    (lambda tmp: None, "random:llama3-8b", None),
], ids=["tiny", "tiny-random", "trained tiny checkpoint", "shipped tiny checkpoint", "own template", "no template",
        "HF dir named tiny", "random preset"])
def test_chat_template_for(make, name: str, expected: str | None, tmp_path: Path) -> None:
    checkpoint = make(tmp_path)
    if expected is None:
        with pytest.raises(ChatTemplateError) as caught:
            chat_template_for(checkpoint, name)
        assert str(caught.value) == NO_TEMPLATE
    elif expected == "tiny":
        assert chat_template_for(checkpoint, name) == tiny_template()
    else:
        assert chat_template_for(checkpoint, name).source == expected


def test_import_needs_neither_torch_nor_transformers() -> None:
    code = ("import sys, tandem.shared.text.chat_template; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]", f"the chat templates imported {result.stdout.strip()}"


def test_tiny_model_names_are_the_model_packages() -> None:
    """The text layer spells the tiny model's names itself (it may not import shared/model)."""
    assert (TINY, TINY_RANDOM) == TINY_MODEL_NAMES
