"""A worker's vocabulary as llguidance sees it: each token id's bytes, the specials, the eos ids.

The mask has one bit per row of the model's logits, which may be wider than the tokenizer (a
vocabulary padded to a multiple of 64): ids past the tokenizer's are never allowed. A Hugging Face
tokenizer.json is read by llguidance itself; one it cannot read (no decoder it knows, a word-level
model) is given as its pieces' bytes instead: byte-level pieces mapped back through GPT-2's byte
alphabet, SentencePiece's ``<0xNN>`` and ``▁``, anything else as its UTF-8.
"""

from __future__ import annotations

import json
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


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted: the alphabet byte-level BPE pieces are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def piece_bytes(piece: str, byte_level: bool, byte_map: dict[str, int]) -> bytes:
    """The bytes a tokenizer.json piece stands for."""
    if byte_level:
        return bytes(byte_map[c] for c in piece) if all(c in byte_map for c in piece) else piece.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def _hf_pieces(tokenizer: HFTokenizer, vocab_size: int) -> _TokenBytes:
    """``tokenizer``'s pieces as bytes, for a tokenizer.json llguidance cannot read itself."""
    spec = json.loads(tokenizer.to_json())
    vocab = spec["model"].get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        vocab = {piece: token for token, (piece, _) in enumerate(vocab)}
    added = spec.get("added_tokens") or []
    specials = {t["id"] for t in added if t.get("special")}
    byte_level = "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    byte_map = byte_level_decoder()
    tokens = [f"<|unused_{i}|>".encode() for i in range(vocab_size)]
    known = set()
    for piece, token in {**vocab, **{t["content"]: t["id"] for t in added}}.items():
        if token < vocab_size:
            tokens[token] = piece.encode() if token in specials else piece_bytes(piece, byte_level, byte_map)
            known.add(token)
    specials |= set(range(vocab_size)) - known
    return _TokenBytes(tokens, sorted(specials), tokenizer.eos_token_ids[0], tokenizer.bos_token_id,
                       lambda text: tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False))


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int):  # noqa: ANN201 - an llguidance.LLTokenizer
    """``tokenizer`` as an ``llguidance.LLTokenizer`` with ``vocab_size`` ids (the logits' width)."""
    from llguidance import LLTokenizer
    from llguidance._tokenizer import TokenizerWrapper

    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        try:
            return LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None)
        except ValueError:  # "can't determine decoder type" and the like: give it the pieces' bytes
            return LLTokenizer(TokenizerWrapper(_hf_pieces(tokenizer, vocab_size)), n_vocab=vocab_size,
                               eos_token=eos or None)
    if isinstance(tokenizer, (ByteTokenizer, SyntheticTokenizer)):
        return LLTokenizer(TokenizerWrapper(_byte_level(tokenizer, vocab_size)), n_vocab=vocab_size,
                           eos_token=eos or None)
    raise ValueError(f"structured outputs need a byte-level or Hugging Face tokenizer, not {type(tokenizer).__name__}")
