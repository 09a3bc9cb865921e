"""A worker's vocabulary as llguidance sees it: each token id's bytes, the specials, the eos ids.

The mask has one bit per row of the model's logits, which may be wider than the tokenizer (a
vocabulary padded to a multiple of 64): ids past the tokenizer's are never allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.shared.text.tokenizer import ByteTokenizer, HFTokenizer, SyntheticTokenizer, Tokenizer


class _TokenBytes:
    """What llguidance's ``TokenizerWrapper`` reads: token bytes, specials, eos/bos, and an encoder."""

    def __init__(self, tokens: Sequence[bytes], special_ids: Sequence[int], eos_token_id: int,
                 bos_token_id: int | None, encode) -> None:  # noqa: ANN001 - bytes -> ids
        self.tokens = list(tokens)
        self.special_token_ids = list(special_ids)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self._encode = encode

    def __call__(self, text: bytes | str) -> list[int]:
        return self._encode(text if isinstance(text, bytes) else text.encode("utf-8"))


def _byte_level(tokenizer: ByteTokenizer | SyntheticTokenizer, vocab_size: int) -> _TokenBytes:
    """Ids 0..255 are bytes; the tiny model's specials and a random model's other ids are tokens
    whose text no grammar asks for (a random model's `` t<id>`` would otherwise be text)."""
    tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
    return _TokenBytes(tokens, range(256, vocab_size), tokenizer.eos_token_ids[0], tokenizer.bos_token_id, list)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int):  # noqa: ANN201 - an llguidance.LLTokenizer
    """``tokenizer`` as an ``llguidance.LLTokenizer`` with ``vocab_size`` ids (the logits' width)."""
    from llguidance import LLTokenizer
    from llguidance._tokenizer import TokenizerWrapper

    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)
    if isinstance(tokenizer, (ByteTokenizer, SyntheticTokenizer)):
        return LLTokenizer(TokenizerWrapper(_byte_level(tokenizer, vocab_size)), n_vocab=vocab_size,
                           eos_token=eos or None)
    raise ValueError(f"structured outputs need a byte-level or Hugging Face tokenizer, not {type(tokenizer).__name__}")
