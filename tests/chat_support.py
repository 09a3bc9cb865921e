"""Small Hugging Face tokenizer directories with chat templates, built offline for tests: a
Llama-3-style and a Qwen2.5-style (ChatML) family, each a byte-level BPE tokenizer.json trained
in-process on a few sentences with the family's special tokens, and a tokenizer_config.json whose
chat template is written in the style of those models' published templates. The chat template
tests check tandem's rendering against transformers' with them; the fine-tuning data tests check
the assistant-token masks on them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --- the two model families ---------------------------------------------------------------------

# Llama 3.x Instruct's shape: <|begin_of_text|>, a system turn that always comes first and carries the
# knowledge cutoff and today's date, then <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|>.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant turns may follow the system prompt") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2/2.5's ChatML: <|im_start|>role\n content <|im_end|>\n, a default system prompt where the chat
# has none, tools listed as JSON in the system turn, tool calls and tool responses as tagged JSON.
QWEN_TEMPLATE = """\
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
{%- else %}
    {%- set system = default_system %}
{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
    {{- "\\n\\n# Tools\\n\\nYou may call functions to help with the request. Their signatures:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" + tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nTo call one, reply with <tool_call></tool_call> around a JSON object with its name and " }}
    {{- "arguments." }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}
        {%- continue %}
    {%- elif message.role in ["user", "system"] or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The models' pre-tokenizer splits (Llama 3 groups up to three digits; Qwen2 splits every digit).
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Family:
    tokenizer_class: str  # as upstream's tokenizer_config names it (transformers picks its pipeline by it)
    template: str
    special_tokens: tuple[str, ...]
    split: str
    named_tokens: dict[str, str | None]  # tokenizer_config's bos_token, eos_token, ...
    nfc: bool = False  # Qwen2 NFC-normalizes
    bos: str | None = None  # prepended by the post-processor (Llama 3): add_special_tokens=False must skip it
    extra: dict[str, Any] = field(default_factory=dict)  # template variables every render of it gets


FAMILIES = {
    "llama3": Family(
        "PreTrainedTokenizerFast", LLAMA3_TEMPLATE,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        _SPLIT % "{1,3}", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        bos="<|begin_of_text|>", extra={"date_string": "26 Jul 2024"},  # not strftime_now: one day, one prompt
    ),
    "qwen2": Family(
        "Qwen2Tokenizer", QWEN_TEMPLATE, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), _SPLIT % "",
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None}, nfc=True,
    ),
}

CORPUS = [
    "You are a helpful assistant. What is the capital of France? Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog, 12345 times; then it rests.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} <tool_call> </tool_response>',
    "Cutting Knowledge Date: December 2023. Today Date: 26 Jul 2024. Café, naïve, 18°C.",
]


def write_byte_bpe(directory: Path, family: Family) -> None:
    """A byte-level BPE tokenizer.json in the family's style, its special tokens added as AddedTokens,
    and the tokenizer_config.json beside it (with added_tokens_decoder, as save_pretrained writes)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    if family.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(token, special=True, normalized=False) for token in family.special_tokens]
    trainer = BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if family.bos is None:
        tokenizer.post_processor = byte_level
    else:
        bos = (family.bos, tokenizer.token_to_id(family.bos))
        tokenizer.post_processor = processors.Sequence([byte_level, processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[bos])])
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): dict(content=token, lstrip=False, normalized=False, rstrip=False,
                                                single_word=False, special=True)
        for token in family.special_tokens
    }
    config = dict(tokenizer_class=family.tokenizer_class, added_tokens_decoder=added, chat_template=family.template,
                  model_max_length=131072, clean_up_tokenization_spaces=False, **family.named_tokens)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_word_tokenizer(directory: Path) -> None:
    """The smallest tokenizer.json transformers loads, for tests about the template files only."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
