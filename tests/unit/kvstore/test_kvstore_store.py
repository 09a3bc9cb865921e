"""KVBlockStore without NATS: exact LRU order per tier, demotion and promotion, byte bounds,
restart from the disk tier, corrupt files, namespace isolation, events.

    python -m pytest -q tests/unit/kvstore/test_kvstore_store.py
"""

from __future__ import annotations

import os
import random

import pytest

from tandem.services.kvstore.store import HEADER_BYTES, KVBlockStore, namespace_digest

NS = "tiny/float32/L2-H2-D8-B16"
B = 1024  # block bytes in most tests
FILE = B + HEADER_BYTES


def block(h: int, size: int = B) -> bytes:
    return random.Random(h).randbytes(size)


def ram_keys(store: KVBlockStore) -> list[int]:
    return [h for _, h in store._ram]


def disk_keys(store: KVBlockStore) -> list[int]:
    return [h for _, h in store._disk]


def make(tmp_path, ram_blocks: int, disk_blocks: int) -> KVBlockStore:
    return KVBlockStore(ram_blocks * B, disk_blocks * FILE, tmp_path / "kv")


def test_ram_lru_exact_order_and_demotion(tmp_path):
    store = make(tmp_path, ram_blocks=3, disk_blocks=2)
    for h in (1, 2, 3):
        assert store.put(NS, h, block(h))
    assert store.get(NS, [1]) == [block(1)]  # 1 becomes most recent
    assert ram_keys(store) == [2, 3, 1]
    store.put(NS, 4, block(4))  # evicts 2 -> disk
    assert ram_keys(store) == [3, 1, 4] and disk_keys(store) == [2]
    store.put(NS, 5, block(5))  # evicts 3 -> disk
    store.put(NS, 6, block(6))  # evicts 1 -> disk, which drops 2 (disk LRU)
    assert ram_keys(store) == [4, 5, 6] and disk_keys(store) == [3, 1]
    assert store.get(NS, [2]) == [None]
    assert not (tmp_path / "kv" / namespace_digest(NS) / f"{2:016x}.blk").exists()
    s = store.stats()
    assert (s["ram_blocks"], s["disk_blocks"], s["evictions_ram"], s["evictions_disk"], s["misses"]) == (3, 2, 3, 1, 1)
    assert store.drain_events() == {NS: ([1, 3, 4, 5, 6], [2])}  # demotion is no removal


def test_disk_hit_is_promoted_and_copy_stays(tmp_path):
    store = make(tmp_path, ram_blocks=2, disk_blocks=4)
    for h in (1, 2, 3, 4):
        store.put(NS, h, block(h))
    assert ram_keys(store) == [3, 4] and disk_keys(store) == [1, 2]
    assert store.get(NS, [1, 4]) == [block(1), block(4)]
    assert ram_keys(store) == [1, 4]  # 1 promoted, 3 demoted
    assert disk_keys(store) == [2, 1, 3]  # 1's file stays (touched), then 3 written
    s = store.stats()
    assert (s["hits_disk"], s["hits_ram"]) == (1, 1)
    store.put(NS, 5, block(5))  # evicts 1 from RAM: already on disk, no write
    assert disk_keys(store) == [2, 1, 3] and ram_keys(store) == [4, 5]


@pytest.mark.parametrize("ram_blocks,disk_blocks", [(0, 5), (1, 0), (3, 3), (4, 10), (0, 0)])
def test_byte_bounds_never_exceeded(tmp_path, ram_blocks, disk_blocks):
    rng = random.Random(ram_blocks * 100 + disk_blocks)
    store = make(tmp_path, ram_blocks, disk_blocks)
    for _ in range(300):
        h = rng.randrange(40)
        if rng.random() < 0.6:
            store.put(NS, h, block(h))
        else:
            assert store.get(NS, [h])[0] in (None, block(h))
        s = store.stats()
        assert s["ram_bytes"] <= ram_blocks * B and s["disk_bytes"] <= disk_blocks * FILE
        assert s["ram_bytes"] == sum(len(v) for v in store._ram.values())
    on_disk = sum(f.stat().st_size for f in (tmp_path / "kv").rglob("*.blk"))
    assert on_disk == store.stats()["disk_bytes"]


def test_lookup_prefix_semantics(tmp_path):
    store = make(tmp_path, ram_blocks=2, disk_blocks=2)
    for h in (10, 11, 13, 14):
        store.put(NS, h, block(h))
    assert store.lookup(NS, [10, 11, 12, 13]) == (2, [True, True, False, True])
    assert store.lookup(NS, [10, 11]) == (2, [True, True])
    assert store.lookup(NS, [99, 10]) == (0, [False, True])
    assert store.lookup(NS, []) == (0, [])
    assert store.contains(NS, 13) and not store.contains(NS, 12)


def test_namespaces_isolated(tmp_path):
    store = make(tmp_path, ram_blocks=1, disk_blocks=4)
    store.put("a", 7, block(1))
    store.put("b", 7, block(2))  # same hash, other namespace: demotes a/7 to disk
    assert store.get("a", [7]) == [block(1)] and store.get("b", [7]) == [block(2)]
    assert store.lookup("c", [7]) == (0, [False])
    restarted = (store.close(), make(tmp_path, ram_blocks=1, disk_blocks=4))[1]
    assert restarted.get("a", [7]) == [block(1)] and restarted.get("b", [7]) == [block(2)]


def test_restart_keeps_disk_tier_and_lru_order(tmp_path):
    store = make(tmp_path, ram_blocks=2, disk_blocks=3)
    for h in (1, 2, 3, 4, 5):
        store.put(NS, h, block(h))
    assert disk_keys(store) == [1, 2, 3]
    for i, h in enumerate((1, 2, 3)):  # mtimes a second apart: scan order is unambiguous
        os.utime(store._path((NS, h)), ns=(10**18 + i * 10**9,) * 2)
    del store  # crash: the RAM tier (4, 5) is lost, the folder is still locked until collected
    restarted = make(tmp_path, ram_blocks=2, disk_blocks=3)
    assert disk_keys(restarted) == [1, 2, 3] and restarted.stats()["disk_bytes"] == 3 * FILE
    assert restarted.get(NS, [1, 2, 3, 4, 5]) == [block(1), block(2), block(3), None, None]
    restarted.close()  # writes RAM back: 2 and 3 are in RAM and on disk already
    again = make(tmp_path, ram_blocks=2, disk_blocks=3)
    assert sorted(disk_keys(again)) == [1, 2, 3]


def test_close_writes_ram_back(tmp_path):
    store = make(tmp_path, ram_blocks=4, disk_blocks=4)
    for h in (1, 2):
        store.put(NS, h, block(h))
    store.close()
    again = make(tmp_path, ram_blocks=4, disk_blocks=4)
    assert again.get(NS, [1, 2]) == [block(1), block(2)] and again.stats()["hits_disk"] == 2


def test_write_behind_writes_unwritten_ram_blocks_oldest_first_within_its_budget(tmp_path):
    store = make(tmp_path, ram_blocks=3, disk_blocks=8)
    for h in (1, 2, 3):
        store.put(NS, h, block(h))
    assert store.stats()["ram_unwritten_blocks"] == 3 and disk_keys(store) == []
    assert store.write_behind(max_bytes=B) == 1 and disk_keys(store) == [1]  # the oldest put, one block's bytes
    store.put(NS, 4, block(4))  # evicts 1 from RAM: already on disk, so no write
    assert disk_keys(store) == [1] and store.stats()["ram_unwritten_blocks"] == 3
    store.put(NS, 5, block(5))  # evicts 2, unwritten: demoted as before, and no longer owed
    assert disk_keys(store) == [1, 2] and store.stats()["ram_unwritten_blocks"] == 3
    assert store.write_behind() == 3 and disk_keys(store) == [1, 2, 3, 4, 5]
    assert store.write_behind() == 0 and store.stats()["ram_unwritten_blocks"] == 0
    assert ram_keys(store) == [3, 4, 5], "written behind, the blocks stay in RAM too"
    store._lock_file.close()  # as a kill leaves it: no close(), no write-back
    again = make(tmp_path, ram_blocks=3, disk_blocks=8)
    assert again.lookup(NS, [1, 2, 3, 4, 5]) == (5, [True] * 5)


def test_no_disk_tier_owes_nothing(tmp_path):
    store = KVBlockStore(4 * B)
    store.put(NS, 1, block(1))
    assert store.stats()["ram_unwritten_blocks"] == 0 and store.write_behind() == 0


def test_second_store_on_same_folder_refused(tmp_path):
    store = make(tmp_path, 1, 1)
    with pytest.raises(RuntimeError, match="in use"):
        make(tmp_path, 1, 1)
    store.close()


def flip_payload_byte(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 0xFF])


@pytest.mark.parametrize("damage", [
    flip_payload_byte,
    lambda raw: raw[: HEADER_BYTES + 10],  # truncated
    lambda raw: raw[:5],  # shorter than the header
    lambda raw: b"XXXX" + raw[4:],  # wrong magic
    None,  # file deleted behind the store's back
], ids=["flipped", "truncated", "no-header", "magic", "deleted"])
def test_corrupt_block_dropped_not_served_counted(tmp_path, damage):
    store = make(tmp_path, ram_blocks=0, disk_blocks=4)  # every block lives on disk only
    for h in (1, 2):
        store.put(NS, h, block(h))
    store.drain_events()
    path = store._path((NS, 1))
    if damage is None:
        path.unlink()
    else:
        path.write_bytes(damage(path.read_bytes()))
    assert store.lookup(NS, [1, 2]) == (2, [True, True])  # the index cannot know yet
    assert store.get(NS, [1, 2]) == [None, block(2)]
    assert not path.exists() and not store.contains(NS, 1)
    s = store.stats()
    assert (s["corrupt_blocks"], s["disk_blocks"], s["disk_bytes"], s["misses"]) == (1, 1, FILE, 1)
    assert store.drain_events() == {NS: ([], [1])}
    assert store.get(NS, [1]) == [None] and store.stats()["corrupt_blocks"] == 1


def test_corrupt_after_restart_and_leftovers(tmp_path):
    store = make(tmp_path, ram_blocks=0, disk_blocks=4)
    store.put(NS, 1, block(1))
    store.close()
    path = store._path((NS, 1))
    path.write_bytes(flip_payload_byte(path.read_bytes()))
    (path.parent / "junk.blk.123.tmp").write_bytes(b"half")
    again = make(tmp_path, ram_blocks=0, disk_blocks=4)
    assert not (path.parent / "junk.blk.123.tmp").exists()
    assert again.get(NS, [1]) == [None] and again.stats()["corrupt_blocks"] == 1


@pytest.mark.parametrize("size,where", [(B, "ram"), (3 * B, "disk"), (10 * B, "nowhere")])
def test_block_sizes_against_tiers(tmp_path, size, where):
    store = KVBlockStore(2 * B, 4 * B, tmp_path / "kv")
    assert store.put(NS, 1, block(1, size)) == (where != "nowhere")
    assert (store.stats()["ram_blocks"], store.stats()["disk_blocks"]) == {
        "ram": (1, 0), "disk": (0, 1), "nowhere": (0, 0)}[where]
    assert store.get(NS, [1]) == [block(1, size) if where != "nowhere" else None]
    assert store.drain_events() == ({NS: ([1], [])} if where != "nowhere" else {})


def test_events_last_change_wins_and_duplicate_put(tmp_path):
    store = make(tmp_path, ram_blocks=1, disk_blocks=0)  # RAM only
    assert store.put(NS, 1, block(1)) and not store.put(NS, 1, block(1))
    store.put(NS, 2, block(2))  # 1 evicted, nowhere to go
    assert store.drain_events() == {NS: ([2], [1])}
    store.put(NS, 1, block(1))
    assert store.drain_events() == {NS: ([1], [2])}
    assert store.drain_events() == {}
    assert store.stats()["puts"] == 4
    with pytest.raises(ValueError):
        store.put(NS, 2**64, b"x")
