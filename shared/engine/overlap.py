"""Overlapped decode: queue step N+1 on the device before the host has step N's tokens.

Without it, between two decode steps the device idles while the host waits for step N's ids,
appends them, checks stops, schedules and fills the next inputs (about 10 µs per sequence). With it
(``EngineConfig.overlap_steps``, on by default with CUDA graphs) the engine, right after queueing
step N, queues step N+1 for the same sequences with each row's input token taken from step N's
sampled ids *on the device*, then waits for step N and postprocesses it while N+1 runs.

When it applies (``plan_ahead``): step N was a pure decode batch (one token per row, every row
samples, no prefill-only rows, every sequence one that goes on alone: ``Sequence.can_overlap``);
every running sequence was in step N; no row writes into a block shared with another sequence (a
forked sample's first write copies it, which the scheduler arranges); the pool has a block for
every row that crosses into a new one; and whatever waits is a hand-off whose prompt K/V came with
it, which joins step N+1 as one more decode row (the common case on a decode worker: a new request
every few steps). A sequence that will surely finish at step N (its ``max_tokens`` or the length
cap) gets no row. Otherwise (a prompt to prefill, a sequence to preempt, a swapped sequence to
resume, whose swap-in copies the scheduler hands the engine with a batch) the engine waits for step
N and the scheduler decides with every token known.

Why it is exact: a sequence that step N finishes by a stop token, stop string or eos still got a
row in N+1; that row's token is dropped (postprocess skips finished sequences) and its K/V went to a
position in a block that is not hashed (its tokens are not all computed), so the block is returned
as plain free, and a later owner's writes are queued after N+1's on the same stream. A sequence's
sampled token depends only on its logits, seed and output index (see ``sampling``), so the batch it
is sampled in does not matter. Outputs arrive one ``step()`` call later than without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.engine.model_runner import PendingStep, SampledTokens
from tandem.shared.engine.scheduler import Scheduler
from tandem.shared.engine.scheduler_output import ScheduledBatch, ScheduledSequence
from tandem.shared.engine.sequence import Sequence, SequenceStatus


@dataclass
class InFlightStep:
    """A queued step whose tokens the host has not seen: row ``i`` of ``tokens`` is item ``i``'s.
    ``tokens`` is None while its sampling waits for the step before's tokens (constrained rows)."""

    batch: ScheduledBatch
    tokens: SampledTokens | None
    pending: PendingStep


def is_pure_decode(batch: ScheduledBatch) -> bool:
    """Every row computes one token and samples (a hand-off admitted with its prompt's K/V is such
    a row: the K/V were scattered in before the step was queued), and none starts a hand-off."""
    return all(item.num_query_tokens == 1 and item.samples and not item.seq.prefill_only and item.seq.can_overlap
               for item in batch.items)


def finishes_next(seq: Sequence, max_seq_len: int) -> bool:
    """The token being sampled for ``seq`` surely ends it (its count or the length cap)."""
    return seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= max_seq_len


def plan_ahead(scheduler: Scheduler, step: ScheduledBatch) -> tuple[ScheduledBatch, list[int]] | None:
    """The step after the in-flight pure decode ``step``, or None when the scheduler must decide it
    once ``step``'s tokens are known (see the module docstring).

    Its first rows continue sequences of ``step`` (their block tables grown to cover the token in
    flight); the returned list gives each one's row in ``step``, whose sampled id it computes. Then
    come waiting hand-offs admitted as ordinary one-token decode rows (every waiting sequence is one,
    checked first), their imported K/V listed in ``batch.imports``."""
    if scheduler.swapped or not all(scheduler.is_handoff_ready(seq) for seq in scheduler.waiting):
        return None
    live = [(row, item.seq) for row, item in enumerate(step.items) if item.seq.status is SequenceStatus.RUNNING]
    if len(live) != len(scheduler.running):
        return None  # a running sequence outside this step: the scheduler places it
    chosen = [(row, seq) for row, seq in live if not finishes_next(seq, scheduler.max_seq_len)]
    manager = scheduler.block_manager
    if any(manager.needs_copy(seq.block_table, seq.num_tokens) for _, seq in chosen):
        return None  # a forked sample's first write into a shared block: the scheduler copies it first
    # The step computes the token at index seq.num_tokens: its table must cover num_tokens + 1.
    needed = sum(manager.blocks_needed(seq.block_table, seq.num_tokens + 1) for _, seq in chosen)
    if needed > manager.num_free_blocks:
        return None
    for _, seq in chosen:
        manager.grow(seq.block_table, seq.num_tokens + 1)
    batch = ahead_batch([seq for _, seq in chosen])
    scheduler.admit(batch)
    if not batch.items:
        return None
    return batch, [row for row, _ in chosen]


def ahead_batch(seqs: list[Sequence]) -> ScheduledBatch:
    """The batch record of the continuing rows of a step queued ahead (one sampled token each)."""
    return ScheduledBatch(items=[ScheduledSequence(seq, 1, True) for seq in seqs], num_batched_tokens=len(seqs))
