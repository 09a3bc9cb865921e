"""Token bitmasks: which tokens a row keeps, the rows no token can continue, and the logits left
untouched where no mask applies."""

from __future__ import annotations

import pytest
import torch

from tandem.shared.structured.bitmask import TokenBitmask, words_per_row

VOCAB = 70  # three int32 words a row, the last one partly past the vocabulary


def mask_of(allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros((len(allowed), words_per_row(VOCAB)), dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            word, bit = divmod(token, 32)
            words[row, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)  # bit 31 is the sign
    return words


@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [0, 2]], ids=["every row", "one row", "two of three"])
def test_a_mask_keeps_exactly_its_tokens_and_leaves_other_rows_alone(rows: list[int]) -> None:
    allowed = [{0, 31, 32, 69}, {5}, {63, 64}]
    logits = torch.randn(3, VOCAB)
    masked = TokenBitmask(rows, mask_of([allowed[r] for r in rows])).apply(logits)
    assert masked is not logits, "the raw logits (the logprobs') are never written"
    for row in range(3):
        kept = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        if row in rows:
            assert kept == allowed[row], f"row {row} keeps {sorted(kept)}"
        else:
            assert torch.equal(masked[row], logits[row]), f"row {row} has no mask but changed"


def test_rows_no_token_can_continue_are_found_and_dropped() -> None:
    bitmask = TokenBitmask([2, 5, 7], mask_of([{1}, set(), set()]))
    assert bitmask.empty_rows() == [5, 7]
    left = bitmask.without([5, 7])
    assert left is not None and left.rows == [2] and left.words.shape[0] == 1
    assert bitmask.without([2, 5, 7]) is None
