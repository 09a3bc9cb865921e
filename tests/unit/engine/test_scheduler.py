"""Scheduler unit tests with a fake runner (no model): exact batches, chunked prefill across steps,
block ids, preemption order and recompute, admission queueing, and a pool fully free at the end."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from factories import make_scheduler, make_sequence

from tandem.shared.engine.scheduler import Scheduler
from tandem.shared.engine.sequence import SequenceStatus


def fake_token(context: list[int]) -> int:
    """A deterministic function of the whole context, so recompute must reproduce it exactly."""
    return (sum(context) * 7 + len(context)) % 101


def fake_run(scheduler: Scheduler, batch) -> list[int]:
    """A model stand-in over a simulated KV cache: each computed position's (block, slot) records the
    token prefix it was computed from, and a sampled token is a function of the prefixes read back
    through the block table, so a cached block holding the wrong prefix changes the output."""
    kv: dict[tuple[int, int], tuple[int, ...]] = scheduler.__dict__.setdefault("fake_kv", {})
    bm, bs = scheduler.block_manager, scheduler.block_size
    sampled = []
    for seq, _, first in batch.imports:  # the engine scatters the prompt's K/V in, then hashes it
        for pos in range(first * bs, seq.num_computed_tokens):  # blocks before ``first`` were cached
            kv[(seq.block_table[pos // bs], pos % bs)] = tuple(seq.token_ids[: pos + 1])
        scheduler.hash_computed(seq)
    for item in batch.items:
        seq, start = item.seq, item.seq.num_computed_tokens
        for pos in range(start, start + item.num_query_tokens):
            block = bm.blocks[seq.block_table[pos // bs]]
            assert block.ref_count == 1 and block.block_hash is None, f"{seq.request_id} writes into shared {block}"
            kv[(block.block_id, pos % bs)] = tuple(seq.token_ids[: pos + 1])
        if item.samples:
            context = [kv[(seq.block_table[p // bs], p % bs)] for p in range(seq.num_tokens)]
            assert context == [tuple(seq.token_ids[: p + 1]) for p in range(seq.num_tokens)], "wrong K/V read"
            sampled.append(fake_token(seq.token_ids))
    return sampled


def step(scheduler: Scheduler) -> list[tuple[str, int, bool]]:
    """One schedule + fake run + postprocess; returns the batch as (id, query tokens, samples)."""
    batch = scheduler.schedule()
    described = [(item.seq.request_id, item.num_query_tokens, item.samples) for item in batch.items]
    check_invariants(scheduler)
    sampled = fake_run(scheduler, batch)
    scheduler.postprocess(batch, sampled)
    check_invariants(scheduler)
    return described


def check_invariants(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    arrivals = [s.arrival for s in scheduler.running]
    assert arrivals == sorted(arrivals), f"running not sorted by arrival: {arrivals}"
    if scheduler.running and scheduler.waiting:
        assert max(arrivals) < min(s.arrival for s in scheduler.waiting), "a waiting seq is older than a running one"
    holders = Counter(b for s in scheduler.running for b in s.block_table)
    for block_id, count in holders.items():
        assert bm.blocks[block_id].ref_count == count, f"block {block_id}: ref count != tables holding it"
    assert len(holders) + bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    for seq in scheduler.waiting:
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq.request_id} waits with blocks"
    for seq in scheduler.running:
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        assert len(seq.block_hashes) == seq.num_computed_tokens // bm.block_size, "full blocks not hashed"
        for block_id in seq.block_table[seq.num_computed_tokens // bm.block_size :]:  # still to be written
            assert holders[block_id] == 1 and bm.blocks[block_id].block_hash is None, f"{seq.request_id}: shared tail"


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished():
        step(scheduler)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_long_prompt_is_prefilled_in_chunks_then_decodes() -> None:
    scheduler = make_scheduler(num_blocks=8, budget=6)
    seq = make_sequence("a", prompt_len=10, arrival=0, max_tokens=3)
    scheduler.add(seq)
    assert step(scheduler) == [("a", 6, False)]
    assert seq.block_table == [0, 1] and seq.num_computed_tokens == 6 and seq.num_output_tokens == 0
    assert step(scheduler) == [("a", 4, True)]
    assert seq.block_table == [0, 1, 2] and seq.num_output_tokens == 1
    assert step(scheduler) == [("a", 1, True)]
    assert step(scheduler) == [("a", 1, True)]
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
    assert seq.num_output_tokens == 3 and seq.block_table == []
    assert scheduler.block_manager.num_free_blocks == 8


def test_decodes_go_first_and_prefill_chunks_fill_the_budget() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=6)
    scheduler.add(make_sequence("a", 3, arrival=0, max_tokens=10))
    scheduler.add(make_sequence("b", 9, arrival=1, max_tokens=10))
    scheduler.add(make_sequence("c", 2, arrival=2, max_tokens=10))
    assert step(scheduler) == [("a", 3, True), ("b", 3, False)]
    assert step(scheduler) == [("a", 1, True), ("b", 5, False)]
    assert step(scheduler) == [("a", 1, True), ("b", 1, True), ("c", 2, True)]
    assert step(scheduler) == [("a", 1, True), ("b", 1, True), ("c", 1, True)]


def test_chunk_may_end_past_a_block_boundary_and_blocks_grow_on_demand() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=5)
    seq = make_sequence("a", 13, arrival=0)
    scheduler.add(seq)
    tables = []
    for _ in range(3):
        step(scheduler)
        tables.append(list(seq.block_table))
    assert tables == [[0, 1], [0, 1, 2], [0, 1, 2, 3]], "table must cover exactly the computed tokens"


def test_max_num_seqs_limits_running_set() -> None:
    scheduler = make_scheduler(num_blocks=32, budget=100, max_seqs=2)
    for i in range(3):
        scheduler.add(make_sequence(f"s{i}", 4, arrival=i, max_tokens=2))
    assert step(scheduler) == [("s0", 4, True), ("s1", 4, True)]
    assert [s.request_id for s in scheduler.waiting] == ["s2"]
    assert step(scheduler) == [("s0", 1, True), ("s1", 1, True)]
    assert step(scheduler) == [("s2", 4, True)], "s2 is admitted once a slot frees"


def test_admission_waits_for_blocks() -> None:
    scheduler = make_scheduler(num_blocks=4, budget=100)
    scheduler.add(make_sequence("a", 8, arrival=0, max_tokens=2))  # 2 blocks, grows to 3 at token 9
    scheduler.add(make_sequence("b", 8, arrival=1, max_tokens=2))  # needs 2 of the 2 left
    scheduler.add(make_sequence("c", 1, arrival=2, max_tokens=2))  # fits, but waits behind b (FCFS)
    assert step(scheduler) == [("a", 8, True), ("b", 8, True)]
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    assert scheduler.block_manager.num_free_blocks == 0
    assert step(scheduler)[0] == ("a", 1, True)  # a grows: b is preempted (youngest)
    assert scheduler.num_preemptions == 1
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == 4


@pytest.mark.parametrize(("caching", "recomputed"), [(False, 9), (True, 5)], ids=["no-cache", "cache"])
def test_preemption_frees_youngest_and_recompute_keeps_outputs(caching: bool, recomputed: int) -> None:
    scheduler = make_scheduler(num_blocks=4, budget=100, caching=caching)
    a, b = make_sequence("a", 4, arrival=0, max_tokens=8), make_sequence("b", 4, arrival=1, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler) == [("a", 4, True), ("b", 4, True)]
    assert (a.block_table, b.block_table) == ([0], [1])
    step(scheduler)  # both grow to a second block
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3])
    for _ in range(3):
        assert step(scheduler) == [("a", 1, True), ("b", 1, True)]
    assert a.num_computed_tokens == 8 and a.num_tokens == 9
    b_tokens = list(b.token_ids)
    # a needs a third block: b (the youngest) is preempted, its blocks return, a takes one.
    assert step(scheduler) == [("a", 1, True)]
    assert scheduler.num_preemptions == 1 and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.token_ids == b_tokens
    assert a.block_table == [0, 2, 3]
    # b re-prefills prompt + its 5 outputs as one chunk once it fits, and samples its 6th token.
    # With the cache, its first block (block 1, freed last, so evicted last) is still cached: only
    # the other 5 tokens are recomputed (block 3, its second block, went to a).
    while b.status is SequenceStatus.WAITING:
        batch = step(scheduler)
    assert batch[-1] == ("b", recomputed, True) and b.num_output_tokens == 6
    if caching:
        assert b.block_table[0] == 1, "b must have claimed its own cached first block"
    bm = scheduler.block_manager
    assert (bm.prefix_queries, bm.prefix_hits) == ((4 + 4 + 9, 4) if caching else (0, 0))
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == 4


def test_preempting_itself_when_it_is_the_youngest() -> None:
    scheduler = make_scheduler(num_blocks=3, budget=100)
    a, b = make_sequence("a", 4, arrival=0, max_tokens=8), make_sequence("b", 4, arrival=1, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    step(scheduler)  # a takes the last block; b cannot grow and is the youngest: it preempts itself
    assert b.status is SequenceStatus.WAITING and a.block_table == [0, 2]
    run_to_completion(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_prompt_larger_than_pool_is_rejected() -> None:
    scheduler = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        scheduler.add(make_sequence("big", 9, arrival=0))
    scheduler.add(make_sequence("fits", 8, arrival=1, max_tokens=100))
    run_to_completion(scheduler)  # a lone sequence is capped by the pool instead of deadlocking


def test_lone_sequence_finishes_with_length_when_the_pool_is_full() -> None:
    scheduler = make_scheduler(num_blocks=2)
    seq = make_sequence("a", 5, arrival=0, max_tokens=100)
    scheduler.add(seq)
    run_to_completion(scheduler)
    assert seq.finish_reason == "length" and seq.num_tokens == 2 * 4 + 1


def test_imported_sequence_waits_then_scatters_and_decodes() -> None:
    scheduler = make_scheduler(num_blocks=3, budget=100)
    scheduler.add(make_sequence("a", 8, arrival=0, max_tokens=3))
    seq = make_sequence("imp", 6, arrival=1, max_tokens=3)
    seq.token_ids.append(5)  # first token sampled by the prefill worker
    kv = torch.zeros(2, 1)
    seq.pending_kv = kv
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert [i.seq.request_id for i in batch.items] == ["a"] and not batch.imports, "imp must wait"
    scheduler.postprocess(batch, fake_run(scheduler, batch))
    while scheduler.running:
        step(scheduler)
    batch = scheduler.schedule()
    ((imported, blocks, first),) = batch.imports
    assert imported is seq and torch.equal(blocks, kv) and first == 0 and seq.pending_kv is None
    assert [(i.seq.request_id, i.num_query_tokens, i.samples) for i in batch.items] == [("imp", 1, True)]
    assert seq.num_computed_tokens == 6 and len(seq.block_table) == 2
    scheduler.postprocess(batch, fake_run(scheduler, batch))
    assert seq.output_token_ids == [5, fake_token(seq.token_ids[:7])]
    assert len(seq.block_hashes) == 1, "the imported full block is hashed once it is scattered in"


def test_import_shares_blocks_this_cache_already_holds() -> None:
    scheduler = make_scheduler(num_blocks=8, budget=100)
    shared = list(range(10, 18))  # two blocks of 4
    scheduler.add(make_sequence("a", 0, arrival=0, max_tokens=1, prompt=shared + [1, 2]))
    run_to_completion(scheduler)
    cached = scheduler.block_manager.find_cached_prefix(shared)
    assert len(cached) == 2, "a's two full prompt blocks stay cached"
    seq = make_sequence("imp", 0, arrival=1, max_tokens=3, prompt=shared + [7, 7, 7])
    seq.token_ids.append(5)  # the token the prefill worker sampled
    seq.pending_kv = torch.arange(3.0).view(3, 1)  # K/V of all three prompt blocks
    queries = scheduler.block_manager.prefix_queries
    scheduler.add(seq)
    batch = scheduler.schedule()
    ((imported, blocks, first),) = batch.imports
    assert seq.block_table[:2] == cached, "the cached blocks are shared, not copied"
    assert first == 2 and blocks.tolist() == [[2.0]], "only the uncached third block is scattered"
    assert scheduler.block_manager.prefix_queries == queries, "an import is not a prefix-cache query"
    scheduler.postprocess(batch, fake_run(scheduler, batch))
    run_to_completion(scheduler)
    assert seq.output_token_ids[0] == 5 and len(seq.output_token_ids) == 3


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add(make_sequence("a", 6, arrival=0))
    scheduler.add(make_sequence("w", 6, arrival=1))
    step(scheduler)
    seq = scheduler.abort("a")
    assert seq is not None and seq.finish_reason == "abort" and seq.status is SequenceStatus.FINISHED
    assert scheduler.abort("a") is None and scheduler.abort("nope") is None
    assert scheduler.abort("w") is not None
    assert scheduler.block_manager.num_free_blocks == 4 and not scheduler.has_unfinished()


@pytest.mark.parametrize("shared", [False, True], ids=["distinct", "shared-prefixes"])
@pytest.mark.parametrize("num_blocks,budget,max_seqs", [(6, 7, 4), (9, 5, 3), (40, 64, 16), (12, 1, 8)])
def test_random_workload_matches_unconstrained_run(num_blocks: int, budget: int, max_seqs: int, shared: bool) -> None:
    """Tiny pools and budgets (chunking, preemption, cache hits and evictions) give the same tokens
    as a roomy scheduler without the cache; the fake runner checks every K/V read."""
    rng = random.Random(num_blocks * 1000 + budget)
    base = [rng.randrange(97) for _ in range(20)]
    prompt_lens = [rng.randint(1, 20) for _ in range(12)]
    # Keep every sequence within the pool's cap (num_blocks * block_size + 1 tokens).
    specs = [(p, min(rng.randint(1, 12), num_blocks * 4 + 1 - p)) for p in prompt_lens]

    def run(scheduler: Scheduler) -> dict[str, list[int]]:
        seqs = [make_sequence(f"r{i}", p, arrival=i, max_tokens=m, prompt=base[: p - 1] + [i] if shared else None)
                for i, (p, m) in enumerate(specs)]
        for seq in seqs:
            scheduler.add(seq)
        run_to_completion(scheduler)
        bm = scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        assert all(s.num_output_tokens == m for s, (_, m) in zip(seqs, specs))
        return {s.request_id: s.output_token_ids for s in seqs}

    constrained = make_scheduler(num_blocks, budget=budget, max_seqs=max_seqs)
    assert run(constrained) == run(make_scheduler(200, budget=1000, max_seqs=64, caching=False))
    if num_blocks <= 9:
        assert constrained.num_preemptions > 0, "the small pool should have forced preemption"
    if shared:
        assert constrained.block_manager.prefix_hits > 0, "shared prefixes should hit the cache"


# ---------------------------------------------------------------- prefix caching

PROMPT = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]  # two full blocks of 4 and a partial one


@pytest.mark.parametrize(
    ("prompt", "computed", "table", "hits"),
    [
        (PROMPT[:8] + [90, 91, 92], 3, [0, 1, 3], 8),  # shares both full blocks
        (PROMPT, 2, [0, 1, 3], 8),  # the same prompt: its partial block is recomputed
        (PROMPT[:6] + [90], 3, [0, 3], 4),  # shares a prefix ending mid-block: only whole blocks count
        (PROMPT[:8], 4, [0, 3], 4),  # fully cached, ends on a block boundary: the last block is recomputed
        ([90, 90, 90, 90, 90], 5, [3, 4], 0),  # nothing in common
    ],
    ids=["whole-blocks", "same-prompt", "mid-block", "exact-multiple", "miss"],
)
def test_admission_claims_the_cached_prefix(prompt: list[int], computed: int, table: list[int], hits: int) -> None:
    scheduler = make_scheduler(num_blocks=16, budget=100)
    scheduler.add(make_sequence("a", 0, arrival=0, max_tokens=1, prompt=PROMPT))
    assert step(scheduler) == [("a", 10, True)]
    bm = scheduler.block_manager
    assert list(bm.free_block_ids)[-3:] == [2, 1, 0] and bm.num_cached_blocks == 2, "a's full blocks stay cached"
    b = make_sequence("b", 0, arrival=1, max_tokens=2, prompt=prompt)
    scheduler.add(b)
    assert step(scheduler) == [("b", computed, True)], "only the uncached tokens are computed"
    assert b.block_table == table, f"expected {table}, got {b.block_table}"
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + len(prompt), hits)
    run_to_completion(scheduler)
    assert bm.num_free_blocks == 16 and all(block.ref_count == 0 for block in bm.blocks)


def test_cache_disabled_computes_everything() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=100, caching=False)
    for i in range(2):
        scheduler.add(make_sequence(f"s{i}", 0, arrival=i, max_tokens=1, prompt=PROMPT))
        assert step(scheduler) == [(f"s{i}", 10, True)]
    bm = scheduler.block_manager
    assert (bm.prefix_queries, bm.prefix_hits, bm.num_cached_blocks) == (0, 0, 0)
    assert bm.drain_events() == ([], [])


def test_running_sequences_share_blocks() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=100)
    a = make_sequence("a", 0, arrival=0, max_tokens=6, prompt=PROMPT[:8])
    scheduler.add(a)
    assert step(scheduler) == [("a", 8, True)] and a.block_table == [0, 1]
    b = make_sequence("b", 0, arrival=1, max_tokens=6, prompt=PROMPT[:8] + [40, 41])
    scheduler.add(b)
    assert step(scheduler) == [("a", 1, True), ("b", 2, True)]
    bm = scheduler.block_manager
    assert (a.block_table, b.block_table) == ([0, 1, 2], [0, 1, 3])
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1], "blocks 0 and 1 are held by both"
    scheduler.abort("a")
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 0, 1] and bm.num_free_blocks == 13
    run_to_completion(scheduler)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3, "blocks 0, 1 and b's full block 3"


def test_chunked_prefill_continues_after_the_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=5)
    scheduler.add(make_sequence("a", 0, arrival=0, max_tokens=1, prompt=PROMPT[:8]))
    assert [step(scheduler), step(scheduler)] == [[("a", 5, False)], [("a", 3, True)]]
    b = make_sequence("b", 0, arrival=1, max_tokens=1, prompt=PROMPT[:8] + list(range(50, 57)))
    scheduler.add(b)
    assert [step(scheduler), step(scheduler)] == [[("b", 5, False)], [("b", 2, True)]], "15 - 8 cached = 7 to compute"
    assert scheduler.block_manager.prefix_hits == 8


@pytest.mark.parametrize(("caching", "second_step"),
                         [(False, [("a", 1, True)]), (True, [("a", 1, True), ("b", 4, True)])])
def test_a_cached_prefix_in_use_lets_the_head_in_sooner(caching: bool, second_step: list) -> None:
    """b needs 3 blocks for 12 tokens with 1 free; 2 of them are a's blocks, which it can share."""
    scheduler = make_scheduler(num_blocks=4, budget=100, caching=caching)
    scheduler.add(make_sequence("a", 0, arrival=0, max_tokens=6, prompt=PROMPT[:8]))
    assert step(scheduler) == [("a", 8, True)]
    scheduler.add(make_sequence("b", 0, arrival=1, max_tokens=1, prompt=PROMPT[:8] + [7, 7, 7, 7]))
    assert step(scheduler) == second_step
    run_to_completion(scheduler)
