"""Tests for tandem.shared.kvcache.block_manager: allocation order, ref counts, hashing, and the
prefix cache (reuse with exact block ids, LRU eviction, collisions, sharing, KV events)."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest
from factories import make_block_manager

from tandem.shared.kvcache import block_manager as bm_module
from tandem.shared.kvcache.block_manager import BlockManager, NoFreeBlocksError, hash_block


def assert_invariants(manager: BlockManager, tables: list[list[int]]) -> None:
    """Free iff ref 0; refs equal table references; a block has a hash iff it is the one registered
    under that hash, and then it is full; the cached count is the free hashed blocks."""
    free = list(manager.free_block_ids)
    assert len(free) == len(set(free)), f"duplicate ids on the free list: {free}"
    references = [0] * manager.num_blocks
    for table in tables:
        for block_id in table:
            references[block_id] += 1
    for block in manager.blocks:
        on_free_list = block.block_id in free
        assert on_free_list == (block.ref_count == 0), f"block {block} free-list membership is wrong"
        assert block.ref_count == references[block.block_id], f"block {block.block_id} ref count"
        assert (block.block_hash is None) == (block.token_ids is None)
        if block.block_hash is None:
            assert block.parent_hash is None, f"unhashed block {block.block_id} keeps a parent hash"
        else:
            assert len(block.token_ids) == manager.block_size, "only full blocks carry a hash"
            assert manager.hash_to_block.get(block.block_hash) == block.block_id, f"block {block} not registered"
    for block_hash, block_id in manager.hash_to_block.items():
        assert manager.blocks[block_id].block_hash == block_hash, "hash_to_block points at a stale block"
    cached = sum(1 for block_id in free if manager.blocks[block_id].block_hash is not None)
    assert manager.num_cached_blocks == cached, f"num_cached_blocks {manager.num_cached_blocks} != {cached}"


def test_grow_free_reuse_exact_ids() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    first, second = [], []
    manager.grow(first, 5)
    assert first == [0, 1]
    manager.grow(second, 4)
    assert second == [2], "exactly one full block needs one block"
    manager.grow(first, 9)
    assert first == [0, 1, 3], "growing appends in place from the left of the free list"
    manager.grow(first, 9)
    assert first == [0, 1, 3], "growing to a size already held allocates nothing"
    assert manager.num_free_blocks == 4
    assert_invariants(manager, [first, second])

    manager.free(first)
    assert first == [], "free clears the table in place"
    assert list(manager.free_block_ids) == [4, 5, 6, 7, 3, 1, 0], "freed in reverse, to the right"
    assert_invariants(manager, [second])

    third: list[int] = []
    manager.grow(third, 7 * 4)
    assert third == [4, 5, 6, 7, 3, 1, 0], "the tail block of a freed table is reused first"
    assert manager.num_free_blocks == 0
    assert manager.usage == 1.0
    assert_invariants(manager, [second, third])


def test_share_keeps_block_until_last_reference() -> None:
    manager = make_block_manager(num_blocks=4, block_size=2)
    owner: list[int] = []
    manager.grow(owner, 3)
    assert owner == [0, 1]
    manager.share(0)
    fork = [0]
    assert manager.blocks[0].ref_count == 2
    assert_invariants(manager, [owner, fork])

    manager.free(owner)
    assert manager.blocks[0].ref_count == 1, "a shared block survives one free"
    assert list(manager.free_block_ids) == [2, 3, 1]
    assert_invariants(manager, [fork])

    manager.free(fork)
    assert list(manager.free_block_ids) == [2, 3, 1, 0]
    assert_invariants(manager, [])


def test_share_and_double_free_are_rejected() -> None:
    manager = make_block_manager(num_blocks=2, block_size=2)
    with pytest.raises(ValueError):
        manager.share(1)
    table: list[int] = []
    manager.grow(table, 1)
    stale_copy = list(table)
    manager.free(table)
    with pytest.raises(ValueError):
        manager.free(stale_copy)


def test_no_free_blocks_is_all_or_nothing() -> None:
    manager = make_block_manager(num_blocks=3, block_size=4)
    first: list[int] = []
    manager.grow(first, 8)
    second: list[int] = []
    with pytest.raises(NoFreeBlocksError):
        manager.grow(second, 9)
    assert second == [], "a failed grow must not append anything"
    assert list(manager.free_block_ids) == [2], "a failed grow must not take blocks"
    manager.grow(second, 4)
    assert second == [2]
    assert_invariants(manager, [first, second])


@pytest.mark.parametrize(
    ("table_len", "num_tokens", "expected"),
    [(0, 0, 0), (0, 1, 1), (0, 4, 1), (0, 5, 2), (1, 4, 0), (1, 5, 1), (2, 8, 0), (2, 9, 1), (3, 2, 0)],
)
def test_blocks_needed(table_len: int, num_tokens: int, expected: int) -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    table: list[int] = []
    manager.grow(table, table_len * 4)
    assert manager.blocks_needed(table, num_tokens) == expected, (table_len, num_tokens)


@pytest.mark.parametrize(("num_tokens", "expected"), [(7, True), (8, True), (9, False), (12, False)])
def test_can_grow_at_block_boundaries(num_tokens: int, expected: bool) -> None:
    manager = make_block_manager(num_blocks=3, block_size=4)
    held: list[int] = []
    manager.grow(held, 4)  # two blocks left free
    table: list[int] = []
    assert manager.can_grow(table, num_tokens) is expected, f"{num_tokens} tokens with 2 free blocks"
    partly_full = [held.pop()]  # a table already holding one block needs one fewer
    assert manager.can_grow(partly_full, num_tokens + 4) is expected


def test_usage_tracks_allocation() -> None:
    manager = make_block_manager(num_blocks=4, block_size=4)
    assert manager.usage == 0.0
    table: list[int] = []
    manager.grow(table, 8)
    assert manager.usage == pytest.approx(0.5)
    manager.free(table)
    assert manager.usage == 0.0


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    manager = make_block_manager(num_blocks=32, block_size=4)
    tables: list[list[int]] = []
    for _ in range(500):
        action = rng.random()
        if action < 0.5:
            table = rng.choice(tables) if tables and rng.random() < 0.5 else []
            target = len(table) * 4 + rng.randint(0, 12)
            if manager.can_grow(table, target):
                manager.grow(table, target)
                if table and table not in tables:
                    tables.append(table)
            else:
                with pytest.raises(NoFreeBlocksError):
                    manager.grow(table, target)
        elif action < 0.7 and tables:
            source = rng.choice(tables)
            for block_id in source:
                manager.share(block_id)
            tables.append(list(source))
        elif tables:
            manager.free(tables.pop(rng.randrange(len(tables))))
        assert_invariants(manager, tables)


def test_hash_block_value_is_pinned() -> None:
    tokens = [1, 2, 3, 70000]
    expected_root = int.from_bytes(
        hashlib.blake2b(bytes(8) + struct.pack("<4i", *tokens), digest_size=8).digest(), "little"
    )
    assert hash_block(None, tokens) == expected_root
    parent = 0x0123456789ABCDEF
    expected_child = int.from_bytes(
        hashlib.blake2b(parent.to_bytes(8, "little") + struct.pack("<4i", *tokens), digest_size=8).digest(),
        "little",
    )
    assert hash_block(parent, tokens) == expected_child
    # A literal guards against a change of algorithm: other processes and machines must agree.
    assert hash_block(None, [0, 1, 2, 3]) == hash_block(None, (0, 1, 2, 3)) == 0x52263D4E44FF75FF


def test_hash_chain_depends_on_parent() -> None:
    tokens = [5, 6, 7, 8]
    root_a, root_b = hash_block(None, [1, 1, 1, 1]), hash_block(None, [2, 2, 2, 2])
    assert hash_block(root_a, tokens) != hash_block(root_b, tokens), "same tokens, different prefix"
    assert hash_block(root_a, tokens) == hash_block(root_a, list(tokens)), "deterministic"
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1]), "token order matters"
    assert 0 <= hash_block(None, tokens) < 2**64


def test_hash_full_blocks_is_incremental(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    table: list[int] = []
    tokens = list(range(100, 110))  # 10 tokens: two full blocks and a partial one
    manager.grow(table, len(tokens))
    hashes: list[int] = []
    manager.hash_full_blocks(table, tokens, hashes)
    h0 = hash_block(None, tokens[0:4])
    h1 = hash_block(h0, tokens[4:8])
    assert hashes == [h0, h1], "one chained hash per full block"
    assert manager.blocks[table[0]].block_hash == h0 and manager.blocks[table[1]].block_hash == h1
    assert manager.blocks[table[1]].token_ids == tuple(tokens[4:8])
    assert manager.blocks[table[2]].block_hash is None, "the partial block has no hash"
    assert manager.hash_to_block == {h0: table[0], h1: table[1]}

    calls: list[tuple] = []
    real_hash_block = bm_module.hash_block
    monkeypatch.setattr(bm_module, "hash_block", lambda p, t: calls.append((p, tuple(t))) or real_hash_block(p, t))
    tokens += [110, 111]
    manager.hash_full_blocks(table, tokens, hashes)
    assert calls == [(h1, (108, 109, 110, 111))], "only the newly full block is hashed"
    assert hashes[:2] == [h0, h1] and hashes[2] == real_hash_block(h1, tokens[8:12])
    manager.hash_full_blocks(table, tokens, hashes)
    assert len(calls) == 1 and len(hashes) == 3, "nothing new to hash"
    assert_invariants(manager, [table])


def test_hash_full_blocks_stops_at_table_end() -> None:
    manager = make_block_manager(num_blocks=4, block_size=2)
    table: list[int] = []
    manager.grow(table, 2)
    hashes: list[int] = []
    manager.hash_full_blocks(table, [1, 2, 3, 4], hashes)
    assert len(hashes) == 1, "blocks the table does not hold are not hashed"


def test_reallocation_drops_hash() -> None:
    manager = make_block_manager(num_blocks=4, block_size=4)
    table: list[int] = []
    tokens = list(range(8))
    manager.grow(table, 8)
    hashes: list[int] = []
    manager.hash_full_blocks(table, tokens, hashes)
    assert table == [0, 1]
    manager.free(table)
    assert manager.blocks[0].block_hash == hashes[0], "a freed block keeps its cached contents"
    assert manager.hash_to_block[hashes[1]] == 1
    assert_invariants(manager, [])

    other: list[int] = []
    manager.grow(other, 12)
    assert other == [2, 3, 1], "block 1 (the freed tail) is reused before block 0"
    assert manager.blocks[1].block_hash is None and manager.blocks[1].token_ids is None
    assert hashes[1] not in manager.hash_to_block, "a reused block's hash is forgotten"
    assert manager.hash_to_block == {hashes[0]: 0}, "the still-free block 0 stays findable"
    assert_invariants(manager, [other])


# ---------------------------------------------------------------- prefix cache


def cache_sequence(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and hash a table for ``tokens`` as a finished prefill would; returns the table."""
    table: list[int] = []
    manager.grow(table, len(tokens))
    manager.hash_full_blocks(table, tokens, [])
    return table


def test_cached_blocks_are_found_and_claimed_with_exact_ids() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    tokens = list(range(10, 20))  # two full blocks and a partial one
    table = cache_sequence(manager, tokens)
    assert table == [0, 1, 2]
    manager.free(table)
    assert list(manager.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert manager.num_cached_blocks == 2, "the two full blocks stay cached; the partial one is not"
    assert manager.find_cached_prefix(tokens) == [0, 1]
    assert manager.find_cached_prefix(tokens[:7]) == [0], "only full blocks of the query can match"
    assert manager.find_cached_prefix(tokens[:4] + [99, 15, 16, 17]) == [0], "the chain stops at a differing block"
    assert manager.find_cached_prefix([99] + tokens[1:]) == [], "a differing first block hides the rest"
    assert manager.find_cached_prefix(tokens[4:8]) == [], "block 1's tokens without its parent do not match"
    assert_invariants(manager, [])

    other: list[int] = []
    manager.claim(other, [0, 1])
    assert other == [0, 1] and manager.blocks[0].ref_count == manager.blocks[1].ref_count == 1
    assert list(manager.free_block_ids) == [3, 4, 5, 6, 7, 2], "claimed blocks leave the free list"
    assert manager.num_cached_blocks == 0
    manager.grow(other, 12)
    assert other == [0, 1, 3], "growth after a claim takes fresh blocks from the front"
    assert manager.find_cached_prefix(tokens) == [0, 1], "claimed blocks stay findable"
    assert_invariants(manager, [other])


@pytest.mark.parametrize(
    ("num_tokens", "claim", "expected"),
    [(12, (), True), (16, (), False), (16, (0,), True), (20, (0,), False), (16, (0, 1), True), (17, (0, 1), False)],
)
def test_can_grow_counts_claimed_free_blocks(num_tokens: int, claim: tuple[int, ...], expected: bool) -> None:
    manager = make_block_manager(num_blocks=4, block_size=4)
    held = cache_sequence(manager, list(range(8)))  # blocks 0, 1
    manager.free(held[1:])  # block 1 free but cached: free list [2, 3, 1]; block 0 still in use
    # Claiming block 0 (in use) saves a block; claiming block 1 too saves one more but takes it off
    # the free list: 17 tokens need 5 blocks = 2 claimed + 3 fresh, and only 2 fresh would be left.
    assert manager.can_grow([], num_tokens, claim=claim) is expected, f"{num_tokens} tokens claiming {claim}"


def test_lru_eviction_order() -> None:
    manager = make_block_manager(num_blocks=4, block_size=2)
    x, y, z = cache_sequence(manager, [1, 1]), cache_sequence(manager, [2, 2]), cache_sequence(manager, [3, 3])
    assert (x, y, z) == ([0], [1], [2])
    for table in (y, x, z):  # freed in this order: y is the least recently freed
        manager.free(table)
    assert list(manager.free_block_ids) == [3, 1, 0, 2] and manager.num_cached_blocks == 3
    fresh: list[int] = []
    manager.grow(fresh, 4)
    assert fresh == [3, 1], "the never-used block first, then the least recently freed cached one"
    assert manager.find_cached_prefix([2, 2]) == [], "y's block was evicted"
    assert manager.find_cached_prefix([1, 1]) == [0] and manager.find_cached_prefix([3, 3]) == [2]

    reused: list[int] = []
    manager.claim(reused, [0])  # x is reused: out of the middle of the free list
    assert list(manager.free_block_ids) == [2]
    manager.free(reused)
    assert list(manager.free_block_ids) == [2, 0], "a reused block is freed again as the most recent"
    manager.grow(fresh, 6)
    assert fresh == [3, 1, 2], "z (now the least recently freed) is evicted before x"
    assert manager.find_cached_prefix([3, 3]) == [] and manager.find_cached_prefix([1, 1]) == [0]
    assert_invariants(manager, [fresh])


def test_equal_hash_with_other_tokens_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)  # every block collides
    manager = make_block_manager(num_blocks=4, block_size=2)
    manager.free(cache_sequence(manager, [1, 2]))
    assert manager.hash_to_block == {42: 0}
    assert manager.find_cached_prefix([7, 8]) == [], "same hash, other tokens: never reused"
    assert manager.find_cached_prefix([1, 2]) == [0]

    held = cache_sequence(manager, [7, 8])  # fills with hash 42, which block 0 already holds
    assert held == [1] and manager.blocks[1].block_hash is None, "a colliding block stays unregistered"
    assert manager.hash_to_block == {42: 0}
    assert_invariants(manager, [held])


def test_equal_hash_and_tokens_under_another_parent_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    real_hash_block = bm_module.hash_block
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: real_hash_block(None, tokens))  # parent ignored
    manager = make_block_manager(num_blocks=4, block_size=2)
    manager.free(cache_sequence(manager, [1, 1]))  # block 0: root block [1, 1]
    manager.free(cache_sequence(manager, [2, 2]))  # block 1: root block [2, 2]
    assert manager.find_cached_prefix([1, 1, 2, 2]) == [0], "block 1 matches hash and tokens but not the parent"


def test_shared_block_is_freed_to_the_cache_only_by_its_last_holder() -> None:
    manager = make_block_manager(num_blocks=4, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    first = cache_sequence(manager, tokens)
    assert first == [0, 1, 2]
    second: list[int] = []
    manager.claim(second, manager.find_cached_prefix(tokens))
    assert second == [0, 1] and [manager.blocks[b].ref_count for b in (0, 1, 2)] == [2, 2, 1]
    assert list(manager.free_block_ids) == [3], "claiming blocks in use takes nothing from the free list"
    assert_invariants(manager, [first, second])

    manager.free(first)
    assert [manager.blocks[b].ref_count for b in (0, 1, 2)] == [1, 1, 0]
    assert list(manager.free_block_ids) == [3, 2] and manager.num_cached_blocks == 0
    assert_invariants(manager, [second])
    manager.free(second)
    assert list(manager.free_block_ids) == [3, 2, 1, 0] and manager.num_cached_blocks == 2
    assert_invariants(manager, [])


def test_events_are_reported_once_and_net() -> None:
    manager = make_block_manager(num_blocks=3, block_size=2)
    assert manager.drain_events() == ([], [])
    table = cache_sequence(manager, [1, 2, 3, 4, 5])
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    assert manager.drain_events() == ([h0, h1], []), "one stored event per newly registered block"
    assert manager.drain_events() == ([], []), "events are handed out once"
    manager.free(table)  # freeing keeps blocks cached: no event
    assert manager.drain_events() == ([], [])

    fresh: list[int] = []
    manager.grow(fresh, 4)  # takes block 2 (never hashed), then block 1 (h1, evicted)
    assert fresh == [2, 1] and manager.drain_events() == ([], [h1])
    manager.hash_full_blocks(fresh, [3, 3, 9, 9], [])  # stored, then evicted before any drain
    manager.free(fresh)
    manager.grow(fresh, 6)
    assert manager.drain_events() == ([], [h0]), "a hash stored and removed between drains is not reported"
    manager.free(fresh)
    again = cache_sequence(manager, [1, 2])
    assert again == [2] and manager.drain_events() == ([h0], []), "a hash stored again is reported again"
    manager.free(again)
    manager.grow(fresh, 6)  # takes 1, 0, then 2, evicting h0 ...
    manager.hash_full_blocks(fresh, [1, 2], [])  # ... and stores it again, in block 1
    assert fresh == [1, 0, 2] and manager.hash_to_block == {h0: 1}
    assert manager.drain_events() == ([], []), "a hash removed and stored again between drains is not reported"
    assert_invariants(manager, [fresh])


def test_reset_prefix_cache_only_when_idle() -> None:
    manager = make_block_manager(num_blocks=3, block_size=2)
    table = cache_sequence(manager, [1, 2, 3, 4])
    manager.drain_events()
    assert manager.reset_prefix_cache() is False and len(manager.hash_to_block) == 2, "blocks in use: nothing done"
    manager.free(table)
    assert manager.reset_prefix_cache() is True
    assert manager.hash_to_block == {} and manager.num_cached_blocks == 0
    assert sorted(manager.drain_events()[1]) == sorted([hash_block(None, [1, 2]),
                                                        hash_block(hash_block(None, [1, 2]), [3, 4])])
    assert list(manager.free_block_ids) == [2, 1, 0], "the free list order is kept"
    assert_invariants(manager, [])


def test_caching_disabled_registers_nothing() -> None:
    manager = make_block_manager(num_blocks=3, block_size=2, caching=False)
    table: list[int] = []
    manager.grow(table, 4)
    hashes: list[int] = []
    manager.hash_full_blocks(table, [1, 2, 3, 4], hashes)
    assert hashes == [hash_block(None, [1, 2]), hash_block(hashes[0], [3, 4])], "sequences still get hashes"
    assert manager.hash_to_block == {} and all(b.block_hash is None for b in manager.blocks)
    manager.free(table)
    assert manager.find_cached_prefix([1, 2, 3, 4]) == [] and manager.num_cached_blocks == 0
    assert manager.drain_events() == ([], [])
    with pytest.raises(ValueError, match="no cached prefix"):
        manager.claim([], [0])
    assert_invariants(manager, [])


def test_random_prefix_sharing_keeps_kv_contents_right() -> None:
    """Random sequences over a 2-token alphabet (lots of shared prefixes) admitted through
    find/claim, grown and freed in a tiny pool. A simulated cache records, per (block, slot), the
    token prefix whose K/V was written there: every computed position must hold its own prefix,
    writes must only hit blocks with one holder and no hash, and the drained events must track
    ``hash_to_block`` exactly."""
    rng = random.Random(1)
    bs = 2
    manager = make_block_manager(num_blocks=12, block_size=bs)
    kv: dict[tuple[int, int], tuple[int, ...]] = {}
    seqs: list[tuple[list[int], list[int], list[int]]] = []  # (table, tokens, hashes), all tokens computed
    published: set[int] = set()

    def compute(table: list[int], tokens: list[int], start: int) -> None:
        for pos in range(start, len(tokens)):
            block = manager.blocks[table[pos // bs]]
            assert block.ref_count == 1 and block.block_hash is None, f"write into shared/cached block {block}"
            kv[(block.block_id, pos % bs)] = tuple(tokens[: pos + 1])

    for _ in range(1500):
        action = rng.random()
        if action < 0.4:
            tokens = [rng.randrange(2) for _ in range(rng.randint(1, 9))]
            cached = manager.find_cached_prefix(tokens[:-1])
            if not manager.can_grow([], len(tokens), claim=cached):
                continue
            table: list[int] = []
            manager.claim(table, cached)
            manager.grow(table, len(tokens))
            compute(table, tokens, len(cached) * bs)
            hashes = [manager.blocks[b].block_hash for b in cached]
            manager.hash_full_blocks(table, tokens, hashes)
            seqs.append((table, tokens, hashes))
        elif action < 0.7 and seqs:
            table, tokens, hashes = rng.choice(seqs)
            extra = [rng.randrange(2) for _ in range(rng.randint(1, 3))]
            if manager.can_grow(table, len(tokens) + len(extra)):
                manager.grow(table, len(tokens) + len(extra))
                tokens += extra
                compute(table, tokens, len(tokens) - len(extra))
                manager.hash_full_blocks(table, tokens, hashes)
        elif seqs:
            manager.free(seqs.pop(rng.randrange(len(seqs)))[0])
        for table, tokens, _ in seqs:
            for pos in range(len(tokens)):
                assert kv[(table[pos // bs], pos % bs)] == tuple(tokens[: pos + 1]), f"stale K/V at {pos}"
        assert_invariants(manager, [t for t, _, _ in seqs])
        stored, removed = manager.drain_events()
        assert not set(stored) & set(removed) and not set(stored) & published and set(removed) <= published
        published = (published - set(removed)) | set(stored)
        assert published == set(manager.hash_to_block), "events out of step with the cache"
    assert manager.num_cached_blocks > 0
