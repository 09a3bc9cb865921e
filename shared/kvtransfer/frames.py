"""Binary KV frames: a small msgpack header plus raw KV bytes, streamed under credit-based flow control.

A transfer is the bytes of ``num_blocks`` KV blocks laid end to end (each block holds every layer,
see :mod:`tandem.shared.kvcache.cache`). :func:`send_kv` cuts it into frames as large as the
server's max_payload allows (whole blocks per frame when a block fits) and publishes them without
waiting for a reply to each: every frame names a per-transfer inbox as its reply subject, and the
receiver sends a :class:`KVCredit` there, saying how many bytes it has landed and checksummed, every
``ack_every`` bytes and at the end. The sender keeps at most ``window`` frames' bytes uncredited, so
a slow receiver slows the sender and nothing piles up in the server (which cuts off a subscriber
that falls too far behind); it returns once every byte is credited, so the :class:`DecodeRequest`
(or put) that follows on another connection never overtakes its frames. One round trip comes
first: a payload-less ``kv_probe`` frame sent as a request, so nobody listening fails at once
(nats-py's ``NoRespondersError``), a receiver without room refuses before any byte moves, and the
credit inbox is known to the server. A frame the receiver refuses comes back as an
:class:`ErrorReply` on the credit inbox and fails the send with its code; a frame that never
arrives fails it with ``timeout`` after ``timeout_s`` without credit.

The crc32 of each block is computed by the sender once the frame that starts it is out, and by the
receiver as the block lands (on the bulk connection's reader thread, or on a pool of check threads
beside it while the reader goes on to the next frame); a credit counts only checked bytes.
:func:`send_kv` returns the sender's for the :class:`KVTransfer` that follows, and
:meth:`KVReceiver.take` compares them with its own before anything reaches the engine, so a lost,
repeated or corrupted frame is a typed :class:`ProtocolError`, never wrong KV.

Frames go over the service's nats-py connection, or over a :class:`FramePublisher` of bulk
connections (:mod:`tandem.shared.kvtransfer.bulklinks`) that write and read them in place, off the event
loop; either end may use either, the wire is the same. :class:`KVReceiver` takes a frame whole
(:meth:`KVReceiver.on_frame`, a nats-py message) or streamed (:meth:`KVReceiver.on_stream`, read
from the socket straight into the transfer's buffer). Services send and land frames through their
:class:`tandem.shared.kvtransfer.channel.KVChannel`.

Frame layout: ``>I`` header length | msgpack header | payload bytes. The header: ``v``
(``SCHEMA_VERSION``), ``kind`` (``kv_frame``), ``transfer_id``, ``offset``, ``total_bytes``,
``chunk`` (the payload size of every frame but the last), ``block_bytes`` (for checksums on
arrival) and ``ack_every`` (bytes per credit). A frame without ``chunk``/``ack_every`` is the older
form (one request per frame), answered ``b"ok"`` on its own; a credit of ``b"ok"`` likewise counts
one frame, so either side may be the older one. Never pickle.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Annotated, Literal, Protocol

import msgpack
from pydantic import Field, TypeAdapter, ValidationError

from tandem.shared.protocol.base import SCHEMA_VERSION, ErrorCode, ErrorReply, ProtocolError, WireMessage
from tandem.shared.protocol.kv import KVTransfer

log = logging.getLogger("tandem.frames")

_LEN = struct.Struct(">I")
FRAME_OVERHEAD = 512  # room for the header and NATS's own framing under max_payload
MAX_HEADER_BYTES = 4096  # a frame header is ~100 bytes; more is not a frame
FRAME_KIND = "kv_frame"
PROBE_KIND = "kv_probe"  # a frame with no payload, sent as a request before the others: is anyone there?
LEGACY_OK = b"ok"  # the older per-frame acknowledgement, in both directions

Buffer = bytes | bytearray | memoryview


class KVCredit(WireMessage):
    """Receiver to sender: the first ``received`` bytes' worth of the transfer's frames have landed
    and their completed blocks are checksummed (a count, not an offset: frames land in any order)."""

    kind: Literal["kv_credit"] = "kv_credit"
    transfer_id: str
    received: int = Field(ge=0)


_credit_or_error: TypeAdapter[KVCredit | ErrorReply] = TypeAdapter(
    Annotated[KVCredit | ErrorReply, Field(discriminator="kind")])


def encode_reply(message: KVCredit | ErrorReply) -> bytes:
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def error_payload(exc: ProtocolError) -> bytes:
    """What a receiver sends back for a frame it refuses."""
    return encode_reply(ErrorReply(code=exc.code, message=exc.message[:500]))


# -- the wire format --------------------------------------------------------------------------------
def frame_head(header: dict) -> bytes:
    """The bytes in front of a frame's payload: length prefix and msgpack header."""
    head = msgpack.packb(header, use_bin_type=True)
    return _LEN.pack(len(head)) + head


def pack_frame(header: dict, payload: Buffer) -> bytes:
    """A whole frame in one buffer (the nats-py path and tests; bulk connections send the parts)."""
    return b"".join((frame_head(header), payload))


def _header_map(head: Buffer) -> dict:
    try:
        header = msgpack.unpackb(head, raw=False)
    except Exception:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header is not msgpack") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header is not a map")
    if header.get("v") != SCHEMA_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"frame schema version {header.get('v')!r}")
    return header


def unpack_frame(data: Buffer) -> tuple[dict, memoryview]:
    """Split a frame; :class:`ProtocolError` for anything malformed."""
    if len(data) < _LEN.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame shorter than its length prefix")
    (head_len,) = _LEN.unpack_from(data)
    if head_len > len(data) - _LEN.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header length runs past the frame")
    view = memoryview(data)
    return _header_map(view[_LEN.size : _LEN.size + head_len]), view[_LEN.size + head_len :]


@dataclass(frozen=True)
class FrameHeader:
    transfer_id: str
    offset: int
    total_bytes: int
    chunk: int = 0  # 0: the older form, frames of any size at any offset
    block_bytes: int = 0  # 0: checksums only at take()
    ack_every: int = 0  # 0: the older form, b"ok" per frame

    @classmethod
    def parse(cls, header: dict) -> FrameHeader:
        try:
            fields = cls(str(header["transfer_id"]), int(header["offset"]), int(header["total_bytes"]),
                         int(header.get("chunk", 0)), int(header.get("block_bytes", 0)),
                         int(header.get("ack_every", 0)))
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise ProtocolError(ErrorCode.BAD_SCHEMA, "kv frame header lacks transfer_id/offset/total_bytes") from None
        if min(fields.chunk, fields.block_bytes, fields.ack_every) < 0:
            raise ProtocolError(ErrorCode.BAD_SCHEMA, "kv frame header has a negative size")
        return fields


def frame_payload_bytes(max_payload: int, block_bytes: int = 0) -> int:
    """Payload bytes per frame under ``max_payload``: whole blocks when one fits (a frame then completes
    its own blocks, whose checksums the receiver computes while they are still in cache)."""
    room = max(1, max_payload - FRAME_OVERHEAD)
    return room // block_bytes * block_bytes if 0 < block_bytes <= room else room


def block_checksums(blob: Buffer, block_bytes: int) -> list[int]:
    view = memoryview(blob).cast("B")
    return [zlib.crc32(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


# -- sending ----------------------------------------------------------------------------------------
class FramePublisher(Protocol):
    """Somewhere to publish frames from other than the event loop (bulk connections)."""

    @property
    def max_payload(self) -> int: ...

    @property
    def usable(self) -> bool:
        """Whether it can publish now (False: send over nats-py instead)."""

    async def publish(self, subject: str, parts: Sequence[Buffer], reply: str,
                      then: Callable[[], None] | None = None) -> None:
        """Publish ``parts`` as one message, then run ``then``, both off the event loop."""


class _Credits:
    """The sender's view of one transfer's credits, fed by its inbox subscription."""

    def __init__(self, transfer_id: str, total: int, chunk: int, subject: str) -> None:
        self.transfer_id, self.total, self.chunk, self.subject = transfer_id, total, chunk, subject
        self.received = 0
        self.legacy_oks = 0
        self.error: ProtocolError | None = None
        self.changed = asyncio.Event()

    async def on_reply(self, msg) -> None:
        headers = getattr(msg, "headers", None) or {}
        if headers.get("Status") == "503":  # the server's answer to a publish with a reply: nobody subscribes
            self.error = ProtocolError(ErrorCode.INVALID_REQUEST, f"nobody listens on {self.subject}")
        elif msg.data == LEGACY_OK:  # an older receiver: one frame landed
            self.legacy_oks += 1
            self.received = max(self.received, min(self.total, self.legacy_oks * self.chunk))
        else:
            try:
                reply = _credit_or_error.validate_python(msgpack.unpackb(msg.data, raw=False))
            except (ValidationError, ValueError, msgpack.UnpackException):
                reply = None  # not ours: ignore it rather than fail a good transfer
            if isinstance(reply, ErrorReply):
                self.error = ProtocolError(reply.code, f"KV frame refused: {reply.message}")
            elif isinstance(reply, KVCredit) and reply.transfer_id == self.transfer_id:
                self.received = max(self.received, min(reply.received, self.total))
        self.changed.set()

    async def wait_for(self, received: int, timeout_s: float) -> None:
        """Until ``received`` bytes are credited; raises the receiver's refusal, or ``timeout`` when
        no credit came for ``timeout_s``."""
        while self.error is None and self.received < received:
            self.changed.clear()
            before = self.received
            try:
                await asyncio.wait_for(self.changed.wait(), timeout_s)
            except TimeoutError:
                if self.received == before and self.error is None:
                    raise ProtocolError(
                        ErrorCode.TIMEOUT, f"{self.subject} credited {self.received} of {self.total} bytes of KV "
                                           f"transfer {self.transfer_id}, then nothing for {timeout_s:.0f}s") from None
        if self.error is not None:
            raise self.error


async def send_kv(nc, subject: str, transfer_id: str, blob: Buffer, *, window: int, timeout_s: float,
                  block_bytes: int = 0, links: FramePublisher | None = None) -> list[int]:
    """Send ``blob`` as frames with at most ``window`` frames' bytes uncredited; return once the
    receiver has credited every byte, with the crc32 of each ``block_bytes`` block (``[]`` when 0).
    Frames go over ``links`` when given, else over ``nc``; credits always come back over ``nc``.
    Raises :class:`ProtocolError`: the receiver's refusal, ``invalid_request`` when the receiver went
    away, ``timeout`` when credits stop; nats-py's ``NoRespondersError`` when nobody listens on
    ``subject`` at the start, its ``TimeoutError`` when nobody answers then."""
    view = memoryview(blob).cast("B")
    total = len(view)
    if total == 0:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "an empty KV transfer")
    if links is not None and not links.usable:  # every bulk connection is down (a server restart): nats-py
        links = None
    chunk = frame_payload_bytes(links.max_payload if links is not None else nc.max_payload, block_bytes)
    window_bytes = max(1, window) * chunk
    # A credit every half window keeps the pipe full. Whole frames per credit: the receiver's last
    # credit then always lies within a half window of what it landed, so the sender never waits on
    # a credit that no frame in flight can trigger.
    ack_every = max(1, window // 2) * chunk
    sums = [0] * (-(-total // block_bytes) if block_bytes else 0)
    credits = _Credits(transfer_id, total, chunk, subject)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=credits.on_reply)
    header = {"v": SCHEMA_VERSION, "kind": FRAME_KIND, "transfer_id": transfer_id, "total_bytes": total,
              "chunk": chunk, "block_bytes": block_bytes, "ack_every": ack_every}
    try:
        # One round trip before the bytes: nobody listening is nats-py's NoRespondersError at once (frames
        # published on other connections would just vanish), a receiver without room refuses here, and
        # the server has the inbox's subscription before any credit can come back (it reads a
        # connection's commands in order).
        probe = await nc.request(subject, frame_head({**header, "kind": PROBE_KIND, "offset": 0}), timeout=timeout_s)
        if probe.data != LEGACY_OK:  # an older receiver lands the empty probe and says ok
            try:
                answer = _credit_or_error.validate_python(msgpack.unpackb(probe.data, raw=False))
            except (ValidationError, ValueError, msgpack.UnpackException):
                raise ProtocolError(ErrorCode.BAD_FRAME, f"{subject} answered a KV probe with garbage") from None
            if isinstance(answer, ErrorReply):
                raise ProtocolError(answer.code, f"KV transfer refused: {answer.message}")
    except BaseException:
        await sub.unsubscribe()
        raise

    def checksum(offset: int, end: int) -> None:
        """crc32 of the blocks starting in [offset, end): each block once, by the frame it starts in."""
        for b in range(-(-offset // block_bytes), -(-end // block_bytes)):
            sums[b] = zlib.crc32(view[b * block_bytes : (b + 1) * block_bytes])

    sending: set[asyncio.Task] = set()
    try:
        for offset in range(0, total, chunk):
            end = min(total, offset + chunk)
            await credits.wait_for(end - window_bytes, timeout_s)  # room for this frame in the window
            for task in [t for t in sending if t.done()]:
                sending.discard(task)
                task.result()  # a failed publish fails the transfer now
            parts = (frame_head({**header, "offset": offset}), view[offset:end])
            # Checksums after the frame is out, so they overlap its landing at the receiver instead
            # of delaying it; zlib lets go of the GIL, so they run beside the loop and each other.
            then = (lambda o=offset, e=end: checksum(o, e)) if block_bytes else None
            if links is not None:
                sending.add(asyncio.ensure_future(links.publish(subject, parts, inbox, then)))
            else:
                await nc.publish(subject, b"".join(parts), reply=inbox)
                if then is not None:
                    sending.add(asyncio.ensure_future(asyncio.to_thread(then)))
        if sending:
            await asyncio.gather(*sending)
        await credits.wait_for(total, timeout_s)
    finally:
        for task in sending:
            task.cancel()
        try:
            await sub.unsubscribe()
        except Exception:  # the connection went away: nothing left to unsubscribe from
            pass
    return sums


# -- receiving --------------------------------------------------------------------------------------
class FrameReader(Protocol):
    """A streamed frame's bytes, read in place (a bulk connection's :class:`PayloadReader`)."""

    def readinto(self, view: memoryview) -> None: ...

    def read(self, n: int) -> bytes: ...


_FREE, _LANDING, _LANDED = 0, 1, 2


@dataclass
class _Assembly:
    size: int
    form: FrameHeader  # the first frame's sizes, which every later frame must repeat
    frames: bytearray  # per frame (chunked form): _FREE, _LANDING or _LANDED
    block_landed: list[int]  # bytes landed per block (checksums on arrival)
    sums: list[int | None]
    buffer: bytearray | None = None  # made by the first frame's thread, outside the lock
    ready: threading.Event = field(default_factory=threading.Event)
    received: int = 0  # bytes landed, with every block they completed checksummed
    credited: int = 0  # received // ack_every when the last credit went out
    started: float = field(default_factory=time.monotonic)


class _FrameCheck:
    """One streamed frame's blocks being checksummed on a pool: the last one checked lands the frame
    and sends its reply (a frame that failed to arrive whole never has its last block checked)."""

    def __init__(self, receiver: KVReceiver, assembly: _Assembly, form: FrameHeader, length: int, index: int,
                 answer: Callable[[bytes], None], blocks: int) -> None:
        self.receiver, self.assembly, self.form, self.length, self.index = receiver, assembly, form, length, index
        self.answer, self.left = answer, blocks
        self.sums: dict[int, int] = {}
        self._lock = threading.Lock()

    def block(self, b: int, view: memoryview) -> None:
        crc = zlib.crc32(view)
        with self._lock:
            self.sums[b] = crc
            self.left -= 1
            last = self.left == 0
        if not last:
            return
        try:
            reply = self.receiver._landed(self.assembly, self.form, self.length, self.index, self.sums)
            if reply is not None:
                self.answer(reply)
        except Exception:  # the connection broke: its sender sees the transfer fail; nothing to answer on
            log.warning("KV frame of transfer %s landed but its reply failed", self.form.transfer_id, exc_info=True)


class KVReceiver:
    """Reassembles transfers frame by frame into one preallocated buffer each, checksumming blocks as
    they complete; hands out verified bytes once, then forgets them. Thread-safe: bulk connections
    land frames from their reader threads while the event loop takes finished transfers."""

    def __init__(self, max_bytes_in_flight: int, stale_after_s: float = 60.0) -> None:
        self.max_bytes_in_flight = max_bytes_in_flight
        self.stale_after_s = stale_after_s
        self._assemblies: dict[str, _Assembly] = {}
        self._lock = threading.Lock()

    @property
    def bytes_in_flight(self) -> int:
        with self._lock:
            return sum(a.size for a in self._assemblies.values())

    def received(self, transfer_id: str) -> int:
        """Bytes of ``transfer_id`` landed (and checked) so far; 0 for one not (or no longer) here."""
        with self._lock:
            assembly = self._assemblies.get(transfer_id)
            return assembly.received if assembly is not None else 0

    def answer(self, data: Buffer) -> bytes | None:
        """:meth:`on_frame` for a plain subscription: a refused frame's reply is its typed error."""
        try:
            return self.on_frame(data)
        except ProtocolError as exc:
            return error_payload(exc)

    def on_frame(self, data: Buffer) -> bytes | None:
        """Land one whole frame; returns the reply to send to its reply subject (a credit, ``b"ok"``
        for the older form), or None. Raises :class:`ProtocolError` for a frame it refuses."""
        header, payload = unpack_frame(data)
        form = FrameHeader.parse(header)
        if header.get("kind") == PROBE_KIND:
            return self._probe(form)
        assembly, dest, index = self._claim(form, len(payload))
        try:
            dest[:] = payload
        except BaseException:
            self._release(assembly, index)
            raise
        return self._landed(assembly, form, len(payload), index, {})

    def on_stream(self, size: int, reader: FrameReader, checker: Executor | None = None,
                  answer: Callable[[bytes], None] | None = None) -> bytes | None:
        """Land one frame of ``size`` bytes read from ``reader``, its payload straight into the transfer's
        buffer (the caller skips what is left unread when this raises); as :meth:`on_frame` otherwise.
        Given a ``checker`` pool and ``answer``, a frame of whole blocks returns None once its bytes are
        in: the pool checksums each block as it lands while the caller reads on, and the frame's reply
        goes to ``answer`` from the pool's thread that checks its last block."""
        if size < _LEN.size:
            raise ProtocolError(ErrorCode.BAD_FRAME, "frame shorter than its length prefix")
        (head_len,) = _LEN.unpack(reader.read(_LEN.size))
        if head_len > min(size - _LEN.size, MAX_HEADER_BYTES):
            raise ProtocolError(ErrorCode.BAD_FRAME, "frame header length runs past the frame")
        header = _header_map(reader.read(head_len))
        form = FrameHeader.parse(header)
        if header.get("kind") == PROBE_KIND:
            return self._probe(form)
        length = size - _LEN.size - head_len
        assembly, dest, index = self._claim(form, length)
        bb, sums = form.block_bytes, {}
        whole_blocks = bb and form.offset % bb == 0 and (length % bb == 0 or form.offset + length == form.total_bytes)
        check = None
        if whole_blocks and checker is not None and answer is not None:
            check = _FrameCheck(self, assembly, form, length, index, answer, blocks=-(-length // bb))
        try:
            if whole_blocks:
                # Each block checksummed right after it lands, while it is still in cache.
                for start in range(0, length, bb):
                    block, b = dest[start : start + bb], (form.offset + start) // bb
                    reader.readinto(block)
                    if check is not None:
                        checker.submit(check.block, b, block)
                    else:
                        sums[b] = zlib.crc32(block)
            else:
                reader.readinto(dest)
        except BaseException:
            self._release(assembly, index)
            raise
        if check is not None:
            return None
        return self._landed(assembly, form, length, index, sums)

    def _probe(self, form: FrameHeader) -> bytes:
        """A sender asking before it streams: a zero credit, or the refusal its first frame would get."""
        with self._lock:
            if form.transfer_id not in self._assemblies:
                self._drop_stale()
                if sum(a.size for a in self._assemblies.values()) + form.total_bytes > self.max_bytes_in_flight:
                    raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                        f"kv transfer of {form.total_bytes} bytes does not fit the receive buffer")
        return encode_reply(KVCredit(transfer_id=form.transfer_id, received=0))

    def _claim(self, form: FrameHeader, length: int) -> tuple[_Assembly, memoryview, int]:
        """The transfer's assembly (made on its first frame) and where this frame's payload goes."""
        with self._lock:
            assembly = self._assemblies.get(form.transfer_id)
            making = assembly is None
            if making:
                self._drop_stale()
                total = form.total_bytes
                if total <= 0 or sum(a.size for a in self._assemblies.values()) + total > self.max_bytes_in_flight:
                    raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                        f"kv transfer of {total} bytes does not fit the receive buffer")
                if bool(form.chunk) != bool(form.ack_every):
                    raise ProtocolError(ErrorCode.BAD_SCHEMA, "kv frame header: chunk and ack_every go together")
                blocks = -(-total // form.block_bytes) if form.block_bytes else 0
                frames = -(-total // form.chunk) if form.chunk else 0
                if max(blocks, frames) > max(64, total // 256):  # bookkeeping must stay small beside the bytes
                    raise ProtocolError(ErrorCode.INVALID_REQUEST, "kv frame header: blocks or frames too small")
                assembly = _Assembly(total, form, bytearray(frames), [0] * blocks, [None] * blocks)
                self._assemblies[form.transfer_id] = assembly
            first = assembly.form
            if (first.total_bytes, first.chunk, first.block_bytes, first.ack_every) != (
                    form.total_bytes, form.chunk, form.block_bytes, form.ack_every):
                raise ProtocolError(ErrorCode.BAD_FRAME, "kv frame sizes differ from its transfer's first frame")
            offset, total = form.offset, form.total_bytes
            if offset < 0 or offset + length > total:
                if making:
                    del self._assemblies[form.transfer_id]
                raise ProtocolError(ErrorCode.BAD_FRAME, "kv frame range lies outside its transfer")
            index = -1
            if form.chunk:  # frames on a fixed grid: each lands once
                if offset % form.chunk or length != min(form.chunk, total - offset):
                    if making:
                        del self._assemblies[form.transfer_id]
                    raise ProtocolError(ErrorCode.BAD_FRAME, "kv frame is off its transfer's frame grid")
                index = offset // form.chunk
                if assembly.frames[index] != _FREE:
                    raise ProtocolError(ErrorCode.BAD_FRAME, f"kv frame at offset {offset} arrived twice")
                assembly.frames[index] = _LANDING
        if making:
            # Outside the lock: zeroing a 128 MiB buffer must not hold up the frames of other transfers.
            try:
                assembly.buffer = bytearray(assembly.size)
            except MemoryError:
                with self._lock:
                    self._assemblies.pop(form.transfer_id, None)
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"no memory for a {total}-byte kv transfer") from None
            finally:
                assembly.ready.set()
        else:
            assembly.ready.wait()
            if assembly.buffer is None:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"no memory for a {total}-byte kv transfer")
        return assembly, memoryview(assembly.buffer)[offset : offset + length], index

    def _release(self, assembly: _Assembly, index: int) -> None:
        """A frame that failed halfway: its slot may be sent again."""
        if index >= 0:
            with self._lock:
                assembly.frames[index] = _FREE

    def _landed(self, assembly: _Assembly, form: FrameHeader, length: int, index: int,
                sums: dict[int, int]) -> bytes | None:
        """Count a landed frame, checksum the blocks it completed (``sums``: those already done), and
        say what to reply."""
        bb = form.block_bytes
        done: list[int] = []
        with self._lock:
            if bb:
                total = form.total_bytes
                for b in range(form.offset // bb, (form.offset + length - 1) // bb + 1):
                    start, end = b * bb, min(total, (b + 1) * bb)
                    assembly.block_landed[b] += min(end, form.offset + length) - max(start, form.offset)
                    if assembly.block_landed[b] == end - start:
                        done.append(b)
        view = memoryview(assembly.buffer)
        for b in done:  # outside the lock: zlib lets go of the GIL, other frames land meanwhile
            assembly.sums[b] = sums[b] if b in sums else zlib.crc32(view[b * bb : (b + 1) * bb])
        with self._lock:
            if index >= 0:
                assembly.frames[index] = _LANDED
            assembly.received += length
            if not form.ack_every:
                return LEGACY_OK
            mark = assembly.received // form.ack_every
            if assembly.received < form.total_bytes and mark <= assembly.credited:
                return None
            assembly.credited = mark
            received = assembly.received
        return encode_reply(KVCredit(transfer_id=form.transfer_id, received=received))

    def take(self, transfer: KVTransfer) -> bytearray:
        """The transfer's bytes, checked block by block; raises (and forgets it) when incomplete or corrupt."""
        with self._lock:
            assembly = self._assemblies.pop(transfer.transfer_id, None)
        if assembly is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"no kv frames arrived for transfer {transfer.transfer_id}")
        expected = transfer.num_blocks * transfer.block_bytes
        if assembly.size != expected or assembly.received != expected:
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"transfer {transfer.transfer_id}: {assembly.received} of {expected} bytes arrived"
            )
        if assembly.form.block_bytes == transfer.block_bytes and None not in assembly.sums:
            sums = assembly.sums  # computed as the blocks landed
        else:  # the older form, or frames that named other blocks than the transfer does
            sums = block_checksums(assembly.buffer, transfer.block_bytes)
        bad = [i for i, (got, want) in enumerate(zip(sums, transfer.checksums)) if got != want]
        if bad or len(sums) != len(transfer.checksums):
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"transfer {transfer.transfer_id}: checksum mismatch in blocks {bad[:20]}")
        return assembly.buffer

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for tid in [t for t, a in self._assemblies.items() if now - a.started > self.stale_after_s]:
            del self._assemblies[tid]
