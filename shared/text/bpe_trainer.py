"""Training a subword tokenizer for a model tandem trains from scratch (the ``coder`` preset).

A byte-level BPE, trained with the ``tokenizers`` package on the job's own text, written as the
``tokenizer.json`` + ``tokenizer_config.json`` pair a Hugging Face checkpoint carries, so the
trained model serves like any other directory (``HFTokenizer``, its chat template, transformers).

Pre-tokenization follows the cl100k family's split, which suits source code: a run of spaces
stays one piece except the space before a word (so indentation becomes a few whole-indent tokens),
newlines group together, digits go in threes, and letters never merge across punctuation. Byte
fallback is free (every byte is in the base alphabet), so any text encodes and decodes exactly.

The trainer is deterministic for the same files in the same order: the pair counts are exact and
ties between equally frequent pairs are broken by the pair itself, whatever the thread count.

    tokenizer = train_bpe(stdlib_files(), vocab_size=8192)
    write_tokenizer_dir(tokenizer, out_dir)   # tokenizer.json, tokenizer_config.json (chat template)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"  # between documents; what a completion ends with
PAD = "<|pad|>"
TURN_START = "<|im_start|>"  # ChatML turn markers: the Hermes-style template of Qwen2.5 uses them
TURN_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, PAD, TURN_START, TURN_END)  # ids 0..3, in this order

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML turns; tools the Hermes way (a system turn lists them in <tools>, calls come back in
# <tool_call> blocks, results as a tool turn), which the front end's tool-call parser reads.
CHAT_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message['role'] == 'system') %}
<|im_start|>{{ message['role'] }}
{% if message['content'] %}{{ message['content'] }}{% endif %}
{%- if message['tool_calls'] is defined %}
{%- for tool_call in message['tool_calls'] %}
{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}
{% if message['content'] or not loop.first %}
{% endif %}<tool_call>
{{ {'name': call['name'], 'arguments': call['arguments'] if call['arguments'] is defined else {}} | tojson }}
</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def _texts(files: Sequence[Path], separator: str) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace") + separator


def train_bpe(files: Sequence[Path], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` entries (the special tokens and the 256 bytes included)
    trained on ``files`` read in the order given."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges; use at least {len(SPECIAL_TOKENS) + 512}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(files, "\n"), trainer=trainer, length=len(files))
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json: the special tokens by role and the chat template (transformers' keys)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": END_OF_TEXT,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False} for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_dir(tokenizer: Tokenizer, path: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return path
