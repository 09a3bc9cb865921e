"""The router's KV index and placement policy, without a bus: exact overlaps, clears, replays."""

from __future__ import annotations

import pytest

from tandem.services.router.kv_index import KVIndex
from tandem.services.router.policy import prefill_locally, rank
from tandem.shared.kvcache.block_manager import BlockManager
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.kv import KVEvent

NS = "tiny/float32/L4xH4xD32/bs16"


def event(source: str, seq: int, stored=(), removed=(), cleared=False, namespace=NS) -> KVEvent:
    return KVEvent(source=source, service="decode", namespace=namespace, seq=seq, stored=list(stored),
                   removed=list(removed), cleared=cleared)


@pytest.fixture
def index() -> KVIndex:
    idx = KVIndex()
    idx.apply(event("a", 0, stored=[1, 2, 3, 4]))
    idx.apply(event("b", 0, stored=[1, 2, 9]))
    return idx


@pytest.mark.parametrize("hashes,expected", [
    ([1, 2, 3, 4, 5], {"a": 4, "b": 2}),
    ([1, 2, 9], {"a": 2, "b": 3}),
    ([2, 3], {"a": 2, "b": 1}),
    ([9, 3], {"b": 1}),  # only the run from the first block counts: a holds 3 but not 9
    ([7, 1], {}),
    ([], {}),
])
def test_prefix_overlap_counts_leading_blocks(index, hashes, expected):
    assert index.prefix_overlap(NS, hashes) == expected


def test_removed_blocks_break_the_run(index):
    index.apply(event("a", 1, removed=[2]))
    assert index.prefix_overlap(NS, [1, 2, 3]) == {"a": 1, "b": 2}


def test_replayed_events_change_nothing(index):
    before = {k: set(v) for k, v in index.holders.items()}
    index.apply(event("a", 0, stored=[1, 2, 3, 4]))  # the stream replays what was applied live
    assert index.holders == before and index.gaps == 0


def test_clear_and_forget_drop_a_source_everywhere(index):
    index.apply(event("a", 0, stored=[5], cleared=True))  # a restarted worker starts with a clear
    assert index.prefix_overlap(NS, [1, 2, 3]) == {"b": 2}
    assert index.prefix_overlap(NS, [5]) == {"a": 1}
    index.forget("b")
    assert index.prefix_overlap(NS, [1]) == {} and (NS, 1) not in index.holders


def test_namespaces_do_not_mix(index):
    index.apply(event("c", 0, stored=[1, 2], namespace="other"))
    assert index.prefix_overlap("other", [1, 2]) == {"c": 2}
    assert "c" not in index.prefix_overlap(NS, [1, 2])


def test_a_store_holds_several_namespaces(index):
    index.apply(event("store", 0, stored=[1, 2], namespace="other"))
    index.apply(event("store", 1, stored=[1], namespace=NS))
    assert index.prefix_overlap("other", [1, 2]) == {"store": 2}
    assert index.prefix_overlap(NS, [1])["store"] == 1
    assert index.num_blocks("store") == 3
    index.apply(event("store", 0, cleared=True))
    assert index.num_blocks("store") == 0 and index.prefix_overlap("other", [1]) == {}


def test_sequence_gap_is_counted(index):
    index.apply(event("a", 5, stored=[6]))
    assert index.gaps == 1 and index.prefix_overlap(NS, [6]) == {"a": 1}


@pytest.mark.parametrize("workers,load_weight,choice", [
    ([("w1", 0, 0, 10), ("w2", 8, 0, 10)], 1.0, "w2"),  # cached prefix wins at equal load
    ([("w1", 0, 0, 10), ("w2", 8, 9, 10)], 1.0, "w1"),  # unless its queue costs more than the recompute
    ([("w1", 0, 0, 10), ("w2", 8, 9, 10)], 0.5, "w2"),
    ([("w1", 2, 1, 5), ("w2", 2, 1, 50)], 1.0, "w2"),  # tie: more free blocks
])
def test_rank_picks_cheapest(workers, load_weight, choice):
    ranked = rank(10, workers, load_weight)
    assert ranked[0].instance_id == choice, [(c.instance_id, c.cost) for c in ranked]


@pytest.mark.parametrize("prompt,cached,limit,local", [(100, 90, 16, True), (100, 80, 16, False), (10, 0, 0, False),
                                                        (10, 10, 0, True)])
def test_prefill_locally_threshold(prompt, cached, limit, local):
    assert prefill_locally(prompt, cached, limit) is local


@pytest.mark.parametrize("length", [0, 15, 16, 17, 48])
def test_prefix_hashes_name_blocks_as_the_block_manager_does(length):
    tokens = list(range(100, 100 + length))
    manager = BlockManager(8, 16)
    table: list[int] = []
    manager.grow(table, length)
    hashes: list[int] = []
    manager.hash_full_blocks(table, tokens, hashes)
    assert prefix_hashes(tokens, 16) == hashes
