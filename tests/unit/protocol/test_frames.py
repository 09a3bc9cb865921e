"""KV frames without a network: :class:`KVReceiver` reassembles frames that arrive in any order,
whole (nats-py) or streamed (bulk connections), checksums each block as it completes, credits the
sender at whole-frame steps, and turns every lost, repeated, corrupt or malformed frame into a
typed :class:`ProtocolError` that touches no other transfer. The same frames over a real
nats-server, with flow control, bulk connections and auth, are in ``tests/e2e/test_kv_frames.py``."""

from __future__ import annotations

import random
import threading
import zlib
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import msgpack
import pytest

from tandem.shared.kvtransfer.frames import (
    FRAME_KIND,
    LEGACY_OK,
    KVCredit,
    KVReceiver,
    block_checksums,
    frame_head,
    frame_payload_bytes,
    pack_frame,
    unpack_frame,
)
from tandem.shared.protocol.base import SCHEMA_VERSION, ErrorCode, ProtocolError
from tandem.shared.protocol.kv import KVTransfer

KIB = 1024


class BytesReader:
    """A streamed frame as a bulk connection hands it over (``PayloadReader``), from bytes;
    ``fail_after`` bytes in, the socket breaks."""

    def __init__(self, data: bytes, fail_after: int | None = None) -> None:
        self.data, self.pos, self.fail_after = data, 0, fail_after

    def readinto(self, view: memoryview) -> None:
        if self.fail_after is not None and self.pos + len(view) > self.fail_after:
            raise OSError("connection reset mid-frame")
        view[:] = self.data[self.pos : self.pos + len(view)]
        self.pos += len(view)

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        self.readinto(memoryview(out))
        return bytes(out)


def frames_of(tid: str, blob: bytes, chunk: int, block_bytes: int, window: int = 4) -> list[bytes]:
    """The frames ``send_kv`` would publish for ``blob``."""
    header = {"v": SCHEMA_VERSION, "kind": FRAME_KIND, "transfer_id": tid, "total_bytes": len(blob), "chunk": chunk,
              "block_bytes": block_bytes, "ack_every": max(1, window // 2) * chunk}
    return [frame_head({**header, "offset": off}) + blob[off : off + chunk] for off in range(0, len(blob), chunk)]


# How a frame reaches the receiver: whole (a nats-py message), streamed from a bulk connection and
# checked by the reading thread, or streamed with its blocks checked on a pool of threads.
ARRIVALS = ["whole", "streamed", "pooled"]


def land(receiver: KVReceiver, frame: bytes, arrival: str) -> bytes | None:
    """Land one frame; its reply, waited for when it comes from the pool."""
    if arrival == "whole":
        return receiver.on_frame(frame)
    if arrival == "streamed":
        return receiver.on_stream(len(frame), BytesReader(frame))
    answers: list[bytes] = []
    with ThreadPoolExecutor(3) as pool:  # leaving it waits for the frame's checks
        reply = receiver.on_stream(len(frame), BytesReader(frame), pool, answers.append)
    assert reply is None or not answers, "a frame was answered twice: by on_stream and from the pool"
    return answers[0] if answers else reply


def transfer_for(tid: str, blob: bytes, block_bytes: int) -> KVTransfer:
    return KVTransfer(transfer_id=tid, num_blocks=len(blob) // block_bytes, block_bytes=block_bytes,
                      checksums=block_checksums(blob, block_bytes))


def credit(reply: bytes | None) -> int | None:
    return None if reply is None else KVCredit(**msgpack.unpackb(reply)).received


# (total, block bytes, max_payload): blocks in whole frames, a block across frames, one frame for all
SHAPES = [(24 * 64 * KIB, 64 * KIB, 256 * KIB), (6 * 256 * KIB, 256 * KIB, 100 * KIB), (4 * 4 * KIB, 4 * KIB, 1 << 20)]


@pytest.mark.parametrize("arrival", ARRIVALS)
@pytest.mark.parametrize("order", ["in order", "shuffled", "reversed"])
@pytest.mark.parametrize("total,block_bytes,max_payload", SHAPES, ids=["blocks-in-frames", "block-spans-frames",
                                                                       "one-frame"])
def test_frames_reassemble_in_any_order(total, block_bytes, max_payload, order, arrival) -> None:
    blob = random.Random(total).randbytes(total)
    chunk = frame_payload_bytes(max_payload, block_bytes)
    frames = frames_of("t1", blob, chunk, block_bytes)
    sequence = list(range(len(frames)))
    if order == "shuffled":
        random.Random(7).shuffle(sequence)
    elif order == "reversed":
        sequence.reverse()
    receiver = KVReceiver(max_bytes_in_flight=total)
    credits = []
    for n, i in enumerate(sequence, 1):
        got = credit(land(receiver, frames[i], arrival))
        landed = sum(min(chunk, total - j * chunk) for j in sequence[:n])
        assert got is None or got == landed, f"a credit must count exactly the bytes landed ({got} != {landed})"
        credits.append(got)
    assert credits[-1] == total, f"the last frame must credit the whole transfer, got {credits}"
    out = receiver.take(transfer_for("t1", blob, block_bytes))
    assert bytes(out) == blob, "reassembled bytes differ from what was sent"
    assert receiver.bytes_in_flight == 0, "a taken transfer must be forgotten"


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_credits_come_at_whole_frame_steps_so_a_full_window_always_moves(window) -> None:
    """A sender with ``window`` frames out waits for a credit no older than that; one must come
    within every half window of frames landed, whatever the window."""
    chunk, frames_n = 4 * KIB, 20
    blob = bytes(chunk * frames_n)
    receiver = KVReceiver(max_bytes_in_flight=len(blob))
    credited = 0
    for i, frame in enumerate(frames_of("w", blob, chunk, chunk, window)):
        got = credit(receiver.on_frame(frame))
        credited = got if got is not None else credited
        landed = (i + 1) * chunk
        assert landed - credited < max(1, window // 2) * chunk, (
            f"window {window}: {landed - credited} bytes landed without a credit")
    assert credited == len(blob)


@pytest.mark.parametrize("arrival", ARRIVALS)
def test_a_missing_frame_is_a_typed_error_at_take(arrival) -> None:
    blob = random.Random(1).randbytes(8 * 16 * KIB)
    receiver = KVReceiver(max_bytes_in_flight=len(blob))
    for i, frame in enumerate(frames_of("gap", blob, 32 * KIB, 16 * KIB)):
        if i != 2:
            land(receiver, frame, arrival)
    with pytest.raises(ProtocolError) as err:
        receiver.take(transfer_for("gap", blob, 16 * KIB))
    assert err.value.code == ErrorCode.BAD_FRAME and "bytes arrived" in err.value.message, err.value
    assert receiver.bytes_in_flight == 0, "a refused transfer must be forgotten too"


@pytest.mark.parametrize("arrival", ARRIVALS)
@pytest.mark.parametrize("where,block", [("first byte", 2), ("middle", 3), ("last byte", 3)])
def test_a_corrupt_frame_is_a_typed_error_at_take(where, block, arrival) -> None:
    """Frame 1 holds blocks 2 and 3; the block a flipped bit lies in is named."""
    blob = random.Random(2).randbytes(8 * 16 * KIB)
    frames = frames_of("bent", blob, 32 * KIB, 16 * KIB)
    victim = bytearray(frames[1])
    _, payload = unpack_frame(bytes(victim))
    head = len(victim) - len(payload)
    victim[{"first byte": head, "middle": head + len(payload) // 2, "last byte": len(victim) - 1}[where]] ^= 0x40
    frames[1] = bytes(victim)
    receiver = KVReceiver(max_bytes_in_flight=len(blob))
    for frame in frames:
        land(receiver, frame, arrival)
    with pytest.raises(ProtocolError) as err:
        receiver.take(transfer_for("bent", blob, 16 * KIB))
    assert err.value.code == ErrorCode.BAD_FRAME and f"checksum mismatch in blocks [{block}]" in err.value.message, (
        err.value)


def test_a_repeated_frame_is_refused_and_the_transfer_still_completes() -> None:
    blob = random.Random(3).randbytes(4 * 16 * KIB)
    frames = frames_of("twice", blob, 16 * KIB, 16 * KIB)
    receiver = KVReceiver(max_bytes_in_flight=len(blob))
    receiver.on_frame(frames[0])
    with pytest.raises(ProtocolError) as err:
        receiver.on_frame(frames[0])
    assert err.value.code == ErrorCode.BAD_FRAME and "twice" in err.value.message, err.value
    for frame in frames[1:]:
        receiver.on_frame(frame)
    assert bytes(receiver.take(transfer_for("twice", blob, 16 * KIB))) == blob


@pytest.mark.parametrize("arrival", ["streamed", "pooled"])
def test_a_frame_broken_off_mid_stream_can_be_sent_again(arrival) -> None:
    blob = random.Random(4).randbytes(2 * 16 * KIB)
    frames = frames_of("retry", blob, 16 * KIB, 4 * KIB)  # four blocks a frame: three land before the break
    receiver = KVReceiver(max_bytes_in_flight=len(blob))
    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError):
        deferred = (pool, lambda reply: pytest.fail("a broken frame was answered")) if arrival == "pooled" else ()
        receiver.on_stream(len(frames[0]), BytesReader(frames[0], fail_after=len(frames[0]) - 100), *deferred)
    assert receiver.received("retry") == 0, "a frame broken off mid-stream must not count as landed"
    for frame in frames:
        land(receiver, frame, arrival)
    assert receiver.received("retry") == len(blob), "the frame sent again must count once"
    assert bytes(receiver.take(transfer_for("retry", blob, 4 * KIB))) == blob


class HeldPool(Executor):
    """A check pool that runs nothing until ``run``: what the receiver does before its checks finish."""

    def __init__(self) -> None:
        self.jobs: list[tuple] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        self.jobs.append((fn, args))
        return Future()

    def run(self) -> None:
        threads = [threading.Thread(target=fn, args=args) for fn, args in self.jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.jobs.clear()


def test_pooled_frames_count_and_are_credited_only_once_their_blocks_are_checked() -> None:
    block = 8 * KIB
    blob = random.Random(6).randbytes(8 * block)
    frames = frames_of("held", blob, 2 * block, block, window=2)  # a credit every frame
    receiver, pool, answers = KVReceiver(max_bytes_in_flight=len(blob)), HeldPool(), []
    for frame in frames[:2]:
        assert receiver.on_stream(len(frame), BytesReader(frame), pool, answers.append) is None, (
            "a pooled frame of whole blocks is answered from the pool, not by the reading thread")
    assert len(pool.jobs) == 4, "each landed block is handed to the pool"
    assert receiver.received("held") == 0 and not answers, "bytes must not count before their blocks are checked"
    pool.run()
    assert sorted(credit(a) for a in answers) == [2 * block, 4 * block], "each checked frame is credited once"
    for frame in frames[2:]:
        receiver.on_stream(len(frame), BytesReader(frame), pool, answers.append)
    pool.run()
    assert max(map(credit, answers)) == len(blob), "the frames' credits must reach the whole transfer"
    assert bytes(receiver.take(transfer_for("held", blob, block))) == blob


def header(**changes) -> dict:
    good = {"v": SCHEMA_VERSION, "kind": FRAME_KIND, "transfer_id": "bad", "offset": 0, "total_bytes": 8 * KIB,
            "chunk": 4 * KIB, "block_bytes": 4 * KIB, "ack_every": 4 * KIB}
    return {k: v for k, v in {**good, **changes}.items() if v is not ...}


MALFORMED = [
    (b"\x00", ErrorCode.BAD_FRAME),
    (b"\x00\x00\x10\x00short", ErrorCode.BAD_FRAME),
    (b"\x00\x00\x00\x02\xc1\xc1" + bytes(4 * KIB), ErrorCode.BAD_FRAME),  # not msgpack
    (pack_frame([1, 2], bytes(4 * KIB)), ErrorCode.BAD_FRAME),  # not a map
    (pack_frame(header(v=7), bytes(4 * KIB)), ErrorCode.UNSUPPORTED_VERSION),
    (pack_frame(header(transfer_id=...), bytes(4 * KIB)), ErrorCode.BAD_SCHEMA),
    (pack_frame(header(offset="zero"), bytes(4 * KIB)), ErrorCode.BAD_SCHEMA),
    (pack_frame(header(offset=float("inf")), bytes(4 * KIB)), ErrorCode.BAD_SCHEMA),
    (pack_frame(header(total_bytes=float("nan")), bytes(4 * KIB)), ErrorCode.BAD_SCHEMA),
    (pack_frame(header(chunk=-1), bytes(4 * KIB)), ErrorCode.BAD_SCHEMA),
    (pack_frame(header(ack_every=...), bytes(4 * KIB)), ErrorCode.BAD_SCHEMA),
    (pack_frame(header(offset=6 * KIB), bytes(4 * KIB)), ErrorCode.BAD_FRAME),  # past the end
    (pack_frame(header(offset=2 * KIB), bytes(4 * KIB)), ErrorCode.BAD_FRAME),  # off the frame grid
    (pack_frame(header(), bytes(3 * KIB)), ErrorCode.BAD_FRAME),  # short of its chunk
    (pack_frame(header(total_bytes=1 << 40), bytes(4 * KIB)), ErrorCode.INVALID_REQUEST),  # over the budget
    (pack_frame(header(total_bytes=0), b""), ErrorCode.INVALID_REQUEST),
    (pack_frame(header(block_bytes=1, chunk=1, ack_every=1, total_bytes=64 * KIB), b"x"), ErrorCode.INVALID_REQUEST),
]


@pytest.mark.parametrize("arrival", ARRIVALS)
@pytest.mark.parametrize("frame,code", MALFORMED, ids=[f"{i}-{c.value}" for i, (_, c) in enumerate(MALFORMED)])
def test_a_malformed_frame_is_refused_with_its_code_and_hurts_no_other_transfer(frame, code, arrival) -> None:
    good = random.Random(5).randbytes(4 * 16 * KIB)
    good_frames = frames_of("good", good, 16 * KIB, 16 * KIB)
    receiver = KVReceiver(max_bytes_in_flight=1 << 20)
    land(receiver, good_frames[0], arrival)
    with pytest.raises(ProtocolError) as err:
        land(receiver, frame, arrival)
    assert err.value.code == code, f"expected {code.value}, got {err.value}"
    for f in good_frames[1:]:
        land(receiver, f, arrival)
    assert bytes(receiver.take(transfer_for("good", good, 16 * KIB))) == good, "the good transfer was disturbed"


def test_receive_memory_is_bounded_and_freed_by_take() -> None:
    blob = bytes(64 * KIB)
    receiver = KVReceiver(max_bytes_in_flight=96 * KIB)
    receiver.on_frame(frames_of("a", blob, 32 * KIB, 32 * KIB)[0])
    with pytest.raises(ProtocolError) as err:
        receiver.on_frame(frames_of("b", blob, 32 * KIB, 32 * KIB)[0])
    assert err.value.code == ErrorCode.INVALID_REQUEST, err.value
    assert receiver.bytes_in_flight == 64 * KIB
    receiver.on_frame(frames_of("a", blob, 32 * KIB, 32 * KIB)[1])
    receiver.take(transfer_for("a", blob, 32 * KIB))
    receiver.on_frame(frames_of("b", blob, 32 * KIB, 32 * KIB)[0])  # room again
    assert receiver.bytes_in_flight == 64 * KIB


def test_stale_assemblies_are_dropped() -> None:
    receiver = KVReceiver(max_bytes_in_flight=1 << 20, stale_after_s=0.0)
    receiver.on_frame(frames_of("old", bytes(64 * KIB), 32 * KIB, 32 * KIB)[0])
    receiver.on_frame(frames_of("new", bytes(64 * KIB), 32 * KIB, 32 * KIB)[0])  # a new transfer sweeps
    with pytest.raises(ProtocolError) as err:
        receiver.take(transfer_for("old", bytes(64 * KIB), 32 * KIB))
    assert err.value.code == ErrorCode.INVALID_REQUEST and "no kv frames" in err.value.message, err.value


@pytest.mark.parametrize("arrival", ARRIVALS)
def test_older_frames_are_acknowledged_one_by_one_and_checked_at_take(arrival) -> None:
    """An older sender's frames (no chunk, block_bytes or ack_every) still work, one ``ok`` each."""
    blob = random.Random(6).randbytes(3 * 8 * KIB)
    receiver = KVReceiver(max_bytes_in_flight=len(blob))
    for off in range(0, len(blob), 10 * KIB):
        frame = pack_frame({"v": SCHEMA_VERSION, "kind": "kv_chunk", "transfer_id": "old", "offset": off,
                            "total_bytes": len(blob)}, blob[off : off + 10 * KIB])
        assert land(receiver, frame, arrival) == LEGACY_OK
    assert bytes(receiver.take(transfer_for("old", blob, 8 * KIB))) == blob
    bent = transfer_for("old2", blob, 8 * KIB).model_copy(update={"checksums": [zlib.crc32(b"x")] * 3})
    receiver.on_frame(pack_frame({"v": SCHEMA_VERSION, "transfer_id": "old2", "offset": 0, "total_bytes": len(blob)},
                                 blob))
    with pytest.raises(ProtocolError) as err:
        receiver.take(bent)
    assert err.value.code == ErrorCode.BAD_FRAME, err.value


@pytest.mark.parametrize("max_payload,block_bytes,want", [
    (8 << 20, 2 << 20, 6 << 20),  # whole 2 MiB blocks under 8 MiB (less the header room)
    (1 << 20, 2 << 20, (1 << 20) - 512),  # a block larger than a frame: as much as fits
    (1 << 20, 0, (1 << 20) - 512),
    (8 << 20, 64 * KIB, (8 << 20) - 64 * KIB),
])
def test_frame_size_holds_whole_blocks_when_one_fits(max_payload, block_bytes, want) -> None:
    assert frame_payload_bytes(max_payload, block_bytes) == want
