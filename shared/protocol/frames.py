"""Binary KV frames: a small msgpack header plus raw tensor bytes, chunked under max_payload.

A transfer is the bytes of ``num_blocks`` KV blocks laid end to end (each block holds every layer,
see :mod:`tandem.shared.kvcache.cache`). The sender cuts it into frames that fit the server's
max_payload, keeps ``window`` frames in flight as NATS requests (each acknowledged, so a slow
receiver slows the sender instead of dropping frames), and then sends a :class:`DecodeRequest`
whose :class:`KVTransfer` lists one crc32 per block. The receiver reassembles the frames into one
buffer and verifies every block's checksum before anything reaches the engine. Never pickle.

Frame layout: ``>I`` header length | msgpack header | payload bytes.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib
from dataclasses import dataclass, field

import msgpack

from tandem.shared.protocol.base import SCHEMA_VERSION, ErrorCode, ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.kv import KVTransfer

_LEN = struct.Struct(">I")
FRAME_OVERHEAD = 512  # room for the header and NATS's own framing under max_payload


def pack_frame(header: dict, payload: bytes | memoryview) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return b"".join((_LEN.pack(len(head)), head, payload))


def unpack_frame(data: bytes) -> tuple[dict, memoryview]:
    """Split a frame; :class:`ProtocolError` for anything malformed."""
    if len(data) < _LEN.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame shorter than its length prefix")
    (head_len,) = _LEN.unpack_from(data)
    if head_len > len(data) - _LEN.size:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header length runs past the frame")
    try:
        header = msgpack.unpackb(data[_LEN.size : _LEN.size + head_len], raw=False)
    except Exception:
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header is not msgpack") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame header is not a map")
    if header.get("v") != SCHEMA_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"frame schema version {header.get('v')!r}")
    return header, memoryview(data)[_LEN.size + head_len :]



def block_checksums(blob: bytes | memoryview, block_bytes: int) -> list[int]:
    view = memoryview(blob)
    return [zlib.crc32(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


async def send_kv(nc, subject: str, transfer_id: str, blob: bytes | memoryview, *, window: int,
                  timeout_s: float) -> None:
    """Send ``blob`` as acknowledged frames, ``window`` at a time; raise on any refusal."""
    view = memoryview(blob)
    chunk = max(1, nc.max_payload - FRAME_OVERHEAD)
    total = len(view)
    sem = asyncio.Semaphore(window)

    async def send_one(offset: int) -> None:
        header = {"v": SCHEMA_VERSION, "kind": "kv_chunk", "transfer_id": transfer_id, "offset": offset,
                  "total_bytes": total}
        async with sem:
            reply = await nc.request(subject, pack_frame(header, view[offset : offset + chunk]), timeout=timeout_s)
        if reply.data != b"ok":
            err = decode(reply.data, ErrorReply)
            raise ProtocolError(ErrorCode(err.code), f"KV frame refused: {err.message}")

    await asyncio.gather(*(send_one(off) for off in range(0, total, chunk)))


@dataclass
class _Assembly:
    buffer: bytearray
    received: int = 0
    started: float = field(default_factory=time.monotonic)


class KVReceiver:
    """Reassembles transfers frame by frame; hands out verified bytes once, then forgets them."""

    def __init__(self, max_bytes_in_flight: int, stale_after_s: float = 60.0) -> None:
        self.max_bytes_in_flight = max_bytes_in_flight
        self.stale_after_s = stale_after_s
        self._assemblies: dict[str, _Assembly] = {}

    @property
    def bytes_in_flight(self) -> int:
        return sum(len(a.buffer) for a in self._assemblies.values())

    def on_frame(self, data: bytes) -> None:
        header, payload = unpack_frame(data)
        try:
            transfer_id, offset, total = str(header["transfer_id"]), int(header["offset"]), int(header["total_bytes"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(ErrorCode.BAD_SCHEMA, "kv frame header lacks transfer_id/offset/total_bytes") from None
        assembly = self._assemblies.get(transfer_id)
        if assembly is None:
            self.drop_stale()
            if total <= 0 or self.bytes_in_flight + total > self.max_bytes_in_flight:
                raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                    f"kv transfer of {total} bytes does not fit the receive buffer")
            assembly = self._assemblies[transfer_id] = _Assembly(bytearray(total))
        if len(assembly.buffer) != total or offset < 0 or offset + len(payload) > total:
            raise ProtocolError(ErrorCode.BAD_FRAME, "kv frame range lies outside its transfer")
        assembly.buffer[offset : offset + len(payload)] = payload
        assembly.received += len(payload)

    def take(self, transfer: KVTransfer) -> bytearray:
        """The transfer's bytes, checked block by block; raises (and forgets it) when incomplete or corrupt."""
        assembly = self._assemblies.pop(transfer.transfer_id, None)
        if assembly is None:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"no kv frames arrived for transfer {transfer.transfer_id}")
        expected = transfer.num_blocks * transfer.block_bytes
        if len(assembly.buffer) != expected or assembly.received != expected:
            raise ProtocolError(
                ErrorCode.BAD_FRAME, f"transfer {transfer.transfer_id}: {assembly.received} of {expected} bytes arrived"
            )
        sums = block_checksums(assembly.buffer, transfer.block_bytes)
        bad = [i for i, (got, want) in enumerate(zip(sums, transfer.checksums)) if got != want]
        if bad or len(sums) != len(transfer.checksums):
            raise ProtocolError(ErrorCode.BAD_FRAME,
                                f"transfer {transfer.transfer_id}: checksum mismatch in blocks {bad}")
        return assembly.buffer

    def drop_stale(self) -> None:
        now = time.monotonic()
        for tid in [t for t, a in self._assemblies.items() if now - a.started > self.stale_after_s]:
            del self._assemblies[tid]
