"""Seeded payload generators for the bus fuzz (tests/e2e/test_bus_fuzz.py, test_bus_fuzz_secured.py),
and the request-reply subjects they are sent to (:func:`targets`) with how each answer is judged.

Every generator takes a ``random.Random`` and returns ``(payload_class, payload_bytes)``; the same
seed gives the same payloads, so a failure names its class and a short repr that reproduce it.
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import struct
from dataclasses import dataclass, field

import msgpack
from support import prompt_of

from tandem.client import connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION, Ack, ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import DrainRequest, ScaleRequest
from tandem.shared.protocol.kv import (
    KVGetReply,
    KVGetRequest,
    KVLookupReply,
    KVLookupRequest,
    KVPutReply,
    KVPutRequest,
    KVTransfer,
)
from tandem.shared.protocol.serving import (
    DecodeRequest,
    GenerateAccepted,
    GenerateRequest,
    PrefillRequest,
    Probe,
    RequestSpec,
    SamplingParams,
)
from tandem.shared.protocol.training import TrainStart, TrainStatusReply, TrainStatusRequest, TrainStop
from tandem.shared.protocol.views import BlockSnapshot

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
PER_CLASS = 12  # payloads per (subject, payload class); near-max and huge ones fewer (see COUNTS)
COUNTS = {"near_max_payload": 3, "huge_string": 4, "deep_nesting": 8}


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


# -- the request-reply subjects of a running system, and what answers them ------------------------
@dataclass(frozen=True)
class Target:
    name: str
    subject: str
    base: dict | None  # the valid message mutations start from (None: binary KV frames)
    served: bool  # a running service listens
    valid: tuple = ()  # reply types that are a valid answer here besides ErrorReply
    drain: bool = False


@dataclass
class Outcome:
    sent: int = 0
    error: int = 0
    valid: int = 0
    timeout: int = 0
    no_responders: int = 0
    failures: list[str] = field(default_factory=list)


def spec(request_id: str = "fuzz-1") -> RequestSpec:
    return RequestSpec(request_id=request_id, prompt_token_ids=[70, 117, 122], model="tiny",
                       params=SamplingParams(max_tokens=2, temperature=0.0, seed=7),
                       stream_subject="_INBOX.fuzz.nobody")


OTHER_OWNER = "UFUZZOTHERCLIENTKEY"  # an owner token that is not the fuzzing connection's


def targets(system, owner: str = "fuzz") -> list[Target]:
    """Every request-reply subject of ``system``; a generate request is sent as ``owner`` (its
    stream in ``owner``'s inbox), and once more under another owner's subject, which a bus with
    identities must refuse."""
    pre, dec, kvs = system.instance("prefill"), system.instance("decode"), system.instance("kvstore")
    transfer = KVTransfer(transfer_id="fuzz-t", num_blocks=1, block_bytes=4, checksums=[0])
    probe = Probe(request_id="fuzz").model_dump()
    drain = DrainRequest(exit=False).model_dump()
    return [
        Target("router.generate", subjects.router_generate(owner),
               GenerateRequest(request_id="fuzz-g", prompt="hello", params=spec().params,
                               stream_subject=f"_INBOX.{owner}.nobody").model_dump(), True, (GenerateAccepted,)),
        Target("router.generate.other", subjects.router_generate(OTHER_OWNER),
               GenerateRequest(request_id="fuzz-o", prompt="hello", params=spec().params,
                               stream_subject=f"_INBOX.{OTHER_OWNER}.victim").model_dump(), True,
               (GenerateAccepted,)),  # a bus without identities cannot tell: only the secured one refuses it
        Target("prefill.prefill", subjects.prefill(pre),
               PrefillRequest(spec=spec("fuzz-p"), decode_worker=dec, kvstore=kvs).model_dump(), True, (Ack,)),
        Target("decode.admit", subjects.decode_admit(dec),
               DecodeRequest(spec=spec("fuzz-d"), kvstore=kvs).model_dump(), True, (Ack,)),
        Target("decode.kv", subjects.decode_kv(dec), None, True, (b"ok",)),
        Target("kvstore.lookup", subjects.kvstore_lookup(kvs),
               KVLookupRequest(namespace="fuzz/ns", hashes=[1, 2, 3]).model_dump(), True, (KVLookupReply,)),
        Target("kvstore.get", subjects.kvstore_get(kvs),
               KVGetRequest(request_id="fuzz-get", namespace="fuzz/ns", hashes=[1, 2],
                            inbox="_INBOX.fuzz.get").model_dump(), True, (KVGetReply,)),
        Target("kvstore.put", subjects.kvstore_put(kvs),
               KVPutRequest(request_id="fuzz-put", namespace="fuzz/ns", hashes=[1], transfer=transfer).model_dump(),
               True, (KVPutReply,)),
        Target("kvstore.kv", subjects.kvstore_kv(kvs), None, True, (b"ok",)),
        Target("kvstore.stats", subjects.kvstore_stats(kvs), probe, True, ("stats",)),
        Target("prefill.blocks", subjects.blocks("prefill", pre), probe, True, (BlockSnapshot,)),
        Target("decode.blocks", subjects.blocks("decode", dec), probe, True, (BlockSnapshot,)),
        Target("prefill.drain", subjects.drain("prefill", pre), drain, True, (), drain=True),
        Target("decode.drain", subjects.drain("decode", dec), drain, True, (), drain=True),
        Target("planner.scale", subjects.PLANNER_SCALE, ScaleRequest(prefill=1, decode=1).model_dump(), False),
        Target("trainer.start", subjects.TRAINER_START, TrainStart(job_id="fuzz").model_dump(), False),
        Target("trainer.stop", subjects.TRAINER_STOP, TrainStop(job_id="fuzz").model_dump(), False),
        Target("trainer.status", subjects.TRAINER_STATUS, TrainStatusRequest().model_dump(), False,
               (TrainStatusReply,)),
    ]


def payloads(target: Target, rng: random.Random, max_payload: int) -> list[tuple[str, bytes]]:
    out = []
    classes = FRAME_CLASSES if target.base is None else PAYLOAD_CLASSES
    for cls in classes:
        for _ in range(COUNTS.get(cls, PER_CLASS)):
            if target.base is None:
                data = gen_frame(rng, cls, max_payload)
            elif target.drain:
                data = gen_drain(rng, cls, target.base, max_payload)
            else:
                data = gen_msgpack(rng, cls, target.base, max_payload)
            assert len(data) <= max_payload, f"{target.name}/{cls}: generator overran max_payload ({len(data)})"
            out.append((cls, data))
    return out


def classify(target: Target, data: bytes) -> str:
    """'error', 'valid' or a description of what was wrong with the reply."""
    if b"ok" in target.valid and data == b"ok":
        return "valid"
    if "stats" in target.valid:
        try:
            raw = msgpack.unpackb(data, raw=False)
        except Exception:  # noqa: BLE001
            raw = None
        if isinstance(raw, dict) and "instance_id" in raw:
            return "valid"
    try:
        reply = decode(data)
    except Exception as exc:  # noqa: BLE001
        return f"reply does not decode ({exc}): {short(data)}"
    if isinstance(reply, ErrorReply):
        return "error"
    if any(isinstance(t, type) and isinstance(reply, t) for t in target.valid):
        return "valid"
    return f"unexpected reply {type(reply).__name__}: {short(data)}"


SUBJECT_NAMES = ["router.generate", "router.generate.other", "prefill.prefill", "decode.admit", "decode.kv",
                 "kvstore.lookup", "kvstore.get", "kvstore.put", "kvstore.kv", "kvstore.stats", "prefill.blocks",
                 "decode.blocks", "prefill.drain", "decode.drain", "planner.scale", "trainer.start", "trainer.stop",
                 "trainer.status"]


async def legit_round(url: str, n: int, tokens: int, salt: int, creds: str | None = None) -> list[list[int]]:
    """``n`` greedy completions at once, as legitimate traffic beside the fuzz: their tokens."""

    async def one(i: int) -> list[int]:
        async with connect(url, creds=creds) as client:
            result = await client.complete(prompt_of(24, salt=salt * i), max_tokens=tokens, temperature=0.0,
                                           ignore_eos=True, timeout_s=30)
        return list(result.token_ids)

    return list(await asyncio.gather(*(one(i) for i in range(n))))
