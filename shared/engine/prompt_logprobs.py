"""Prompt logprobs (``SamplingParams.prompt_logprobs = N``): for every prompt token but the first,
its log-probability given the tokens before it and the N most likely tokens at its position, raw
``log_softmax`` of the model's logits as ``logprobs`` are (see ``sampling``).

They come from the hidden rows a prefill computes anyway: the row of position ``j`` scores prompt
token ``j + 1``. A prompt may span several steps (chunked prefill), so each step keeps, per
sequence, only its chunk's small results (the prompt tokens' logprobs and each position's top N),
computed on the device a slice of ``ROWS_PER_SLICE`` rows at a time (never a whole chunk's
``[T, V]`` logits at once) and copied to the host without waiting; :class:`PromptLogprobs` gathers
them until the request's first output carries them.

Every position must be computed here, so a sequence that owes prompt logprobs claims no cached
prefix (the scheduler) and imports no prefix from a KV-store (the engine refuses one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.shared.kvtransfer.devcopy import host_values_to
from tandem.shared.protocol.serving import TokenLogprobs

if TYPE_CHECKING:
    from tandem.shared.engine.sequence import Sequence

ROWS_PER_SLICE = 1024  # hidden rows turned into logits at once: [1024, V] fp32 is 0.5 GB at V = 128k


@dataclass
class PromptLogprobsChunk:
    """One prefill chunk's results for one sequence: prompt tokens ``first .. first + len(chosen) - 1``.
    The tensors are host copies, readable once ``done`` (None: already) has been reached."""

    first: int  # prompt index of the token the first entry scores (>= 1)
    top_count: int  # the request's N
    chosen: torch.Tensor  # float32 [t]: each prompt token's logprob
    top_ids: torch.Tensor  # long [t, K], K >= top_count: most likely first
    top_values: torch.Tensor  # float32 [t, K]
    done: torch.cuda.Event | None = None

    def entries(self) -> list[TokenLogprobs]:
        if self.done is not None:
            self.done.synchronize()
        chosen, top_ids, top_values = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        n = self.top_count
        # model_construct: the values come from the model, not from a peer; no need to validate them.
        return [TokenLogprobs.model_construct(logprob=value, top=list(zip(ids[:n], values[:n])))
                for value, ids, values in zip(chosen, top_ids, top_values)]


@dataclass
class PromptLogprobs:
    """What a sequence has of its prompt logprobs so far, chunk by chunk, until one output takes
    them (sequences forked from it share this record, so only one does)."""

    chunks: list[PromptLogprobsChunk] = field(default_factory=list)
    taken: bool = False

    def add(self, chunk: PromptLogprobsChunk) -> None:
        """Keep ``chunk``; a prompt computed again from an earlier position (after a preemption)
        replaces what was kept from there on."""
        self.chunks = [c for c in self.chunks if c.first < chunk.first]
        self.chunks.append(chunk)

    def take(self, num_prompt_tokens: int) -> list[TokenLogprobs | None] | None:
        """:meth:`entries`, the first time; None after."""
        if self.taken:
            return None
        self.taken = True
        entries, self.chunks = self.entries(num_prompt_tokens), []
        return entries

    def entries(self, num_prompt_tokens: int) -> list[TokenLogprobs | None]:
        """One entry per prompt token, None for the first; ``RuntimeError`` when a position is missing."""
        entries: list[TokenLogprobs | None] = [None]
        for chunk in self.chunks:
            if chunk.first != len(entries):
                raise RuntimeError(f"prompt logprobs from token {len(entries)} are missing (next chunk starts at "
                                   f"{chunk.first})")
            entries += chunk.entries()
        if len(entries) != num_prompt_tokens:
            raise RuntimeError(f"prompt logprobs cover {len(entries)} of {num_prompt_tokens} prompt tokens")
        return entries


def owes_prompt_logprobs(seq: Sequence) -> bool:
    """Whether ``seq``'s prefill here must compute prompt logprobs (so must compute every position)."""
    return seq.prompt_logprobs is not None and not seq.prompt_logprobs.taken


def rows_scoring_prompt(seq: Sequence, num_query_tokens: int) -> int:
    """How many leading rows of ``seq``'s chunk of ``num_query_tokens`` (from position
    ``seq.num_computed_tokens`` on) score a prompt token: 0 unless ``seq`` owes prompt logprobs.
    Position ``j`` scores token ``j + 1``; the last prompt position scores the first output token."""
    if not owes_prompt_logprobs(seq):
        return 0
    return max(0, min(num_query_tokens, seq.num_prompt_tokens - 1 - seq.num_computed_tokens))


@dataclass
class PromptRows:
    """``count`` hidden rows of one batch, from ``first_row`` on, scoring ``seq``'s prompt tokens from
    ``seq.num_computed_tokens + 1`` on (the chunk starts at ``num_computed_tokens``)."""

    seq: Sequence
    first_row: int
    count: int


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    wanted: list[PromptRows],
    to_host: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Queue the prompt logprobs of ``wanted``'s rows of ``hidden`` (``[T, H]``, one batch's) and their
    copy to the host (``to_host``), and add each sequence's chunk to its ``prompt_logprobs``.

    ``compute_logits`` turns hidden rows into float32 logits; it runs on ``ROWS_PER_SLICE`` rows at
    a time. On CUDA nothing waits: each chunk records an event its reader waits for."""
    rows: list[int] = []
    targets: list[int] = []
    for want in wanted:
        start = want.seq.num_computed_tokens
        rows.extend(range(want.first_row, want.first_row + want.count))
        targets.extend(want.seq.token_ids[start + 1 : start + 1 + want.count])
    top = max(want.seq.params.prompt_logprobs for want in wanted)
    index = host_values_to(hidden.device, [rows, targets], torch.long)  # one copy for both
    chosen, top_ids, top_values = [], [], []
    for begin in range(0, len(rows), ROWS_PER_SLICE):
        part = index[:, begin : begin + ROWS_PER_SLICE]
        logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, part[0])), dim=-1)
        chosen.append(logprobs.gather(-1, part[1][:, None]).squeeze(-1))
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        top_values.append(values)
        top_ids.append(ids)
        del logprobs  # the next slice may reuse its memory
    host = [to_host(torch.cat(parts)) for parts in (chosen, top_ids, top_values)]
    done = None
    if hidden.device.type == "cuda":
        done = torch.cuda.Event()  # recorded after the copies: one wait covers all three
        done.record()
    offset = 0
    for want in wanted:
        span = slice(offset, offset + want.count)
        offset += want.count
        want.seq.prompt_logprobs.add(PromptLogprobsChunk(
            want.seq.num_computed_tokens + 1, want.seq.params.prompt_logprobs,
            host[0][span], host[1][span], host[2][span], done))
