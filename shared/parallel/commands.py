"""The command channel from a tensor-parallel worker's rank 0 to its followers, in shared memory.

Rank 0 hands every model operation to the other ranks as a small pickled tuple before doing it
itself (``runner.py``). Over gloo each command cost about a millisecond (a broadcast of its
length, then one of its bytes, each a TCP round trip); a decode step of an 8B model on two GPUs
lasts two or three. Here a command is a write into a ring of slots in a shared-memory file and one
eventfd post per follower; a follower sleeps in the eventfd's read until then, so it spins no core.

Two eventfds per follower, both in semaphore mode (each read takes one unit): *ready* counts the
commands written and not yet taken, *free* the slots that follower has given back. Rank 0 takes a
unit of every follower's *free* before writing a slot, so it never overwrites a command someone
has not read; a follower posts *free* once it has copied the command out. The syscalls on both
sides order the slot's bytes with the posts on any CPU, x86 or Arm.

A command larger than a slot goes through the gloo control group instead (the slot says so), as
do the collectives (``min_over_ranks``). The memory file and the eventfds are inherited by the
follower processes (``pass_fds``), so nothing is left behind under /dev/shm when a process dies.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
from dataclasses import dataclass

SLOTS = 64  # commands rank 0 may be ahead of the slowest follower (copies and swaps have no collective)
SLOT_BYTES = 64 << 10  # a decode step's command is tens of bytes; an export of a long prompt's blocks a few KiB
_LENGTH = struct.Struct("<q")  # the payload's length; OVERSIZE: the command follows over the control group
OVERSIZE = -1


def available() -> bool:
    """Whether this platform has what the channel needs (Linux: memfd and eventfd)."""
    return hasattr(os, "eventfd") and hasattr(os, "memfd_create")


@dataclass
class ChannelFds:
    """The inheritable file descriptors of one follower's end: what its command line carries."""

    memory: int
    ready: int
    free: int

    def encode(self) -> str:
        return f"{self.memory},{self.ready},{self.free}"

    @classmethod
    def decode(cls, text: str) -> ChannelFds:
        memory, ready, free = (int(part) for part in text.split(","))
        return cls(memory, ready, free)


def _ring(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, SLOTS * SLOT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


class CommandSender:
    """Rank 0's end: :meth:`send` writes a command for every follower."""

    def __init__(self, followers: int) -> None:
        # Close-on-exec: only the follower processes get them, through ``pass_fds``.
        self.memory = os.memfd_create("tandem-tp-commands", os.MFD_CLOEXEC)
        os.ftruncate(self.memory, SLOTS * SLOT_BYTES)
        self.ring = _ring(self.memory)
        self.ready = [os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_CLOEXEC) for _ in range(followers)]
        self.free = [os.eventfd(SLOTS, os.EFD_SEMAPHORE | os.EFD_CLOEXEC) for _ in range(followers)]
        self.sent = 0

    def fds_for(self, follower: int) -> ChannelFds:
        """Follower ``follower``'s (0-based: rank - 1) descriptors, to pass to its process."""
        return ChannelFds(self.memory, self.ready[follower], self.free[follower])

    def inheritable(self) -> list[int]:
        return [self.memory, *self.ready, *self.free]

    def send(self, command: tuple) -> bool:
        """Write ``command`` for every follower; False when it is too large for a slot (then the caller
        sends it over the control group: the followers are told to look there)."""
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        fits = len(payload) <= SLOT_BYTES - _LENGTH.size
        for fd in self.free:  # blocks while the slowest follower is a whole ring behind
            os.eventfd_read(fd)
        offset = (self.sent % SLOTS) * SLOT_BYTES
        _LENGTH.pack_into(self.ring, offset, len(payload) if fits else OVERSIZE)
        if fits:
            self.ring[offset + _LENGTH.size: offset + _LENGTH.size + len(payload)] = payload
        self.sent += 1
        for fd in self.ready:
            os.eventfd_write(fd, 1)
        return fits

    def close(self) -> None:
        self.ring.close()
        for fd in (self.memory, *self.ready, *self.free):
            os.close(fd)


class CommandReceiver:
    """A follower's end: :meth:`receive` waits for rank 0's next command."""

    def __init__(self, fds: ChannelFds) -> None:
        self.fds = fds
        self.ring = _ring(fds.memory)
        self.received = 0

    def receive(self) -> tuple | None:
        """The next command, or None when rank 0 sent it over the control group (too large)."""
        os.eventfd_read(self.fds.ready)
        offset = (self.received % SLOTS) * SLOT_BYTES
        (length,) = _LENGTH.unpack_from(self.ring, offset)
        start = offset + _LENGTH.size
        payload = None if length == OVERSIZE else bytes(self.ring[start: start + length])
        self.received += 1
        os.eventfd_write(self.fds.free, 1)  # copied out: the slot may be written again
        return None if payload is None else pickle.loads(payload)

    def close(self) -> None:
        self.ring.close()
        for fd in (self.fds.memory, self.fds.ready, self.fds.free):
            os.close(fd)
