"""Token bitmasks: filled on host threads for a step's constrained rows, applied to its logits on the device.

A row's mask has one bit per token id (``int32`` words, bit ``i % 32`` of word ``i // 32``), set for
the tokens that keep its output inside its grammar. The engine fills the masks right after queueing
the step's forward, so on a GPU the host works while the device computes the logits; llguidance
fills the rows in parallel on its own threads, without the GIL. On a CPU device the forward is not
asynchronous, so there is nothing to overlap with, and llguidance's threads would fight torch's for
the same cores: the rows are filled on the calling thread. Rows without a grammar have no mask and
cost nothing; a step with none does no mask work at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.shared.kvtransfer.devcopy import host_values_to
from tandem.shared.structured.output_grammar import OutputGrammar

_EXECUTOR = None  # llguidance's thread pool, one per process


def _executor():  # noqa: ANN202 - an llguidance.LLExecutor
    global _EXECUTOR
    if _EXECUTOR is None:
        from llguidance import LLExecutor

        _EXECUTOR = LLExecutor()
    return _EXECUTOR


def words_per_row(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass
class TokenBitmask:
    """The masks of a step's constrained rows: ``rows`` (batch rows, ascending) and ``words``
    (``int32 [len(rows), words_per_row]``, on the host)."""

    rows: list[int]
    words: torch.Tensor

    def empty_rows(self) -> list[int]:
        """The rows no token can continue (the grammar admits nothing there)."""
        return [self.rows[i] for i in (self.words == 0).all(dim=1).nonzero().flatten().tolist()]

    def without(self, rows: Sequence[int]) -> TokenBitmask | None:
        """The same masks less ``rows``' (None when none is left)."""
        drop = set(rows)
        keep = [i for i, row in enumerate(self.rows) if row not in drop]
        if not keep:
            return None
        if len(keep) == len(self.rows):
            return self
        return TokenBitmask([self.rows[i] for i in keep], self.words[keep])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [B, V]`` with every token a row's mask leaves out at -inf: a new tensor, so the
        raw logits (the logprobs') are never written."""
        device, vocab = logits.device, logits.shape[-1]
        words = self.words.to(device, non_blocking=True)
        bits = torch.arange(32, device=device, dtype=torch.int32)
        allowed = ((words.unsqueeze(-1) >> bits) & 1).view(words.shape[0], -1)[:, :vocab].bool()
        if self.rows == list(range(logits.shape[0])):
            return logits.masked_fill(~allowed, float("-inf"))
        index = host_values_to(device, self.rows, torch.long)
        masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        return logits.index_copy(0, index, masked)


def fill_bitmask(grammars: Sequence[tuple[int, OutputGrammar]], vocab_size: int,
                 parallel: bool) -> TokenBitmask | None:
    """The masks of ``(row, grammar)`` pairs whose grammar constrains its next token (None: no row's
    does), in pinned memory and on llguidance's threads when ``parallel`` (a CUDA device's step).
    Rows sharing one grammar (a request's candidates sampled from the same logits) share one fill."""
    constrained = [(row, grammar) for row, grammar in grammars if grammar.constrains_next]
    if not constrained:
        return None
    words = torch.empty((len(constrained), words_per_row(vocab_size)), dtype=torch.int32, pin_memory=parallel)
    first_row_of: dict[int, int] = {}
    fills: list[tuple[object, int]] = []
    copies: list[tuple[int, int]] = []
    for i, (_, grammar) in enumerate(constrained):
        seen = first_row_of.setdefault(id(grammar), i)
        if seen == i:
            fills.append((grammar.matcher, i))
        else:
            copies.append((i, seen))
    row_bytes = words.shape[1] * 4
    if parallel:
        _executor().unsafe_compute_mask_ptr(fills, words.data_ptr(), row_bytes, words.shape[0])
    else:
        for matcher, i in fills:
            matcher.unsafe_compute_mask_ptr(words.data_ptr() + i * row_bytes, row_bytes)
    for i, seen in copies:
        words[i] = words[seen]
    return TokenBitmask([row for row, _ in constrained], words)
