"""Same-host fast path for KV blocks: a ring of fixed-size slots in one /dev/shm segment.

The decode worker (consumer) creates its ring at start and advertises ``ring.name`` and
:func:`host_id`; a prefill worker (producer) with the same host id attaches by name, copies a
transfer into free slots and sends only a :class:`SlotDescriptor` over NATS; the consumer copies
the bytes out (generation checked) and releases the slots. A transfer spans as many slots as it
needs (adjacent ones when free, so copies go in large bursts); when the ring has too few free
slots ``try_write`` returns None and the caller sends NATS frames (:mod:`tandem.shared.kvtransfer.frames`)::

    ring = ShmRing.create("decode-0", slot_bytes=2 << 20, num_slots=256)   # consumer
    prod = ShmRing.attach(ring.name)                                        # producer process
    desc = prod.try_write(kv)              # CPU or CUDA tensor, or bytes; None -> send_kv
    kv = ring.read(desc)                   # uint8 CPU tensor; or ring.read(desc, out=gpu_tensor)

Layout: header (64 B) | slot table (32 B per slot) | pad to 4 KiB | num_slots x slot_bytes.
Slot protocol. Every state change happens under an exclusive flock on ``<segment>.lock`` (plus a
thread lock; each process opens its own descriptor, so several producers never collide, and the
kernel drops a dead holder's flock, so a killed process can never wedge the ring):

- FREE -> WRITING: producer ``reserve``; bumps the ring's generation counter and stamps it, its
  pid and its process start time (so a reused pid is not mistaken for the owner) on each slot;
- WRITING -> READY: producer ``commit`` after its copy (the copy runs outside the lock);
- READY -> READING -> FREE: consumer ``claim`` (the descriptor's generation must match every
  slot) then ``release``; READY -> FREE: producer ``abort`` when the descriptor was never sent;
- WRITING/READY -> FREE: ``reclaim`` when the owner process is gone (any process may, and a
  full ``try_write`` does); READY older than ``stale_after_s`` too (the consumer's call: the
  descriptor was lost; pick it well above the admit timeout).

So only the owner writes a WRITING slot and only the consumer reads a READING one; a stale or
replayed descriptor fails the generation check. The bytes are published by the descriptor itself,
sent over a socket after the copy, so the syscalls on both sides order the memory accesses.

Cleanup rule: only the consumer owns a segment, named ``tandem-kv-<pid>-<random>[-label]``. It
holds an exclusive flock on the segment for its life; ``close()`` (also run at exit, but not on
``os._exit``: services must call it) unlinks both files. After kill -9 the files stay until the
next ``ShmRing.create`` on the host (or :func:`sweep_stale`) unlinks every segment whose flock it
can take. Producers never create files; a killed producer's slots come back through ``reclaim``.

Tests: ``python -m pytest -q tests/test_shmring.py``; figures: ``python benchmarks/kv_transfer.py``.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.shared.kvtransfer.devcopy import copy_stream

SHM_DIR = "/dev/shm"
PREFIX = "tandem-kv-"
MAGIC, VERSION = b"TDKVRNG1", 1
_NAME = re.compile(r"^tandem-kv-(\d+)-[0-9a-f]{8}(-[A-Za-z0-9_.]{1,64})?$")
_HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("num_slots", "<u4"), ("slot_bytes", "<u8"),
                    ("data_offset", "<u8"), ("generation", "<u8"), ("pidns", "<u8"), ("creator", "<u4"),
                    ("pad", "V12")])
_SLOT = np.dtype([("state", "<u4"), ("pid", "<u4"), ("gen", "<u8"), ("start", "<u8"), ("stamp", "<f8")])
FREE, WRITING, READY, READING = 0, 1, 2, 3


class RingError(RuntimeError):
    """A ring cannot be used as asked: bad name or layout, stale descriptor, wrong namespace."""


class RingMissingError(RingError, FileNotFoundError):
    """No live ring by that name: never created, closed, or its consumer died."""


@dataclass(frozen=True)
class SlotDescriptor:
    """What travels over NATS instead of the bytes: the slots, in transfer order."""

    ring: str
    slots: tuple[int, ...]
    length: int
    generation: int

    def to_wire(self) -> dict:
        return {"ring": self.ring, "slots": list(self.slots), "length": self.length, "generation": self.generation}

    @classmethod
    def from_wire(cls, d: dict) -> SlotDescriptor:
        return cls(str(d["ring"]), tuple(int(s) for s in d["slots"]), int(d["length"]), int(d["generation"]))


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def host_id() -> str:
    """Equal in two processes iff they see the same /dev/shm and the same pids: kernel boot id
    (distinct per host and boot, shared by containers), /dev/shm's device (a container's private
    /dev/shm differs) and the pid namespace (owner liveness is checked by pid)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").exists() else os.uname().nodename
    return f"{boot}-{os.stat(SHM_DIR).st_dev:x}-{_ns_inode('pid'):x}"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks, or None when it is gone (zombies count as gone)."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if rest[0] in ("Z", "X") else int(rest[19])


def _identity() -> tuple[int, int]:
    return os.getpid(), _start_time(os.getpid()) or 0


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every tandem-kv segment whose consumer is gone (its flock is free); returns them."""
    removed = []
    for path in sorted(Path(shm_dir).glob(PREFIX + "*")):
        match = _NAME.match(path.name.removesuffix(".lock"))
        if match is None:
            continue
        if path.suffix == ".lock":  # an orphan lock file: its segment is gone, so is its creator
            if not path.with_suffix("").exists() and _start_time(int(match[1])) is None:
                path.unlink(missing_ok=True)
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # No magic yet: a creator between open and flock; leave it unless its pid is gone.
            if os.pread(fd, 8, 0) != MAGIC and _start_time(int(match[1])) is not None:
                continue
            path.unlink(missing_ok=True)
            Path(f"{path}.lock").unlink(missing_ok=True)
            removed.append(path.name)
        except BlockingIOError:
            pass  # a live consumer holds it
        finally:
            os.close(fd)
    return removed


def _index(slots: tuple[int, ...]) -> slice | list[int]:
    """Adjacent slots as a slice: numpy updates them far faster than through a list."""
    if slots and slots[-1] - slots[0] == len(slots) - 1 and all(b == a + 1 for a, b in zip(slots, slots[1:])):
        return slice(slots[0], slots[-1] + 1)
    return list(slots)


class ShmRing:
    """One mapping of a ring; ``create`` makes the consumer's, ``attach`` a producer's."""

    def __init__(self, name: str, fd: int, lock_fd: int, owner: bool, pin: bool | None) -> None:
        self.name, self.owner, self._fd, self._lock_fd = name, owner, fd, lock_fd
        self._opener = os.getpid()
        self._tlock = threading.Lock()
        if os.fstat(fd).st_size < 4096:
            raise RingError(f"{name} is not a tandem ring (or not finished)")
        self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        self._hdr = np.frombuffer(self._mm, _HEADER, 1)
        if owner:
            return  # create() fills the header, then calls _map_slots
        h = self._hdr[0]
        if h["magic"] != MAGIC or h["version"] != VERSION:
            raise RingError(f"{name} is not a tandem ring (or not finished)")
        self._map_slots(int(h["num_slots"]), int(h["slot_bytes"]), int(h["data_offset"]), pin)

    def _map_slots(self, num_slots: int, slot_bytes: int, data_offset: int, pin: bool | None) -> None:
        self.num_slots, self.slot_bytes, self._data = num_slots, slot_bytes, data_offset
        if len(self._mm) != data_offset + num_slots * slot_bytes:
            raise RingError(f"{self.name}: size does not match its header")
        self._slots = np.frombuffer(self._mm, _SLOT, num_slots, _HEADER.itemsize)
        self._state, self._gen = self._slots["state"], self._slots["gen"]
        # The whole segment, zero-copy: numpy for CPU copies (a plain memcpy; torch's CPU copy
        # wakes its thread pool, whose spinning starves the other processes on a small host),
        # torch for CUDA copies. Both hold the mapping, so close() never leaves them dangling.
        self._np = np.frombuffer(self._mm, np.uint8)
        self._buf = torch.from_numpy(self._np)
        self._me = _identity()
        self.pinned = bool(torch.cuda.is_available() if pin is None else pin)
        if self.pinned:  # page-locked (as NCCL does with its /dev/shm buffers): GPU copies are
            # DMA bursts that run non-blocking; flag 1 = portable, pinned for every CUDA context
            err = torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), len(self._mm), 1)
            if pin is None and err != torch.cuda.cudart().cudaError.success:
                self.pinned = False  # auto mode: stay usable, just slower
            else:
                torch.cuda.check_error(err)

    @classmethod
    def create(cls, name: str | None, slot_bytes: int, num_slots: int, *, pin: bool | None = None) -> ShmRing:
        """The consumer's ring (``name`` is an optional label); sweeps dead rings first.
        ``pin``: register with CUDA (default: when CUDA is available)."""
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError("slot_bytes and num_slots must be positive")
        sweep_stale()
        full = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}" + (f"-{name}" if name else "")
        if not _NAME.match(full):
            raise ValueError(f"ring label {name!r}: use up to 64 of [A-Za-z0-9_.]")
        path, ring = f"{SHM_DIR}/{full}", None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        lock_fd = -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for life: the liveness mark sweep_stale tests
            lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            data = -(-(_HEADER.itemsize + num_slots * _SLOT.itemsize) // 4096) * 4096
            # Allocate now: tmpfs pages past /dev/shm's size would SIGBUS on first touch instead.
            os.posix_fallocate(fd, 0, data + num_slots * slot_bytes)
            ring = cls(full, fd, lock_fd, True, pin)
            h = ring._hdr
            h["version"], h["num_slots"], h["slot_bytes"], h["data_offset"] = VERSION, num_slots, slot_bytes, data
            h["pidns"], h["creator"] = _ns_inode("pid"), os.getpid()
            h["magic"] = MAGIC  # last: attach refuses a ring whose header is not complete
            ring._map_slots(num_slots, slot_bytes, data, pin)
        except BaseException:
            if ring is not None:
                ring.close()
            else:
                Path(path).unlink(missing_ok=True)
                Path(f"{path}.lock").unlink(missing_ok=True)
                os.close(fd)
                if lock_fd >= 0:
                    os.close(lock_fd)
            raise
        atexit.register(ring.close)
        return ring

    @classmethod
    def attach(cls, name: str, *, pin: bool | None = None) -> ShmRing:
        """A producer's view of a live consumer's ring; :class:`RingMissingError` if there is none."""
        if not _NAME.match(name):
            raise RingError(f"{name!r} is not a tandem ring name")
        try:
            fd = os.open(f"{SHM_DIR}/{name}", os.O_RDWR)
            lock_fd = os.open(f"{SHM_DIR}/{name}.lock", os.O_RDWR)
        except FileNotFoundError:
            if "fd" in locals():
                os.close(fd)
            raise RingMissingError(f"no ring {name} in {SHM_DIR}") from None
        try:
            ring = cls(name, fd, lock_fd, False, pin)
        except BaseException:
            os.close(fd)
            os.close(lock_fd)
            raise
        if not ring.consumer_alive():
            ring.close()
            raise RingMissingError(f"ring {name}: its consumer is gone")
        if int(ring._hdr[0]["pidns"]) != _ns_inode("pid"):
            ring.close()
            raise RingError(f"ring {name} lives in another pid namespace")
        return ring

    def consumer_alive(self) -> bool:
        """False once the consumer closed or died (a producer should then close and fall back)."""
        if self.owner:
            return not self._mm.closed
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @property
    def capacity(self) -> int:
        """Bytes of the whole ring: a transfer larger than this never fits."""
        return self.num_slots * self.slot_bytes

    def free_slots(self) -> int:
        return int(np.count_nonzero(self._state == FREE))

    # -- producer ---------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> SlotDescriptor | None:
        """Slots for ``nbytes`` (a run of adjacent ones if free, else any), or None when too few."""
        if nbytes < 1:
            raise ValueError("nothing to reserve")
        need = -(-nbytes // self.slot_bytes)
        if need > self.num_slots:
            return None  # larger than the whole ring: never fits
        with self._locked():
            free = self._state == FREE
            first = free.tobytes().find(b"\x01" * need)  # first fit of adjacent free slots
            if first >= 0:
                chosen = tuple(range(first, first + need))
            else:
                chosen = tuple(int(i) for i in np.flatnonzero(free)[:need])
                if len(chosen) < need:
                    return None
            if self._me[0] != os.getpid():  # forked since attach: stamp the child's own identity
                self._me = _identity()
            self._hdr["generation"] += 1
            gen = int(self._hdr[0]["generation"])
            slots, idx = self._slots, _index(chosen)
            slots["state"][idx], slots["gen"][idx], slots["stamp"][idx] = WRITING, gen, time.monotonic()
            slots["pid"][idx], slots["start"][idx] = self._me
        return SlotDescriptor(self.name, chosen, nbytes, gen)

    def write(self, desc: SlotDescriptor, data: bytes | memoryview | np.ndarray | torch.Tensor,
              offset: int = 0) -> None:
        """Copy ``data`` to bytes [offset, offset+len) of a reserved transfer, one copy per run."""
        if isinstance(data, torch.Tensor) and data.is_cuda:
            src = data.detach().contiguous().reshape(-1).view(torch.uint8)
            with copy_stream(src.device) as stream:
                for addr, pos, n in self._spans(desc, offset, src.numel()):
                    self._buf[addr : addr + n].copy_(src[pos - offset : pos - offset + n], non_blocking=True)
            stream.synchronize()  # bytes in place before commit
            return
        if isinstance(data, torch.Tensor):
            src = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        else:
            src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        for addr, pos, n in self._spans(desc, offset, len(src)):
            self._np[addr : addr + n] = src[pos - offset : pos - offset + n]

    def commit(self, desc: SlotDescriptor) -> None:
        idx = _index(desc.slots)
        with self._locked():
            if not self._holds(idx, WRITING, desc.generation):
                raise RingError(f"{self.name}: reservation {desc.generation} was reclaimed before commit")
            self._state[idx], self._slots["stamp"][idx] = READY, time.monotonic()

    def try_write(self, data: bytes | memoryview | np.ndarray | torch.Tensor) -> SlotDescriptor | None:
        """Reserve, copy and commit; None when the ring lacks room (send NATS frames instead)."""
        nbytes = data.numel() * data.element_size() if isinstance(data, torch.Tensor) else memoryview(data).nbytes
        desc = self.reserve(nbytes)
        # Full: slots of dead producers come back here too, without the consumer's help.
        if desc is None and nbytes <= self.capacity and self.reclaim():
            desc = self.reserve(nbytes)
        if desc is None:
            return None
        try:
            self.write(desc, data)
            self.commit(desc)
        except BaseException:
            self._set_free(desc, WRITING)
            raise
        return desc

    def abort(self, desc: SlotDescriptor) -> bool:
        """Free a committed transfer whose descriptor never reached the consumer; False if it is
        already being read (or gone)."""
        return self._set_free(desc, READY)

    # -- consumer ---------------------------------------------------------------------------------
    def claim(self, desc: SlotDescriptor) -> list[torch.Tensor]:
        """Zero-copy uint8 views of the transfer, one per run of adjacent slots; valid until
        :meth:`release`. :class:`RingError` for a stale, replayed or foreign descriptor."""
        slots = desc.slots
        if (desc.ring != self.name or len(slots) != -(-desc.length // self.slot_bytes) or len(set(slots)) != len(slots)
                or not all(0 <= i < self.num_slots for i in slots)):
            raise RingError(f"descriptor does not fit ring {self.name}")
        idx = _index(slots)
        with self._locked():
            if not self._holds(idx, READY, desc.generation):
                raise RingError(f"{self.name}: generation mismatch for transfer {desc.generation} (stale descriptor)")
            self._state[idx] = READING
        return [self._buf[a : a + n] for a, _, n in self._spans(desc, 0, desc.length)]

    def release(self, desc: SlotDescriptor) -> None:
        self._set_free(desc, READING)

    def read(self, desc: SlotDescriptor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy a transfer out and release its slots: into ``out`` (any contiguous tensor of at
        least ``length`` bytes, CPU or CUDA), else a new uint8 CPU tensor."""
        parts = self.claim(desc)
        try:
            out = torch.empty(desc.length, dtype=torch.uint8) if out is None else out
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
            dst = out.reshape(-1).view(torch.uint8)
            if dst.numel() < desc.length:
                raise ValueError(f"out holds {dst.numel()} bytes, the transfer {desc.length}")
            pos = 0
            if dst.is_cuda:
                with copy_stream(dst.device) as stream:
                    for part in parts:
                        dst[pos : pos + part.numel()].copy_(part, non_blocking=True)
                        pos += part.numel()
                stream.synchronize()  # the DMA must finish before the slots can be reused
            else:
                dst_np = dst.numpy()
                for part in parts:
                    dst_np[pos : pos + part.numel()] = part.numpy()
                    pos += part.numel()
        finally:
            del parts
            self.release(desc)
        return out

    def reclaim(self, stale_after_s: float | None = None) -> int:
        """Free slots whose owner process is gone, and READY ones older than ``stale_after_s``
        (descriptor lost). Returns how many slots were freed."""
        now, alive, freed = time.monotonic(), {}, 0
        slots = self._slots
        with self._locked():
            for i in np.flatnonzero((self._state == WRITING) | (self._state == READY)):
                owner = (int(slots["pid"][i]), int(slots["start"][i]))
                if owner not in alive:
                    alive[owner] = _start_time(owner[0]) == owner[1]
                ready = slots["state"][i] == READY
                stale = ready and stale_after_s is not None and now - slots["stamp"][i] > stale_after_s
                if not alive[owner] or stale:
                    slots["state"][i] = FREE
                    freed += 1
        return freed

    # -- internals --------------------------------------------------------------------------------
    def _set_free(self, desc: SlotDescriptor, expected: int) -> bool:
        idx = _index(desc.slots)
        with self._locked():
            if not self._holds(idx, expected, desc.generation):
                return False
            self._state[idx] = FREE
        return True

    def _holds(self, idx: slice | list[int], state: int, generation: int) -> bool:
        return bool(((self._state[idx] == state) & (self._gen[idx] == generation)).all())

    def _spans(self, desc: SlotDescriptor, start: int, n: int) -> Iterator[tuple[int, int, int]]:
        """(segment address, transfer position, length) of [start, start+n), adjacent slots merged."""
        if start < 0 or start + n > desc.length:
            raise ValueError(f"bytes [{start}, {start + n}) lie outside a {desc.length}-byte transfer")
        sb, pos, end, run = self.slot_bytes, start, start + n, None
        while pos < end:
            k, within = divmod(pos, sb)
            addr, length = self._data + desc.slots[k] * sb + within, min(sb - within, end - pos)
            if run and run[0] + run[2] == addr:
                run[2] += length
            else:
                if run:
                    yield tuple(run)
                run = [addr, pos, length]
            pos += length
        if run:
            yield tuple(run)

    def close(self) -> None:
        """Unmap (and unpin); the consumer also unlinks the segment. Safe to call twice."""
        if self._fd < 0:
            return
        atexit.unregister(self.close)
        if self.owner and self._opener == os.getpid():  # a forked child's exit must not unlink it
            Path(f"{SHM_DIR}/{self.name}").unlink(missing_ok=True)
            Path(f"{SHM_DIR}/{self.name}.lock").unlink(missing_ok=True)
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
        for attr in ("_buf", "_np", "_state", "_gen", "_slots", "_hdr"):
            self.__dict__.pop(attr, None)
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view from claim(); the mapping goes with the last one
        os.close(self._lock_fd)
        os.close(self._fd)  # drops the consumer's liveness flock
        self._fd = -1

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
