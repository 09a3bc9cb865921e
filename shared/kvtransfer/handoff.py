"""A prompt's KV from the prefill worker to its decode worker: the ring on one host, credited frames otherwise.

The prefill side holds a :class:`HandoffSender`, the decode side a :class:`HandoffReceiver`; between
them travels a :class:`DecodeRequest` whose ``ring`` (:class:`RingSlots`) or ``transfer``
(:class:`KVTransfer`) says where the bytes went::

    sender = HandoffSender(channel, settings.kv_ring)                      # prefill
    sent = await sender.send(kv, Destination(worker, subject, ring, host), request_id)
    # sent: RingSlots or KVTransfer, for the DecodeRequest that admits the sequence

    receiver = HandoffReceiver(worker_id, kv_namespace=..., kv_shape=..., ...)   # decode
    await receiver.serve(channel, subject)        # its KV frames land here as they arrive
    kv = await receiver.take(admit)               # [blocks, *kv_shape] on the worker's device

Which path: the ring (:mod:`tandem.shared.kvtransfer.ring`) when the decode worker advertised one on
this very host, this worker's ring is not switched off (``--kv-ring-mib 0``), the KV fits the ring and
room for it turns up within ``--kv-ring-wait-s``; NATS frames (:mod:`tandem.shared.kvtransfer.frames`,
over the process's :class:`KVChannel`) otherwise. Frames are two orders of magnitude slower on one
host, hence the wait for room. Copies into and out of the ring (GPU memory <-> pinned slots) and the
device copy ahead of frames run on threads, so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from dataclasses import dataclass

import torch

from tandem.shared.infra.config import KVRingSettings
from tandem.shared.kvtransfer.channel import KVChannel
from tandem.shared.kvtransfer.devcopy import tensor_bytes, to_host
from tandem.shared.kvtransfer.frames import KVReceiver
from tandem.shared.kvtransfer.ring import RingError, ShmRing, SlotDescriptor, host_id
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.kv import KVTransfer, RingSlots
from tandem.shared.protocol.serving import DecodeRequest

log = logging.getLogger("tandem.handoff")

RING_STALE_S = 120.0  # a READY slot whose admit never came: far beyond any admit timeout
RING_AUTO_MAX_BYTES = 4 << 30  # the largest ring a CUDA decode worker sizes for itself (pinned host memory)
RING_RETRY_S = 0.002  # how often a hand-off that found the ring full looks for room again


@dataclass(frozen=True)
class Destination:
    """Where a hand-off's KV goes: a decode worker as its heartbeats advertise it."""

    worker: str  # its instance id
    subject: str  # where its KV frames land
    ring: str = ""  # its ring's name ("": it has none)
    host: str = ""  # the host id its ring lives on (:func:`tandem.shared.kvtransfer.ring.host_id`)


class HandoffSender:
    """The prefill side: writes a hand-off's KV into the destination's ring, or sends it as frames.
    ``ring``: this worker's ring settings (``mib`` 0 switches the ring off, ``wait_s`` and ``copies``)."""

    def __init__(self, channel: KVChannel, ring: KVRingSettings, log: logging.Logger = log) -> None:
        self.channel, self.ring_settings, self.log = channel, ring, log
        self.host = host_id()
        self._rings: dict[str, ShmRing] = {}  # decode workers' rings on this host, attached on first use
        self._copies: dict[str, asyncio.Semaphore] = {}  # at most ``copies`` copies into one ring at once

    async def send(self, kv: torch.Tensor, to: Destination, request_id: str) -> RingSlots | KVTransfer:
        """Move ``kv`` (``[blocks, ...]``, on any device) to ``to``; what the admit message names: the ring
        slots it lies in, or the frames' transfer once every byte is credited. Frames fail as
        :meth:`KVChannel.send` does."""
        kv = kv.contiguous()
        slots = await self._write_to_ring(kv, to, request_id)
        return slots if slots is not None else await self._send_frames(kv, to)

    async def _write_to_ring(self, kv: torch.Tensor, to: Destination, request_id: str) -> RingSlots | None:
        """The KV written into the destination's ring, or None: another host, the ring off here, the
        destination's ring gone, too small, or still full after ``wait_s``."""
        if not (self.ring_settings.mib and to.ring and to.host == self.host):
            return None
        ring = self._rings.get(to.ring)
        if ring is None:
            try:
                ring = self._rings[to.ring] = ShmRing.attach(to.ring)
            except RingError as exc:
                self.log.warning("cannot attach KV ring %s (%s); using NATS frames", to.ring, exc)
                return None
        data = kv.view(torch.uint8).view(-1)
        if data.numel() > ring.capacity:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ring_settings.wait_s
        copies = self._copies.setdefault(to.ring, asyncio.Semaphore(self.ring_settings.copies))
        while True:
            async with copies:
                # From GPU memory straight into pinned slots, on a thread: the loop keeps serving.
                desc = await asyncio.to_thread(ring.try_write, data)
            if desc is not None:
                return RingSlots(**desc.to_wire())
            if loop.time() >= deadline:
                self.log.warning("KV ring %s still full after %.1f s; %s goes as NATS frames", to.ring,
                                 self.ring_settings.wait_s, request_id)
                return None
            await asyncio.sleep(RING_RETRY_S)

    async def _send_frames(self, kv: torch.Tensor, to: Destination) -> KVTransfer:
        blob = await asyncio.to_thread(lambda: tensor_bytes(to_host(kv)))  # a device copy: off the event loop
        # The checksums are computed as the frames go out, on the bulk connections' threads.
        return await self.channel.send(to.subject, blob, num_blocks=kv.shape[0], block_bytes=len(blob) // kv.shape[0])

    def close(self) -> None:
        """Detach from the rings attached so far (they stay their decode workers')."""
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()


class HandoffReceiver:
    """The decode side: this worker's ring (created here when ``ring.mib`` > 0) and the receiver of its
    KV frames; turns an admit's ring slots or transfer into KV blocks of this worker's layout.

    ``kv_shape`` and ``dtype``: one KV block as the engine holds it; ``kv_namespace``: the layout an
    admit's KV must have been made in. ``frames_blocks``: blocks of frames being reassembled at once
    at most; ``step_blocks``: the blocks one full prefill step hands off (a CUDA worker's ring holds
    two such steps, up to ``RING_AUTO_MAX_BYTES``)."""

    def __init__(self, worker_id: str, *, kv_namespace: str, kv_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, frames_blocks: int, step_blocks: int, ring: KVRingSettings,
                 log: logging.Logger = log) -> None:
        self.kv_namespace, self.kv_shape, self.dtype, self.device, self.log = kv_namespace, kv_shape, dtype, device, log
        self.block_bytes = torch.Size(kv_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.frames = KVReceiver(max_bytes_in_flight=frames_blocks * self.block_bytes)
        self.transfers = {"ring": 0, "nats": 0}  # hand-offs taken, by path
        self.ring: ShmRing | None = None
        self._ring_copies = threading.Semaphore(ring.copies)
        if ring.mib:
            slot = ring.slot_kib * 1024
            ring_bytes = ring.mib << 20
            if device.type == "cuda":
                # Room for two full prefill steps of hand-offs: an 8B model's 1k-token prompt is 134 MB,
                # and a hand-off that finds the ring full waits, then falls back to NATS frames.
                ring_bytes = max(ring_bytes, min(RING_AUTO_MAX_BYTES, 2 * step_blocks * self.block_bytes))
            label = re.sub(r"[^A-Za-z0-9_.]", "_", worker_id)[:64]  # ring labels allow fewer characters
            self.ring = ShmRing.create(label, slot_bytes=slot, num_slots=max(1, ring_bytes // slot))
            self.log.info("KV ring %s: %d MiB in %d KiB slots", self.ring.name, ring_bytes >> 20, ring.slot_kib)

    @property
    def ring_name(self) -> str:
        """What heartbeats advertise (with :attr:`host`): "" when this worker has no ring."""
        return self.ring.name if self.ring is not None else ""

    @property
    def host(self) -> str:
        return host_id()

    async def serve(self, channel: KVChannel, subject: str) -> None:
        """Land the KV frames sent to ``subject`` as they arrive (checksummed block by block)."""
        await channel.serve("kv", subject, self.frames)

    async def take(self, msg: DecodeRequest) -> torch.Tensor | None:
        """The prompt's KV blocks that came with ``msg`` (``[blocks, *kv_shape]``, from the ring or NATS
        frames), or None when none came. The ring is read on a thread (a 1k-token prompt of an 8B model
        is 134 MB); frames were reassembled and checksummed as they landed, taking them only compares
        the checksums. :class:`ProtocolError`: KV of another layout or another worker's ring
        (``invalid_request``), unusable slots or missing or corrupt frames (``bad_frame``)."""
        if msg.ring is not None:
            return await asyncio.to_thread(self._take, msg)
        return self._take(msg)

    def _take(self, msg: DecodeRequest) -> torch.Tensor | None:
        if (msg.ring or msg.transfer) and msg.kv_namespace != self.kv_namespace:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"KV blocks of layout {msg.kv_namespace!r} cannot enter a {self.kv_namespace!r} cache")
        if msg.ring is not None:
            if self.ring is None or msg.ring.ring != self.ring.name:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"ring {msg.ring.ring!r} is not this worker's")
            try:
                # On a GPU worker the slots go straight into device memory (pinned -> GPU DMA).
                staging = torch.empty(msg.ring.length, dtype=torch.uint8, device=self.device)
                # The ring is thread-safe; ``copies`` copies out of it at once keep the link busy.
                with self._ring_copies:
                    raw = self.ring.read(SlotDescriptor.from_wire(msg.ring.model_dump()), out=staging)
            except RingError as exc:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"ring slots unusable: {exc}") from None
            self.transfers["ring"] += 1
        elif msg.transfer is not None:
            raw = torch.frombuffer(self.frames.take(msg.transfer), dtype=torch.uint8)
            self.transfers["nats"] += 1
        else:
            return None
        if raw.numel() % self.block_bytes:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "KV bytes are not a whole number of this worker's blocks")
        return raw.view(self.dtype).view(raw.numel() // self.block_bytes, *self.kv_shape)

    def discard(self, msg: DecodeRequest) -> None:
        """Give back what a refused admit's KV holds here (its ring slots, its reassembled frames)."""
        try:
            if msg.ring is not None and self.ring is not None and msg.ring.ring == self.ring.name:
                desc = SlotDescriptor.from_wire(msg.ring.model_dump())
                self.ring.claim(desc)
                self.ring.release(desc)
            elif msg.transfer is not None:
                self.frames.take(msg.transfer)
        except Exception as exc:  # already gone, stale or incomplete: nothing left to give back
            self.log.debug("discarding %s's KV: %s", msg.spec.request_id, exc)

    async def reclaim_every(self, interval_s: float) -> None:
        """Forever: free the ring's slots of dead prefill workers, and those whose admit never came."""
        while True:
            await asyncio.sleep(interval_s)
            if self.ring is not None:
                self.ring.reclaim(stale_after_s=RING_STALE_S)

    def close(self) -> None:
        """Unlink the ring (a service leaves by os._exit, so atexit would not)."""
        if self.ring is not None:
            self.ring.close()
