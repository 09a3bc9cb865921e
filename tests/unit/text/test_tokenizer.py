"""Tests for tandem.shared.text.tokenizer: byte-level round trips and the tokenizer.json wrapper."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.shared.text.tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_PAD_ID,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

TEXTS = ["", "hello world", "héllo wörld", "日本語のテキスト", "emoji 🎉 and tabs\tnewlines\n", "a" * 300]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")), "ids must be the raw UTF-8 bytes, with no <bos>"
    assert tokenizer.decode(ids) == text


def test_byte_special_ids_and_partial_utf8() -> None:
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_ids) == (259, 256, [257])
    assert tokenizer.decode([BYTE_BOS_ID, *b"hi", BYTE_EOS_ID, BYTE_PAD_ID]) == "hi", "special ids must be dropped"
    euro = list("€".encode())
    assert tokenizer.decode(euro[:2]).endswith("\ufffd"), "an incomplete character decodes to U+FFFD"
    assert tokenizer.decode(euro) == "€"
    assert isinstance(tokenizer, Tokenizer)


def write_byte_level_bpe(directory: Path) -> Path:
    """Train a small byte-level BPE with a <s> template, like Llama 3's tokenizer.json."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = RawTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld", "日本語", "serving models is fun"]
    tokenizer.train_from_iterator(corpus * 20, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip(text: str, tmp_path: Path) -> None:
    write_byte_level_bpe(tmp_path)
    tokenizer = HFTokenizer(tmp_path, eos_token_ids=[1], bos_token_id=0)
    bos = tokenizer.token_to_id("<s>")
    ids = tokenizer.encode(text)
    assert ids[0] == bos, "encode applies the tokenizer's post-processor (adds <s>)"
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == text, "decode must skip <s> and restore the text exactly"
    assert tokenizer.eos_token_ids == [1] and tokenizer.bos_token_id == 0
    assert isinstance(tokenizer, Tokenizer)


def test_load_tokenizer(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    file = write_byte_level_bpe(tmp_path)
    for spec in (tmp_path, file):
        tokenizer = load_tokenizer(spec, eos_token_ids=[1])
        assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_token_ids == [1]
        assert tokenizer.vocab_size > 256, "byte-level BPE has at least the 256 byte tokens"
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "absent")
