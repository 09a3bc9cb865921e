"""Continuous-batching scheduler with chunked prefill, on-demand blocks and preemption by recompute.

Each ``schedule()`` builds one batch under two limits, ``max_num_batched_tokens`` (query tokens)
and ``max_num_seqs``:
1. decode steps (1 token) of running sequences, oldest arrival first;
2. the next prefill chunk of a running, partially prefilled sequence;
3. waiting sequences, first come first served, each taking a prefill chunk of the remaining budget.
A sequence's block table grows only to cover the tokens it will have computed after this step.

Invariants:
- ``running`` is sorted by arrival; every running sequence arrived before every waiting one, so
  the youngest running sequence is always the next preemption victim.
- A sequence's first ``num_computed_tokens`` tokens have K/V in its blocks; waiting sequences hold
  no blocks and have ``num_computed_tokens == 0``. An imported hand-off keeps its prompt KV on the CPU
  (``pending_kv``) while waiting; on admission its prompt counts as computed and the KV is handed to
  the engine to scatter in (and hash) before the batch runs (``ScheduledBatch.imports``).
- Prefix caching (when the block manager has it on): any other admission (new, or preempted and
  re-prefilling) claims the longest cached chain of full blocks of its known tokens *but the last*,
  and counts those blocks as computed. So at least one token is always computed and sampled from;
  when the known tokens end exactly on a block boundary and are all cached, the last block is not
  claimed and is recomputed into a fresh block (never rewritten in place: a shared block is
  read-only, and a recomputed K/V need not be bit-identical on GPU). Chunked prefill goes on from
  there. Blocks are shared only through such claims, whole and already computed; a sequence writes
  only past its ``num_computed_tokens``, into blocks it alone holds.
- At most one running sequence is partially prefilled and it is the youngest: a chunk that stops
  short of the prompt's end used up the budget or the free blocks, so nothing is admitted after it.
- A token is sampled only when a step computes the last known token (a partial chunk samples none).
- Preemption (recompute): when a running sequence cannot grow, the youngest running sequence not yet
  in this batch (possibly itself) loses its blocks, gets ``num_computed_tokens = 0`` and goes to the
  front of ``waiting``; its output tokens are kept and re-prefilled with the prompt.
- Admission waits (FCFS, no skipping) until the pool can hold all the head's known tokens (its
  cached prefix counts as held, a free cached block it claims as taken from the free list); a prompt
  larger than the whole pool is rejected by ``add``. Sequences are capped at
  ``min(max_model_len, num_blocks * block_size + 1)`` tokens, so a lone sequence always fits.
- Finished and preempted sequences give their blocks back to the block manager, where the full ones
  stay cached until evicted.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tandem.shared.engine.detokenizer import can_defer_text, check_stop
from tandem.shared.engine.sequence import Sequence, SequenceStatus
from tandem.shared.kvcache.block_manager import BlockManager


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_query_tokens: int  # tokens computed this step, from seq.num_computed_tokens on
    samples: bool  # this step computes the last known token, so a new token is sampled


@dataclass
class ScheduledBatch:
    items: list[ScheduledSequence] = field(default_factory=list)
    # Admitted hand-offs: scatter each CPU kv into seq.block_table before running the batch.
    # (sequence, K/V blocks to scatter, index of its first block they go to: blocks before it were cached)
    imports: list[tuple[Sequence, torch.Tensor, int]] = field(default_factory=list)
    num_batched_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.items)


def _arrival(seq: Sequence) -> int:
    return seq.arrival


class Scheduler:
    """Owns the waiting and running queues; the engine runs the batches it builds."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Seq[int] = (),
        on_finish: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seq_len = min(max_model_len, block_manager.num_blocks * self.block_size + 1)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_finish = on_finish  # called before a finished sequence's blocks are freed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by request id
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ``ValueError`` if its known tokens can never fit in the pool."""
        needed = self.block_manager.blocks_needed([], seq.num_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs {needed} KV blocks for {seq.num_tokens} tokens, "
                f"the pool has only {self.block_manager.num_blocks}"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        in_batch: set[Sequence] = set()
        for decode_pass in (True, False):
            for seq in list(self.running):
                if self._batch_full(batch):
                    break
                if seq.status is not SequenceStatus.RUNNING or seq in in_batch:
                    continue  # preempted earlier in this step, or already scheduled
                if (seq.num_uncomputed_tokens == 1) != decode_pass:
                    continue
                if not self._make_room(seq, in_batch):
                    continue  # seq itself was preempted
                coverable = (len(seq.block_table) + self.block_manager.num_free_blocks) * self.block_size
                coverable -= seq.num_computed_tokens
                self._add_to_batch(batch, seq, min(seq.num_uncomputed_tokens, coverable), in_batch)
        self._admit(batch, in_batch)
        return batch

    def admit(self, batch: ScheduledBatch) -> None:
        """Admit waiting sequences into ``batch``, first come first served, while they fit (as
        ``schedule`` does after placing the running ones)."""
        self._admit(batch, {item.seq for item in batch.items})

    def is_handoff_ready(self, seq: Sequence) -> bool:
        """A waiting hand-off whose imported K/V cover its whole prompt and whose one known output
        token is all that is left to compute: admitted, it is a one-token decode row."""
        if seq.pending_kv is None or seq.prefill_only:
            return False
        return seq.num_tokens - min(seq.pending_kv.shape[0] * self.block_size, seq.num_prompt_tokens) == 1

    def _admit(self, batch: ScheduledBatch, in_batch: set[Sequence]) -> None:
        while self.waiting and batch.num_batched_tokens < self.max_num_batched_tokens:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            if not self.block_manager.can_grow(seq.block_table, seq.num_tokens, claim=cached):
                break  # the head waits for blocks; later arrivals wait behind it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            if seq.pending_kv is not None:
                # A hand-off brings the whole prompt's K/V; a KV-store fetch its first full blocks.
                # Blocks this cache already holds are shared, not written again: only the rest is
                # scattered in (a common system prompt costs its blocks once per worker).
                imported = min(seq.pending_kv.shape[0] * self.block_size, seq.num_prompt_tokens)
                self._claim_prefix(seq, cached, count=False)
                seq.imported_blocks = seq.pending_kv.shape[0] - len(cached)
                self.block_manager.grow(seq.block_table, imported)
                seq.num_computed_tokens = imported
                batch.imports.append((seq, seq.pending_kv[len(cached):], len(cached)))
                seq.pending_kv = None
            elif self.block_manager.enable_caching:
                self._claim_prefix(seq, cached)
            self._add_to_batch(batch, seq, seq.num_uncomputed_tokens, in_batch)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks the waiting ``seq`` would claim: full blocks of its known tokens but the
        last (that token must be computed to have logits to sample from); for an import, cached
        full blocks among those it brings. Empty with caching off."""
        if not self.block_manager.enable_caching:
            return []
        if seq.pending_kv is not None:
            covered = min(seq.pending_kv.shape[0] * self.block_size, seq.num_prompt_tokens)
            return self.block_manager.find_cached_prefix(seq.token_ids[:covered])
        return self.block_manager.find_cached_prefix(seq.token_ids[:-1])

    def _claim_prefix(self, seq: Sequence, cached: list[int], count: bool = True) -> None:
        """Take ``cached`` as ``seq``'s first blocks, computed, and count the lookup (imports are
        not counted: their K/V arrive with them either way)."""
        bm = self.block_manager
        bm.claim(seq.block_table, cached)
        seq.prefix_cached_blocks = len(cached)
        seq.block_hashes = [bm.blocks[block_id].block_hash for block_id in cached]
        seq.num_computed_tokens = len(cached) * self.block_size
        if count:
            bm.record_prefix_query(seq.num_tokens, seq.num_computed_tokens)

    def _batch_full(self, batch: ScheduledBatch) -> bool:
        return batch.num_batched_tokens >= self.max_num_batched_tokens or len(batch.items) >= self.max_num_seqs

    def _add_to_batch(
        self, batch: ScheduledBatch, seq: Sequence, max_tokens: int, in_batch: set[Sequence]
    ) -> None:
        budget = self.max_num_batched_tokens - batch.num_batched_tokens
        num_tokens = min(max_tokens, budget)
        self.block_manager.grow(seq.block_table, seq.num_computed_tokens + num_tokens)
        samples = seq.num_computed_tokens + num_tokens == seq.num_tokens
        batch.items.append(ScheduledSequence(seq, num_tokens, samples))
        batch.num_batched_tokens += num_tokens
        in_batch.add(seq)

    def _make_room(self, seq: Sequence, in_batch: set[Sequence]) -> bool:
        """Preempt until ``seq`` can compute one more token; False if ``seq`` itself was preempted."""
        while not self.block_manager.can_grow(seq.block_table, seq.num_computed_tokens + 1):
            victim = next(s for s in reversed(self.running) if s not in in_batch)  # youngest; maybe seq
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and requeue it at the front of ``waiting`` to be recomputed."""
        self.block_manager.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.prefix_cached_blocks = seq.imported_blocks = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: Seq[int],
                    text_later: bool = False) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish what stopped.

        ``sampled_token_ids`` has one id per item with ``samples`` set, in batch order. Returns the
        sequences that got a token this step (finished ones included, with ``finish_reason`` set).
        ``text_later``: see :meth:`postprocess_item`.
        """
        sampled = iter(sampled_token_ids)
        return [item.seq for item in batch.items
                if self.postprocess_item(item, next(sampled) if item.samples else None, text_later)]

    def postprocess_item(self, item: ScheduledSequence, token_id: int | None, text_later: bool = False) -> bool:
        """``postprocess`` for one item, ``token_id`` its sampled id (None: it samples none); True
        when its sequence got the token. One item at a time, so the engine can end a sequence whose
        own postprocessing raised and go on with the others.

        A sequence that finished while the step was in flight is skipped (overlapped steps).
        ``text_later``: a sequence whose text may lag (``can_defer_text``) is checked on token ids
        only; the engine detokenizes it later (see ``LLMEngine.step``).
        """
        seq = item.seq
        if seq.status is SequenceStatus.FINISHED:
            # Ended (abort, error, or a stop in the step before) while this step was in flight: its
            # token is not part of it (see engine/overlap.py).
            return False
        seq.num_computed_tokens += item.num_query_tokens
        self.hash_computed(seq)
        if token_id is None:
            return False
        seq.token_ids.append(int(token_id))
        text_now = not (text_later and can_defer_text(seq))
        reason = check_stop(seq, self.eos_token_ids, self.max_seq_len, text=text_now)
        if reason is None and seq.prefill_only:
            reason = "prefilled"
        if reason is not None:
            self.finish(seq, reason)
        return True

    def hash_computed(self, seq: Sequence) -> None:
        """Hash (and so make cacheable) the blocks ``seq`` has fully computed since the last call.

        Called once their K/V are really in the cache: after the step that computed them, or after
        the engine scattered an import in.
        """
        if seq.num_computed_tokens // self.block_size > len(seq.block_hashes):
            computed = seq.token_ids[: seq.num_computed_tokens]
            self.block_manager.hash_full_blocks(seq.block_table, computed, seq.block_hashes)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and give its blocks back (after the ``on_finish`` hook)."""
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        try:
            if self.on_finish is not None:
                self.on_finish(seq)
        finally:  # a hook that raised (a KV export, say) must not keep the blocks from coming back
            self.block_manager.free(seq.block_table)
            self.requests.pop(seq.request_id, None)
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)

    def fail(self, seq: Sequence, error: str) -> None:
        """End ``seq`` alone with reason "error" because its own work in a step raised: its blocks
        go back as with an abort. A sequence already finished (its finish or the text after it
        raised) only takes the reason: its blocks are back already."""
        seq.error = error
        seq.pending_kv = None
        if seq.status is SequenceStatus.FINISHED:
            seq.finish_reason = "error"
        else:
            self.finish(seq, "error")

    def abort(self, request_id: str) -> Sequence | None:
        """Finish an unfinished request with reason "abort" at once; None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        seq.pending_kv = None
        self.finish(seq, "abort")
        return seq
