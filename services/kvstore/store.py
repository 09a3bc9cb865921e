"""Two-tier, content-addressed store of KV blocks: host RAM, then local disk. No NATS here.

A block is the bytes of one KV-cache block, keyed by its chained block hash (a u64) within a
namespace (model, dtype and KV layout: blocks are only comparable within one)::

    store = KVBlockStore(ram_bytes=1 << 30, disk_bytes=8 << 30, disk_dir="/var/lib/tandem/kvstore")
    store.put("tiny/f32/16", 0x1234, block_bytes)
    store.lookup("tiny/f32/16", [0x1234, 0x5678])   # -> (1, [True, False])
    store.get("tiny/f32/16", [0x1234])              # -> [block_bytes]

Both tiers are LRU, bounded in bytes. ``put`` lands in RAM; a block evicted from RAM is written to
disk when it fits there (demotion), a block evicted from disk is deleted. A disk hit is copied back
into RAM (promotion) and its file stays, so tiers may overlap. Disk layout: one file per block,
``<disk_dir>/<namespace digest>/<hash:016x>.blk``, written to a temporary name and renamed (no
fsync: a torn file after a power cut fails its checksum), with a header holding magic, hash,
length and crc32. A new store on the same folder scans it (LRU order from file mtimes) and so keeps
the disk tier across restarts. RAM blocks not yet on disk are written there behind the puts
(:meth:`write_behind`, which the service calls every ``--kvstore-write-behind-s``; tiers then
overlap, and an eviction from RAM needs no write) and by :meth:`close`, so a kill loses only the
blocks put since the last round. A file failing its
checks when read is deleted, logged, counted (``corrupt_blocks``) and never served. ``lookup``
consults the index only. Not thread-safe: the service calls it from one thread.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("tandem.kvstore.store")

_HEADER = struct.Struct(">4sQQI")  # magic, block hash, payload length, crc32 of the payload
_MAGIC = b"TKV1"
HEADER_BYTES = _HEADER.size
Key = tuple[str, int]


def namespace_digest(namespace: str) -> str:
    """The folder name of a namespace on disk (its readable name is kept in a ``namespace`` file)."""
    return hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()


class KVBlockStore:
    """Blocks by ``(namespace, hash)`` in RAM (``ram_bytes``) and on disk (``disk_bytes``, file sizes)."""

    def __init__(self, ram_bytes: int, disk_bytes: int = 0, disk_dir: str | os.PathLike | None = None) -> None:
        self.ram_capacity = int(ram_bytes)
        self.disk_capacity = int(disk_bytes) if disk_dir is not None else 0
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self._ram: OrderedDict[Key, bytes] = OrderedDict()
        self._disk: OrderedDict[Key, int] = OrderedDict()  # key -> file size, LRU first
        self._unwritten: OrderedDict[Key, None] = OrderedDict()  # RAM keys not on disk, oldest put first
        self.ram_used = 0
        self.disk_used = 0
        self.counters = dict.fromkeys(
            ("hits_ram", "hits_disk", "misses", "puts", "evictions_ram", "evictions_disk", "corrupt_blocks"), 0)
        self._events: dict[str, dict[int, bool]] = {}  # namespace -> hash -> held (last change wins)
        self._lock_file = None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.disk_dir / ".lock", "w")
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._lock_file.close()
                raise RuntimeError(f"{self.disk_dir} is in use by another KV store") from None
            self._scan()

    # -- queries ------------------------------------------------------------------------------------
    def contains(self, namespace: str, block_hash: int) -> bool:
        key = (namespace, block_hash)
        return key in self._ram or key in self._disk

    def lookup(self, namespace: str, hashes: list[int]) -> tuple[int, list[bool]]:
        """(how many leading hashes are all present, presence of each hash); touches nothing."""
        present = [self.contains(namespace, h) for h in hashes]
        leading = present.index(False) if False in present else len(present)
        return leading, present

    def get(self, namespace: str, hashes: list[int]) -> list[bytes | None]:
        """Each block's bytes or None; hits become most recently used, disk hits move into RAM."""
        out: list[bytes | None] = []
        for h in hashes:
            key = (namespace, h)
            data = self._ram.get(key)
            if data is not None:
                self._ram.move_to_end(key)
                self.counters["hits_ram"] += 1
            elif key in self._disk and (data := self._read(key)) is not None:
                self._disk.move_to_end(key)
                self.counters["hits_disk"] += 1
                self._ram_insert(key, data)
            else:
                self.counters["misses"] += 1
            out.append(data)
        return out

    def stats(self) -> dict[str, int]:
        return {"ram_bytes": self.ram_used, "ram_blocks": len(self._ram), "ram_capacity": self.ram_capacity,
                "ram_unwritten_blocks": len(self._unwritten),
                "disk_bytes": self.disk_used, "disk_blocks": len(self._disk), "disk_capacity": self.disk_capacity,
                **self.counters}

    def namespaces(self) -> dict[str, list[int]]:
        """Every namespace and the hashes held in it (both tiers)."""
        held: dict[str, list[int]] = {}
        for ns, h in {**dict.fromkeys(self._disk), **dict.fromkeys(self._ram)}:
            held.setdefault(ns, []).append(h)
        return held

    def drain_events(self) -> dict[str, tuple[list[int], list[int]]]:
        """Hashes that became held (stored) or stopped being held (removed) since the last call."""
        events = {ns: ([h for h, held in changes.items() if held], [h for h, held in changes.items() if not held])
                  for ns, changes in self._events.items()}
        self._events.clear()
        return events

    # -- changes ------------------------------------------------------------------------------------
    def put(self, namespace: str, block_hash: int, data: bytes | bytearray | memoryview) -> bool:
        """Keep one block; True when it is new (False: already held, or larger than either tier)."""
        if not 0 <= block_hash < 2**64:
            raise ValueError(f"block hash {block_hash} is not a u64")
        key = (namespace, block_hash)
        self.counters["puts"] += 1
        if key in self._ram:
            self._ram.move_to_end(key)
            return False
        if key in self._disk:
            self._disk.move_to_end(key)
            return False
        data = bytes(data)
        if len(data) <= self.ram_capacity:
            self._ram_insert(key, data)
            if key in self._ram and self.disk_capacity:
                self._unwritten[key] = None
        elif not self._disk_write(key, data):
            return False
        self._note(key, True)
        return True

    def write_behind(self, max_bytes: int | None = None) -> int:
        """Write RAM blocks not yet on disk there, oldest put first, about ``max_bytes`` at most
        (None: all); returns how many were written. A block the disk cannot take stays RAM-only."""
        written = done = 0
        while self._unwritten and (max_bytes is None or done < max_bytes):
            key, _ = self._unwritten.popitem(last=False)
            data = self._ram.get(key)
            if data is None or key in self._disk:
                continue
            if self._disk_write(key, data):
                written += 1
            done += len(data)
        return written

    def close(self) -> None:
        """Write RAM blocks not yet on disk there (oldest first), then release the folder."""
        self.write_behind()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- internals ----------------------------------------------------------------------------------
    def _note(self, key: Key, held: bool) -> None:
        self._events.setdefault(key[0], {})[key[1]] = held

    def _ram_insert(self, key: Key, data: bytes) -> None:
        if len(data) > self.ram_capacity:
            return
        self._ram[key] = data
        self.ram_used += len(data)
        while self.ram_used > self.ram_capacity:  # never the new key: it alone fits
            old, old_data = self._ram.popitem(last=False)
            self.ram_used -= len(old_data)
            self.counters["evictions_ram"] += 1
            self._unwritten.pop(old, None)
            if old not in self._disk and not self._disk_write(old, old_data):
                self._note(old, False)

    def _path(self, key: Key) -> Path:
        return self.disk_dir / namespace_digest(key[0]) / f"{key[1]:016x}.blk"

    def _disk_write(self, key: Key, data: bytes) -> bool:
        size = HEADER_BYTES + len(data)
        if self.disk_dir is None or size > self.disk_capacity:
            return False
        while self.disk_used + size > self.disk_capacity:
            self._disk_drop(next(iter(self._disk)), evicted=True)
        path = self._path(key)
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                _write_atomic(path.parent / "namespace", key[0].encode())
            _write_atomic(path, _HEADER.pack(_MAGIC, key[1], len(data), zlib.crc32(data)), data)
        except OSError as exc:  # a full or failing disk loses this block, not the store
            log.warning("could not write KV block %016x to %s: %s", key[1], path, exc)
            return False
        self._disk[key] = size
        self.disk_used += size
        return True

    def _disk_drop(self, key: Key, evicted: bool = False) -> None:
        self.disk_used -= self._disk.pop(key)
        self.counters["evictions_disk"] += evicted
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        if key not in self._ram:
            self._note(key, False)

    def _read(self, key: Key) -> bytes | None:
        """The block's payload from disk, or None (and the file dropped) when it fails any check."""
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            problem = f"unreadable ({exc.strerror})"
        else:
            problem = _check(raw, key[1])
            if problem is None:
                os.utime(path)  # LRU order survives a restart
                return raw[HEADER_BYTES:]
        log.warning("dropping corrupt KV block %016x of %r (%s): %s", key[1], key[0], problem, path)
        self.counters["corrupt_blocks"] += 1
        self._disk_drop(key)
        return None

    def _scan(self) -> None:
        """Rebuild the disk index from the folder: LRU order from mtimes, leftovers removed."""
        found: list[tuple[int, Key, int]] = []
        for ns_dir in self.disk_dir.iterdir():
            if not ns_dir.is_dir():
                continue
            try:
                namespace = (ns_dir / "namespace").read_text()
            except OSError:
                namespace = None
            for entry in os.scandir(ns_dir):
                if entry.name.endswith(".tmp"):
                    os.unlink(entry.path)
                elif (entry.name.endswith(".blk") and namespace is not None
                      and namespace_digest(namespace) == ns_dir.name):
                    try:
                        h, st = int(entry.name[:-4], 16), entry.stat()
                    except (ValueError, OSError):
                        continue
                    found.append((st.st_mtime_ns, (namespace, h), st.st_size))
        for _, key, size in sorted(found):
            self._disk[key] = size
            self.disk_used += size
        while self.disk_used > self.disk_capacity:  # the folder outgrew a smaller limit
            self._disk_drop(next(iter(self._disk)), evicted=True)
        self._events.clear()  # the service announces the scanned blocks itself
        log.info("disk tier %s: %d blocks, %d bytes", self.disk_dir, len(self._disk), self.disk_used)


def _check(raw: bytes, block_hash: int) -> str | None:
    if len(raw) < HEADER_BYTES:
        return "shorter than its header"
    magic, h, length, crc = _HEADER.unpack_from(raw)
    if magic != _MAGIC or h != block_hash:
        return "wrong magic or hash"
    if length != len(raw) - HEADER_BYTES:
        return f"holds {len(raw) - HEADER_BYTES} of {length} bytes"
    if zlib.crc32(memoryview(raw)[HEADER_BYTES:]) != crc:
        return "checksum mismatch"
    return None


def _write_atomic(path: Path, *parts: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
    os.replace(tmp, path)
