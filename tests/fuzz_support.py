"""Seeded payload generators for the bus fuzz (tests/e2e/test_bus_fuzz.py).

Every generator takes a ``random.Random`` and returns ``(payload_class, payload_bytes)``; the same
seed gives the same payloads, so a failure names its class and a short repr that reproduce it.
"""

from __future__ import annotations

import copy
import math
import random
import struct

import msgpack

from tandem.shared.protocol.base import SCHEMA_VERSION, ProtocolError
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import DrainRequest

# Values for fields that name things: request ids, stream subjects, instance ids, inboxes.
BAD_IDS = ["a b", ">", "*", "x" * 5000, "", "a.>", "a.*.b", "..", "_INBOX.a b", "_INBOX." + "y" * 5000, "\x00",
           "\r\nPUB evil 1\r\nx", "a\tb", "é" * 3000]
# Names of fields that carry such ids (only those present in a message are touched).
ID_FIELDS = {"request_id", "stream_subject", "decode_worker", "decode_ring", "decode_host", "kvstore", "inbox",
             "namespace", "kv_namespace", "transfer_id", "job_id", "model", "ring", "instance_id", "source"}
BAD_NUMBERS = [2**63, 2**64 - 1, -1, -(2**63), float("nan"), float("inf"), float("-inf"), 2**31, 0, -0.0, 1e308]
WRONG_TYPES = [[1, 2], {"a": 1}, "str", 12345, None, True, b"\x00\xff", 1.5, [[[]]], {"v": 2}]
MARK = "\x00FUZZ-NEST-MARK\x00"

PAYLOAD_CLASSES = ["random_bytes", "truncated", "wrong_types", "unknown_kind", "wrong_version", "deep_nesting",
                   "huge_string", "near_max_payload", "bad_ids", "out_of_range"]
FRAME_CLASSES = ["random_bytes", "truncated_frame", "bad_frame_header", "near_max_payload"]


def short(payload: bytes, n: int = 80) -> str:
    return f"{len(payload)}B {payload[:n]!r}{'...' if len(payload) > n else ''}"


# -- paths into a message dict --------------------------------------------------------------------
def leaf_paths(obj, prefix=()) -> list[tuple]:
    """Every key path to a leaf (and to each dict/list itself) of a dumped message; lists by index 0."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((*prefix, k))
            out.extend(leaf_paths(v, (*prefix, k)))
    elif isinstance(obj, list) and obj:
        out.append((*prefix, 0))
        out.extend(leaf_paths(obj[0], (*prefix, 0)))
    return out


def get_at(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def set_at(obj, path, value):
    obj = copy.deepcopy(obj)
    target = obj
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return obj


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def nested_bytes(rng: random.Random, depth: int) -> bytes:
    """A msgpack value nested ``depth`` levels (lists, maps or a mix), built by hand (packb stops at 511)."""
    style = rng.choice(["list", "map", "mix"])
    parts = []
    for _ in range(depth):
        s = style if style != "mix" else rng.choice(["list", "map"])
        parts.append(b"\x91" if s == "list" else b"\x81\xa1k")
    return b"".join(parts) + b"\xc0"


# -- msgpack payloads -----------------------------------------------------------------------------
def gen_msgpack(rng: random.Random, cls: str, base: dict, max_payload: int) -> bytes:
    if cls == "random_bytes":
        return rng.randbytes(rng.choice([0, 1, 2, 7, 64, 300, 2048]))
    if cls == "truncated":
        data = pack(base)
        return data[: rng.randrange(0, len(data))]
    if cls == "wrong_types":
        path = rng.choice([p for p in leaf_paths(base) if p[-1] not in ("kind",)])
        return pack(set_at(base, path, rng.choice(WRONG_TYPES)))
    if cls == "unknown_kind":
        kind = rng.choice(["teleport", "", "GENERATE", "x" * 1000, None, 7, ["generate"], "error", "ack"])
        return pack({**base, "kind": kind})
    if cls == "wrong_version":
        v = rng.choice([0, 1, 3, 99, "2", None, -1, 2**64 - 1, 2.5, [2], "missing"])
        msg = dict(base)
        if v == "missing":
            msg.pop("v", None)
        else:
            msg["v"] = v
        return pack(msg)
    if cls == "deep_nesting":
        depth = rng.choice([500, 500, 5000, 100_000])
        raw = nested_bytes(rng, depth)
        if rng.random() < 0.3:
            return raw  # the whole payload
        path = rng.choice(leaf_paths(base))
        return pack(set_at(base, path, MARK)).replace(pack(MARK), raw)
    if cls == "huge_string":
        size = rng.choice([512 * 1024, 256 * 1024])
        text = rng.choice(["x" * size, "é" * (size // 2), "\u2603" * (size // 3)])
        where = rng.random()
        if where < 0.2:
            return pack({**base, text[:1000]: 1})  # a huge unknown key
        path = rng.choice(leaf_paths(base))
        return pack(set_at(base, path, text))
    if cls == "near_max_payload":
        slack = rng.choice([0, 1, 17, 64, 600])
        data = pack({**base, "pad": ""})
        pad = max(0, max_payload - len(data) - 5 - slack)
        msg = {**base, "pad": "p" * pad}
        if rng.random() < 0.5:  # or the padding in a real field (still refused: too long / bad type)
            path = rng.choice(leaf_paths(base))
            msg = set_at(base, path, "q" * pad)
        out = pack(msg)
        return out[:max_payload]
    if cls == "bad_ids":
        paths = [p for p in leaf_paths(base) if isinstance(p[-1], str) and p[-1] in ID_FIELDS]
        msg = base
        for path in rng.sample(paths, k=min(len(paths), rng.choice([1, 1, 2]))) if paths else []:
            msg = set_at(msg, path, rng.choice(BAD_IDS))
        if not paths:
            msg = {**base, "request_id": rng.choice(BAD_IDS)}
        return pack(msg)
    if cls == "out_of_range":
        paths = [p for p in leaf_paths(base)
                 if isinstance(get_at(base, p), (int, float)) and not isinstance(get_at(base, p), bool)
                 and p[-1] != "v"]
        path = rng.choice(paths) if paths else ("fuzz_number",)
        return pack(set_at(base, path, rng.choice(BAD_NUMBERS)) if paths else {**base, "fuzz_number": 2**63})
    raise ValueError(cls)


# -- binary KV frames ----------------------------------------------------------------------------
def frame(header, payload: bytes = b"abcd") -> bytes:
    head = pack(header)
    return struct.pack(">I", len(head)) + head + payload


def gen_frame(rng: random.Random, cls: str, max_payload: int) -> bytes:
    good = {"v": SCHEMA_VERSION, "kind": "kv_chunk", "transfer_id": f"fuzz-{rng.randrange(10**6)}", "offset": 0,
            "total_bytes": 4}
    if cls == "random_bytes":
        return rng.randbytes(rng.choice([0, 1, 3, 4, 5, 64, 2048]))
    if cls == "truncated_frame":
        data = frame(good)
        choice = rng.random()
        if choice < 0.4:
            return data[: rng.randrange(0, len(data))]
        if choice < 0.7:  # a length prefix that runs past the frame, or one of 0xffffffff
            return struct.pack(">I", rng.choice([len(data), 2**32 - 1, 2**31])) + data[4:]
        return struct.pack(">I", 0) + data[4:]  # an empty header (msgpack of nothing)
    if cls == "bad_frame_header":
        field = rng.choice(["v", "transfer_id", "offset", "total_bytes", "kind", "whole"])
        if field == "whole":
            return frame(rng.choice([[1, 2], "header", 7, None, b"\x00", {1: 2}, {}]))
        if field == "v":
            bad = rng.choice([0, 1, 3, "2", None, 2**64 - 1])
        elif field == "offset":
            bad = rng.choice([-1, 2, 2**63, 2**64 - 1, float("nan"), float("inf"), "0", None, [0], 4, 3])
        elif field == "total_bytes":
            bad = rng.choice([0, -1, 1 << 40, 2**63, 2**64 - 1, float("nan"), float("inf"), "4", None, 2, 1.5])
        elif field == "transfer_id":
            bad = rng.choice([None, 5, [1], {"a": 1}, "x" * 5000, "", "a b", b"\xff"])
        else:
            bad = rng.choice(["admit", None, 5, "x" * 300])
        header = dict(good)
        if rng.random() < 0.2:
            header.pop(field)
        else:
            header[field] = bad
        return frame(header, rng.choice([b"abcd", b"", b"abcdefgh", rng.randbytes(64)]))
    if cls == "near_max_payload":  # a frame claiming a transfer larger than the buffer, or a range outside it
        head = pack({**good, "total_bytes": rng.choice([1 << 40, max_payload, 4])})
        body = max_payload - 4 - len(head) - rng.choice([0, 1, 64])
        return struct.pack(">I", len(head)) + head + b"\x00" * body
    raise ValueError(cls)


# -- garbage for publish-only subjects -----------------------------------------------------------
def decodes_as_message(payload: bytes) -> bool:
    try:
        decode(payload)
    except ProtocolError:
        return False
    except Exception:  # noqa: BLE001 - anything else the decoder raises is not a valid message either
        return False
    return True


def garbage_for_publish(rng: random.Random, base: dict, max_payload: int, allow_huge: bool = True) -> tuple[str, bytes]:
    """A payload that does not decode as any valid message (so publishing it cannot steer anything)."""
    classes = [c for c in PAYLOAD_CLASSES if c not in ("bad_ids", "out_of_range", "near_max_payload")
               and (allow_huge or c != "huge_string")]
    for _ in range(50):
        cls = rng.choice(classes)
        data = gen_msgpack(rng, cls, base, max_payload)
        if not decodes_as_message(data):
            return cls, data
    raise AssertionError("could not generate an invalid payload")


def is_valid_drain(payload: bytes) -> bool:
    try:
        decode(payload, DrainRequest)
    except Exception:  # noqa: BLE001
        return False
    return True


def gen_drain(rng: random.Random, cls: str, base: dict, max_payload: int) -> bytes:
    """A payload for a drain subject that never decodes as a valid DrainRequest (a valid one would
    really drain the worker): a mutation that happens to stay valid gets a forbidden extra field."""
    data = gen_msgpack(rng, cls, base, max_payload)
    if is_valid_drain(data):
        raw = msgpack.unpackb(data, raw=False)
        raw["fuzz_extra_field"] = True
        data = pack(raw)
        if len(data) > max_payload:
            data = pack({**base, "fuzz_extra_field": True})
    return data


def is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)
