"""Continuous-batching scheduler with chunked prefill, on-demand blocks and preemption by recompute or swap.

Each ``schedule()`` builds one batch (a ``ScheduledBatch``, ``scheduler_output.py``: what the model
runner gets) under two limits, ``max_num_batched_tokens`` (query tokens) and ``max_num_seqs``:
1. decode steps (1 token) of running sequences, oldest arrival first;
2. the next prefill chunk of a running, partially prefilled sequence;
3. swapped and waiting sequences, first come first served by arrival (so a swapped sequence resumes
   before any later arrival is admitted), each taking a prefill chunk of the remaining budget.
A sequence's block table grows only to cover the tokens it will have computed after this step.

Preemption policy. When a running sequence cannot grow, the youngest running sequence not yet in
this batch (possibly itself) is preempted, in one of two ways:
- recompute: its blocks go back to the pool (the full ones stay cached) and it re-prefills its
  tokens when it is admitted again;
- swap (``swap_space_gib`` > 0, see ``swapping.py``): its private blocks are copied to host memory,
  its cached blocks go back to the pool to be claimed again by hash, its shared blocks stay on the
  device with its reference kept; it resumes where it stopped, with no token recomputed.
Per victim (``preemption_mode`` "auto"), whichever costs less (``preemption_cost.py``): recompute
costs a prefill of its computed tokens the prefix cache does not keep (about 2 x decoder weights
FLOPs per token plus attention, at the device's rate), swap the copy of its private blocks out and
back (2 x their bytes at the host link's rate); so a short sequence recomputes and a long one
swaps. Only when the swap space has room for its private blocks, else it recomputes. "swap"
swaps whenever there is room, "recompute" never swaps. A beam search's sequences always recompute
(the search forks beams between steps, from block tables a swap would have emptied). The swaps a
preemption or a resumption decides travel in the next batch the scheduler returns that has items
(``ScheduledBatch.swap_out`` / ``swap_in``); the engine queues them before anything of that batch.

Invariants:
- ``running``, ``swapped`` and ``waiting`` are each sorted by arrival; every running sequence
  arrived before every swapped or waiting one, so the youngest running sequence is always the next
  preemption victim, and the older of the ``swapped`` and ``waiting`` heads is the next to resume.
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
- Preemption by recompute: the victim loses its blocks, gets ``num_computed_tokens = 0`` and goes
  to the front of ``waiting``; its output tokens are kept and re-prefilled with the prompt.
- Preemption by swap: the victim goes to the front of ``swapped`` with an empty block table and its
  ``num_computed_tokens`` kept. A swapped sequence holds host blocks and keeps references only to
  shared device blocks (``Swapper.tables``). It resumes (swap-in) when the pool can hold all its
  known tokens; if a cached block it gave back was evicted meanwhile, it is recomputed instead (to
  ``waiting``, host blocks and references dropped). When nothing runs and the next to resume does
  not fit, a swapped sequence holding shared device blocks is recomputed instead, so that blocks
  held only by swapped sequences can never keep the pool from draining.
- Admission waits (FCFS, no skipping) until the pool can hold all the head's known tokens (its
  cached prefix counts as held, a free cached block it claims as taken from the free list); a prompt
  larger than the whole pool is rejected by ``add``. Sequences are capped at
  ``min(max_model_len, num_blocks * block_size + 1)`` tokens, so a lone sequence always fits.
- Finished and preempted sequences give their blocks back to the block manager, where the full ones
  stay cached until evicted; a finished (aborted) swapped sequence gives its host blocks back too.
- LoRA adapters (``adapters``, an ``AdapterCache``): a sequence holds its adapter's device slot while it
  runs (the slot is pinned) and gives it back when it ends or is preempted; the waiting head whose
  adapter has no slot, every slot pinned by running sequences of other adapters, waits like one
  waiting for blocks. A queued sequence keeps its adapter's weights in host memory.
- Several outputs of one request (``fork``): a forked sequence shares every block of its parent,
  the partly filled last one too, and the same arrival (so the group is preempted youngest-first
  together). Before a step writes into a block other tables share, the writer takes a private copy
  (copy on write, ``ScheduledBatch.copies``; the K/V copy is the engine's, before the forward); room
  for that copy counts like a new block. A running beam whose step has run waits, with nothing left
  to compute, until its group picks the next beams: ``schedule`` passes over it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

from tandem.shared.engine.detokenizer import can_defer_text, check_stop
from tandem.shared.engine.pooling import pools_every_position
from tandem.shared.engine.prompt_logprobs import owes_prompt_logprobs
from tandem.shared.engine.scheduler_output import ScheduledBatch, ScheduledSequence
from tandem.shared.engine.sequence import Sequence, SequenceStatus
from tandem.shared.engine.swapping import Swapper
from tandem.shared.kvcache.block_manager import BlockManager
from tandem.shared.lora.cache import AdapterCache


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
        swapper: Swapper | None = None,
        preemption_mode: str = "auto",
        swap_is_cheaper: Callable[[int, int, int], bool] | None = None,
        adapters: AdapterCache | None = None,
    ) -> None:
        """``swapper``: preempt by swap too (None: by recompute only). ``preemption_mode``: "auto",
        "swap" or "recompute" (module docstring). ``swap_is_cheaper(recompute_tokens, cached_tokens,
        copy_blocks)``: the cost rule of "auto" (``PreemptionCosts.swap_is_cheaper``; None: swap)."""
        if preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {preemption_mode!r}")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seq_len = min(max_model_len, block_manager.num_blocks * self.block_size + 1)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_finish = on_finish  # called before a finished sequence's blocks are freed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by ``Sequence.key``
        self.swapped: deque[Sequence] = deque()
        self.swapper = swapper
        self.preemption_mode = preemption_mode
        self.swap_is_cheaper = swap_is_cheaper
        self.adapters = adapters  # None: no LoRA (the engine refuses requests that name an adapter)
        self.num_preemptions = 0  # by either way
        self.num_swaps = 0  # preemptions by swap
        self.num_recomputes = 0  # preemptions by recompute
        self.num_swap_fallbacks = 0  # swapped sequences recomputed after all (a cached block evicted)
        # Swaps decided since the last batch with items: they travel with the next one.
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ``ValueError`` if its known tokens can never fit in the pool."""
        needed = self.block_manager.blocks_needed([], seq.num_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs {needed} KV blocks for {seq.num_tokens} tokens, "
                f"the pool has only {self.block_manager.num_blocks}"
            )
        if seq.adapter is not None:
            self.adapters.hold(seq.adapter)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.key] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        in_batch: set[Sequence] = set()
        for decode_pass in (True, False):
            for seq in list(self.running):
                if self._batch_full(batch):
                    break
                if seq.status is not SequenceStatus.RUNNING or seq in in_batch or not seq.num_uncomputed_tokens:
                    continue  # preempted earlier in this step, already scheduled, or a beam waiting for its group
                if (seq.num_uncomputed_tokens == 1) != decode_pass:
                    continue
                if not self._make_room(seq, in_batch):
                    continue  # seq itself was preempted
                free = self.block_manager.num_free_blocks
                free -= self.block_manager.needs_copy(seq.block_table, seq.num_computed_tokens)
                coverable = (len(seq.block_table) + free) * self.block_size - seq.num_computed_tokens
                self._add_to_batch(batch, seq, min(seq.num_uncomputed_tokens, coverable), in_batch)
        self._admit(batch, in_batch)
        if batch:  # an empty batch runs nothing that could touch the blocks: its swaps wait for the next
            batch.swap_out, self._swap_out = self._swap_out, []
            batch.swap_in, self._swap_in = self._swap_in, []
        return batch

    def admit(self, batch: ScheduledBatch) -> None:
        """Admit waiting sequences into ``batch``, first come first served, while they fit (as
        ``schedule`` does after placing the running ones). None while a sequence is swapped: it
        resumes first, and its swap-in is ``schedule``'s to hand to the engine."""
        if self.swapped:
            return
        self._admit(batch, {item.seq for item in batch.items})

    def is_handoff_ready(self, seq: Sequence) -> bool:
        """A waiting hand-off whose imported K/V cover its whole prompt and whose one known output
        token is all that is left to compute: admitted, it is a one-token decode row."""
        if seq.pending_kv is None or seq.prefill_only or not seq.can_overlap:
            return False
        return seq.num_tokens - self._importable_tokens(seq) == 1

    def _importable_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting import whose K/V it brings and that count as computed: all it covers,
        but at least the last known token is computed here (there must be logits to sample from; a
        group's prompt handed off without a sampled token recomputes its last prompt token)."""
        return min(seq.pending_kv.shape[0] * self.block_size, seq.num_tokens - 1)

    def _admit(self, batch: ScheduledBatch, in_batch: set[Sequence]) -> None:
        while (self.waiting or self.swapped) and batch.num_batched_tokens < self.max_num_batched_tokens:
            if len(self.running) >= self.max_num_seqs:
                break
            if self._swapped_goes_next():
                if not self._resume_swapped(batch, in_batch) and not self._release_swapped_blocks(self.swapped[0]):
                    break  # the head waits for blocks; later arrivals wait behind it
                continue
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                break  # the head waits for an adapter slot; later arrivals wait behind it
            cached = self._cached_prefix(seq)
            if not self.block_manager.can_grow(seq.block_table, seq.num_tokens, claim=cached):
                if self._release_swapped_blocks(seq):
                    continue
                break  # the head waits for blocks; later arrivals wait behind it
            self.waiting.popleft()
            self._take_adapter_slot(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            if seq.pending_kv is not None:
                # A hand-off brings the whole prompt's K/V; a KV-store fetch its first full blocks.
                # Blocks this cache already holds are shared, not written again: only the rest is
                # scattered in (a common system prompt costs its blocks once per worker).
                imported = self._importable_tokens(seq)
                used_blocks = -(-imported // self.block_size)
                self._claim_prefix(seq, cached, count=False)
                seq.imported_blocks = used_blocks - len(cached)
                self.block_manager.grow(seq.block_table, imported)
                seq.num_computed_tokens = imported
                batch.imports.append((seq, seq.pending_kv[len(cached):used_blocks], len(cached)))
                seq.pending_kv = None
            elif self.block_manager.enable_caching:
                self._claim_prefix(seq, cached)
            self._add_to_batch(batch, seq, seq.num_uncomputed_tokens, in_batch)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks the waiting ``seq`` would claim: full blocks of its known tokens but the
        last (that token must be computed to have logits to sample from); for an import, cached
        full blocks among those it brings. Empty with caching off, for a sequence owing prompt
        logprobs (every prompt position must be computed to score the token after it) and for a
        mean-pooled embedding (every position's hidden row goes into its vector)."""
        if not self.block_manager.enable_caching or owes_prompt_logprobs(seq) or pools_every_position(seq):
            return []
        if seq.pending_kv is not None:
            return self.block_manager.find_cached_prefix(seq.token_ids[: self._importable_tokens(seq)], seq.hash_root)
        return self.block_manager.find_cached_prefix(seq.token_ids[:-1], seq.hash_root)

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

    def _adapter_fits(self, seq: Sequence) -> bool:
        return seq.adapter is None or self.adapters.can_acquire(seq.adapter)

    def _take_adapter_slot(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            seq.lora_slot = self.adapters.acquire(seq.adapter)

    def _give_adapter_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1

    def _batch_full(self, batch: ScheduledBatch) -> bool:
        return batch.num_batched_tokens >= self.max_num_batched_tokens or len(batch.items) >= self.max_num_seqs

    def _add_to_batch(
        self, batch: ScheduledBatch, seq: Sequence, max_tokens: int, in_batch: set[Sequence]
    ) -> None:
        budget = self.max_num_batched_tokens - batch.num_batched_tokens
        num_tokens = min(max_tokens, budget)
        copy = self.block_manager.copy_on_write(seq.block_table, seq.num_computed_tokens)
        if copy is not None:
            batch.copies.append(copy)
        self.block_manager.grow(seq.block_table, seq.num_computed_tokens + num_tokens)
        samples = seq.num_computed_tokens + num_tokens == seq.num_tokens
        batch.items.append(ScheduledSequence(seq, num_tokens, samples))
        batch.num_batched_tokens += num_tokens
        in_batch.add(seq)

    def _make_room(self, seq: Sequence, in_batch: set[Sequence]) -> bool:
        """Preempt until ``seq`` can compute one more token; False if ``seq`` itself was preempted."""
        while not self.block_manager.can_write(seq.block_table, seq.num_computed_tokens, seq.num_computed_tokens + 1):
            victim = next(s for s in reversed(self.running) if s not in in_batch)  # youngest; maybe seq
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def fork(self, parent: Sequence, sample_index: int) -> Sequence:
        """A running copy of ``parent`` under ``sample_index`` that shares its blocks (ref +1 each;
        the first write into a shared block copies it, see ``copy_on_write``); it joins ``running``
        beside its parent. The caller sets what differs (its params, detokenizer, tokens to come)."""
        if parent.status is not SequenceStatus.RUNNING:
            raise ValueError(f"only a running sequence forks, not a {parent.status.value} one ({parent.key!r})")
        child = dataclasses.replace(
            parent, token_ids=list(parent.token_ids), sample_index=sample_index,
            block_table=self.block_manager.fork(parent.block_table), block_hashes=list(parent.block_hashes),
            held_logprobs=list(parent.held_logprobs), beam_candidates=None, fan_out=1,
            grammar=None if parent.grammar is None else parent.grammar.fork())
        if child.key in self.requests:
            raise ValueError(f"sequence {child.key!r} already exists")
        if child.adapter is not None:
            self.adapters.hold(child.adapter)
            child.lora_slot = self.adapters.acquire(child.adapter)  # in its parent's slot: one more pin
        bisect.insort(self.running, child, key=_arrival)
        self.requests[child.key] = child
        return child

    def preempt(self, seq: Sequence) -> None:
        """Take the running ``seq`` out to make room: swap it out to the front of ``swapped``, or
        free its blocks and requeue it at the front of ``waiting`` to be recomputed, as the
        preemption policy says (module docstring)."""
        self.running.remove(seq)
        self.num_preemptions += 1
        self._give_adapter_slot(seq)
        if self._swaps(seq):
            self._swap_out += self.swapper.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.num_swaps += 1
        else:
            self.block_manager.free(seq.block_table)
            self._forget_computed(seq)
            self.waiting.appendleft(seq)
            self.num_recomputes += 1

    def _swaps(self, seq: Sequence) -> bool:
        """Whether preempting ``seq`` swaps it out rather than recomputing it."""
        if self.swapper is None or self.preemption_mode == "recompute":
            return False
        if seq.group is not None and seq.group.is_beam_search:
            return False  # the search forks beams between steps: each needs its block table
        copy_blocks = len(self.swapper.private_blocks(seq))
        if not self.swapper.swap_space.can_allocate(copy_blocks):
            return False
        if self.preemption_mode == "swap" or self.swap_is_cheaper is None:
            return True
        # A re-prefill claims the blocks the prefix cache holds (its hashed ones) and computes the rest.
        cached = len(seq.block_hashes) * self.block_size if self.block_manager.enable_caching else 0
        cached = min(cached, seq.num_computed_tokens)
        return self.swap_is_cheaper(seq.num_computed_tokens - cached, cached, copy_blocks)

    def _forget_computed(self, seq: Sequence) -> None:
        """Make a preempted ``seq``, its blocks gone, a waiting sequence that recomputes everything."""
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.prefix_cached_blocks = seq.imported_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.beam_candidates = None  # a beam's search waits until its recompute has them again

    def _swapped_goes_next(self) -> bool:
        """Whether the oldest swapped sequence is next to resume: it arrived no later than the
        waiting head (forked samples share their arrival)."""
        return bool(self.swapped) and (not self.waiting or self.swapped[0].arrival <= self.waiting[0].arrival)

    def _resume_swapped(self, batch: ScheduledBatch, in_batch: set[Sequence]) -> bool:
        """Swap the oldest swapped sequence back in and add it to ``batch``; False when the pool
        cannot hold it yet. One whose cached blocks were evicted meanwhile goes to the front of
        ``waiting`` to be recomputed instead (True: admission goes on, with it next)."""
        seq = self.swapped[0]
        reclaimed = self.swapper.reclaimable(seq)
        if reclaimed is None:
            self.swapped.popleft()
            self.swapper.drop(seq)
            self._forget_computed(seq)
            self.waiting.appendleft(seq)
            self.num_swap_fallbacks += 1
            return True
        if not self.swapper.can_swap_in(seq, reclaimed) or not self._adapter_fits(seq):
            return False
        self.swapped.popleft()
        self._take_adapter_slot(seq)
        self._swap_in += self.swapper.swap_in(seq, reclaimed)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_arrival)
        self._add_to_batch(batch, seq, seq.num_uncomputed_tokens, in_batch)
        return True

    def _release_swapped_blocks(self, head: Sequence) -> bool:
        """With nothing running, the next to resume (``head``) that does not fit may be waiting for
        device blocks only swapped sequences hold (shared ones they kept): recompute the youngest
        other swapped sequence holding any instead, so they come free. False when none does, or
        something runs (it will give blocks back)."""
        if self.running or self.swapper is None:
            return False
        for seq in reversed(self.swapped):
            if seq is not head and self.swapper.tables[seq].shared:
                self.swapped.remove(seq)
                self.swapper.drop(seq)
                self._forget_computed(seq)
                bisect.insort(self.waiting, seq, key=_arrival)
                self.num_swap_fallbacks += 1
                return True
        return False

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
        if not self.advance(item) or token_id is None:
            return False
        self.append_token(seq, token_id, text_later)
        return True

    def advance(self, item: ScheduledSequence) -> bool:
        """Count the item's query tokens as computed and hash the blocks they filled; False (doing
        nothing) when its sequence ended while the step was in flight (abort, error, or a stop in
        the step before: its token is not part of it, see engine/overlap.py)."""
        seq = item.seq
        if seq.status is SequenceStatus.FINISHED:
            return False
        seq.num_computed_tokens += item.num_query_tokens
        self.hash_computed(seq)
        return True

    def append_token(self, seq: Sequence, token_id: int, text_later: bool = False) -> None:
        """Append a sampled token to ``seq`` and finish it if that ends it (``text_later``: see
        :meth:`postprocess_item`)."""
        seq.token_ids.append(int(token_id))
        if seq.grammar is not None:
            seq.grammar.accept(int(token_id))  # a refused token raises: this row alone fails
        text_now = not (text_later and can_defer_text(seq))
        reason = check_stop(seq, self.eos_token_ids, self.max_seq_len, text=text_now)
        if reason is None and seq.prefill_only:
            reason = "prefilled"
        if reason is not None:
            self.finish(seq, reason)

    def hash_computed(self, seq: Sequence) -> None:
        """Hash (and so make cacheable) the blocks ``seq`` has fully computed since the last call.

        Called once their K/V are really in the cache: after the step that computed them, or after
        the engine scattered an import in.
        """
        if seq.num_computed_tokens // self.block_size > len(seq.block_hashes):
            computed = seq.token_ids[: seq.num_computed_tokens]
            self.block_manager.hash_full_blocks(seq.block_table, computed, seq.block_hashes, seq.hash_root)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and give its blocks back (after the ``on_finish`` hook)."""
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        try:
            if self.on_finish is not None:
                self.on_finish(seq)
        finally:  # a hook that raised (a KV export, say) must not keep the blocks from coming back
            self.block_manager.free(seq.block_table)
            self._give_adapter_slot(seq)
            if seq.adapter is not None and seq.key in self.requests:
                self.adapters.unhold(seq.adapter)
            self.requests.pop(seq.key, None)
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            elif seq in self.swapped:
                self.swapped.remove(seq)
                self.swapper.drop(seq)

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

    def abort(self, key: str) -> Sequence | None:
        """Finish an unfinished sequence (by ``Sequence.key``) with reason "abort" at once; None if unknown."""
        seq = self.requests.get(key)
        if seq is None:
            return None
        seq.pending_kv = None
        self.finish(seq, "abort")
        return seq
