"""The BPE a from-scratch model trains first (shared/text/bpe_trainer.py): deterministic, exact on any
text, code-shaped pieces, and a tokenizer directory that serves with its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.shared.text.bpe_trainer import (
    CHAT_TEMPLATE,
    END_OF_TEXT,
    SPECIAL_TOKENS,
    TURN_END,
    TURN_START,
    train_bpe,
    write_tokenizer_dir,
)
from tandem.shared.text.chat_template import ChatTemplate
from tandem.shared.text.tokenizer import HFTokenizer
from tandem.shared.train.data import stdlib_files

VOCAB = 1024


@pytest.fixture(scope="module")
def corpus() -> list[Path]:
    """A slice of the standard library: enough text for real merges, fast to train on."""
    return stdlib_files()[:60]


@pytest.fixture(scope="module")
def tokenizer_dir(corpus, tmp_path_factory) -> Path:
    return write_tokenizer_dir(train_bpe(corpus, VOCAB), tmp_path_factory.mktemp("bpe"))


def test_training_twice_gives_the_same_tokenizer(corpus, tokenizer_dir):
    again = json.loads(train_bpe(corpus, VOCAB).to_str())
    assert again == json.loads((tokenizer_dir / "tokenizer.json").read_text()), "BPE training is not deterministic"


def test_vocabulary_size_and_special_ids(tokenizer_dir):
    tokenizer = HFTokenizer(tokenizer_dir)
    assert tokenizer.vocab_size == VOCAB
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x ** 2  # square\n",
    "naïve café — 日本語 🙂\r\n\ttabs\x00nul",
    "    \n\n        \n",
    "",
])
def test_any_text_round_trips(tokenizer_dir, text):
    tokenizer = HFTokenizer(tokenizer_dir)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_indentation_and_keywords_are_whole_tokens(tokenizer_dir):
    tokenizer = HFTokenizer(tokenizer_dir)
    pieces = [tokenizer._tokenizer.id_to_token(i) for i in tokenizer.encode("\n        return self\n")]
    assert "Ġreturn" in pieces, f"' return' is not one token: {pieces}"
    assert len(pieces) <= 5, f"an 8-space indent split into too many pieces: {pieces}"


def test_special_tokens_are_never_produced_from_plain_text_merges(tokenizer_dir):
    tokenizer = HFTokenizer(tokenizer_dir)
    assert tokenizer.encode(END_OF_TEXT) == [0], "the end-of-text marker must encode as its own id"
    assert tokenizer.decode([0, *tokenizer.encode("x = 1")]) == "x = 1", "decode skips special tokens"


def test_tokenizer_config_carries_the_chat_template(tokenizer_dir):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["eos_token"] == END_OF_TEXT
    template = ChatTemplate.from_model_dir(tokenizer_dir)
    assert template is not None and template.source == CHAT_TEMPLATE


def test_chat_template_renders_turns_and_the_generation_prompt(tokenizer_dir):
    template = ChatTemplate.from_model_dir(tokenizer_dir)
    prompt = template.render([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Write a sum function."}])
    assert prompt == (f"{TURN_START}system\nBe brief.{TURN_END}\n{TURN_START}user\nWrite a sum function."
                      f"{TURN_END}\n{TURN_START}assistant\n")
    ids = HFTokenizer(tokenizer_dir).encode(prompt)
    assert ids.count(2) == 3 and ids.count(3) == 2, "turn markers must be single special tokens"


def test_chat_template_lists_tools_and_renders_calls_the_hermes_way(tokenizer_dir):
    template = ChatTemplate.from_model_dir(tokenizer_dir)
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    prompt = template.render([
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3"},
    ], tools=[tool])
    assert prompt.startswith(f"{TURN_START}system\n# Tools\n"), prompt
    assert json.dumps(tool) in prompt
    assert (f"{TURN_START}assistant\n<tool_call>\n" + '{"name": "add", "arguments": {"a": 1, "b": 2}}'
            + f"\n</tool_call>{TURN_END}\n{TURN_START}tool\n3{TURN_END}\n") in prompt, prompt
    assert prompt.endswith(f"{TURN_START}assistant\n")
