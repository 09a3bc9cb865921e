"""Tests for tandem.shared.kvcache.block_manager: allocation order, ref counts, hashing."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from tandem.shared.kvcache import block_manager as bm_module
from tandem.shared.kvcache.block_manager import BlockManager, NoFreeBlocksError, hash_block


def assert_invariants(manager: BlockManager, tables: list[list[int]]) -> None:
    """Free iff ref 0; refs equal table references; hashes only where recorded in a full block."""
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
        if block.token_ids is not None:
            assert len(block.token_ids) == manager.block_size, "only full blocks carry a hash"
    for block_hash, block_id in manager.hash_to_block.items():
        assert manager.blocks[block_id].block_hash == block_hash, "hash_to_block points at a stale block"


def test_grow_free_reuse_exact_ids() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
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
    manager = BlockManager(num_blocks=4, block_size=2)
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
    manager = BlockManager(num_blocks=2, block_size=2)
    with pytest.raises(ValueError):
        manager.share(1)
    table: list[int] = []
    manager.grow(table, 1)
    stale_copy = list(table)
    manager.free(table)
    with pytest.raises(ValueError):
        manager.free(stale_copy)


def test_no_free_blocks_is_all_or_nothing() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
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
    manager = BlockManager(num_blocks=8, block_size=4)
    table: list[int] = []
    manager.grow(table, table_len * 4)
    assert manager.blocks_needed(table, num_tokens) == expected, (table_len, num_tokens)


@pytest.mark.parametrize(("num_tokens", "expected"), [(7, True), (8, True), (9, False), (12, False)])
def test_can_grow_at_block_boundaries(num_tokens: int, expected: bool) -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    held: list[int] = []
    manager.grow(held, 4)  # two blocks left free
    table: list[int] = []
    assert manager.can_grow(table, num_tokens) is expected, f"{num_tokens} tokens with 2 free blocks"
    partly_full = [held.pop()]  # a table already holding one block needs one fewer
    assert manager.can_grow(partly_full, num_tokens + 4) is expected


def test_usage_tracks_allocation() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    assert manager.usage == 0.0
    table: list[int] = []
    manager.grow(table, 8)
    assert manager.usage == pytest.approx(0.5)
    manager.free(table)
    assert manager.usage == 0.0


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    manager = BlockManager(num_blocks=32, block_size=4)
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
    manager = BlockManager(num_blocks=8, block_size=4)
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
    manager = BlockManager(num_blocks=4, block_size=2)
    table: list[int] = []
    manager.grow(table, 2)
    hashes: list[int] = []
    manager.hash_full_blocks(table, [1, 2, 3, 4], hashes)
    assert len(hashes) == 1, "blocks the table does not hold are not hashed"


def test_reallocation_drops_hash() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
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
