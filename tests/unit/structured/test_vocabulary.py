"""A worker's vocabulary as the grammar library sees it, including a tokenizer.json llguidance
cannot read itself (a word-level model with no decoder): then its pieces' bytes are given."""

from __future__ import annotations

import pytest
from model_support import write_tokenizer_json

from tandem.shared.protocol.serving import StructuredOutput
from tandem.shared.structured.bitmask import fill_bitmask
from tandem.shared.structured.compiler import GrammarCompiler
from tandem.shared.structured.vocabulary import byte_level_decoder, piece_bytes
from tandem.shared.text.tokenizer import HFTokenizer

LOGITS_WIDTH = 64  # wider than the 12-piece tokenizer, as a padded embedding is


def test_a_word_level_tokenizer_gets_a_grammar_over_its_pieces(tmp_path) -> None:
    write_tokenizer_json(tmp_path)
    tokenizer = HFTokenizer(tmp_path, eos_token_ids=[2])
    compiler = GrammarCompiler(tokenizer, LOGITS_WIDTH)
    grammar = compiler.output_grammar(StructuredOutput(kind="choice", choices=["fox", "dog"]))
    mask = fill_bitmask([(0, grammar)], LOGITS_WIDTH, parallel=False)
    allowed = [t for t in range(LOGITS_WIDTH) if (int(mask.words[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == sorted(tokenizer.encode(word, add_special_tokens=False)[0] for word in ("fox", "dog")), allowed


@pytest.mark.parametrize("piece, byte_level, expected", [
    ("Ġhello", True, b" hello"), ("Ċ", True, b"\n"), ("<0x0A>", False, b"\n"), ("\u2581the", False, b" the"),
    ("plain", False, b"plain"),
])
def test_pieces_become_the_bytes_they_stand_for(piece: str, byte_level: bool, expected: bytes) -> None:
    assert piece_bytes(piece, byte_level, byte_level_decoder()) == expected
