"""A seeded fuzz over every request-reply subject of a running system.

Each subject whose service runs must answer every payload within 5 s with a typed ErrorReply (or a
valid reply of that subject); subjects nobody serves (planner, trainer) must report no responders.
Garbage on the publish-only subjects (heartbeats, KV events, cancel) must kill nothing. Meanwhile
four greedy completions run again and again and must give exactly the tokens they gave before.
Seeded (``SEED``): a failure names its payload class and a short repr, and reruns the same way.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import nats
import pytest
from fuzz_support import (
    FRAME_CLASSES,
    PAYLOAD_CLASSES,
    garbage_for_publish,
    gen_drain,
    gen_frame,
    gen_msgpack,
    is_valid_drain,
    short,
)
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from support import prompt_of, worker_beats

from tandem.client import connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorReply
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat, ScaleRequest
from tandem.shared.protocol.kv import (
    KVEvent,
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

SEED = 1234
PER_CLASS = 12  # payloads per (subject, payload class); near-max and huge ones fewer (see COUNTS)
COUNTS = {"near_max_payload": 3, "huge_string": 4, "deep_nesting": 8}
IN_FLIGHT = 32
REPLY_TIMEOUT_S = 5.0
PUBLISH_GARBAGE = 300
LEGIT = 4
LEGIT_TOKENS = 12


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


def targets(system) -> list[Target]:
    pre, dec, kvs = system.instance("prefill"), system.instance("decode"), system.instance("kvstore")
    transfer = KVTransfer(transfer_id="fuzz-t", num_blocks=1, block_bytes=4, checksums=[0])
    probe = Probe(request_id="fuzz").model_dump()
    drain = DrainRequest(exit=False).model_dump()
    return [
        Target("router.generate", subjects.ROUTER_GENERATE,
               GenerateRequest(request_id="fuzz-g", prompt="hello", params=spec().params,
                               stream_subject="_INBOX.fuzz.nobody").model_dump(), True, (GenerateAccepted,)),
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


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(prefill=1, decode=1, kvstore=1)


async def legit_once(url: str) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        async with connect(url) as client:
            result = await client.complete(prompt_of(24, salt=3 * i), max_tokens=LEGIT_TOKENS, temperature=0.0,
                                           ignore_eos=True, timeout_s=30)
        return list(result.token_ids)

    return list(await asyncio.gather(*(one(i) for i in range(LEGIT))))


@dataclass
class FuzzRun:
    outcomes: dict[str, Outcome]
    targets: list[Target]
    baseline: list[list[int]]
    during: list[list[list[int] | str]]
    after: list[list[int]] | str
    published: Counter
    beats: dict[str, Heartbeat]
    seconds: float
    max_payload: int
    drain_valid: list[str]


@pytest.fixture(scope="module")
async def fuzz(system) -> FuzzRun:
    start = time.monotonic()
    baseline = await legit_once(system.url)
    nc = await nats.connect(system.url, pending_size=256 * 1024 * 1024)
    max_payload = nc.max_payload
    rng = random.Random(SEED)
    tgts = targets(system)
    outcomes = {t.name: Outcome() for t in tgts}
    work = [(t, cls, data) for t in tgts for cls, data in payloads(t, rng, max_payload)]
    drain_valid = [f"{t.name}/{cls}: {short(d)}" for t, cls, d in work if t.drain and is_valid_drain(d)]
    assert not drain_valid, f"the generator produced valid DrainRequests: {drain_valid[:3]}"
    rng.shuffle(work)
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def send(target: Target, cls: str, data: bytes) -> None:
        out = outcomes[target.name]
        async with sem:
            out.sent += 1
            try:
                reply = await nc.request(target.subject, data, timeout=REPLY_TIMEOUT_S)
            except NoRespondersError:
                out.no_responders += 1
                if target.served:
                    out.failures.append(f"no responders to {cls}: {short(data)}")
                return
            except NatsTimeoutError:
                out.timeout += 1
                out.failures.append(f"no reply within {REPLY_TIMEOUT_S} s to {cls}: {short(data)}")
                return
        verdict = classify(target, reply.data)
        if verdict == "error":
            out.error += 1
        elif verdict == "valid":
            out.valid += 1
        else:
            out.failures.append(f"{cls}: {verdict} (payload {short(data)})")
        if not target.served:
            out.failures.append(f"{cls}: a reply where nobody should serve: {short(reply.data)}")

    # Garbage on publish-only subjects: never a valid message (a valid heartbeat or cancel would steer
    # the fleet, which is not what this test asks about).
    pre, dec, kvs = system.instance("prefill"), system.instance("decode"), system.instance("kvstore")
    pub_targets = [
        (subjects.heartbeat("decode", dec), Heartbeat(service="decode", instance_id=dec, host="h", pid=1,
                                                      model="tiny").model_dump(), True),
        (subjects.heartbeat("prefill", pre), Heartbeat(service="prefill", instance_id=pre, host="h", pid=1,
                                                       model="tiny").model_dump(), True),
        (subjects.heartbeat("kvstore", kvs), Heartbeat(service="kvstore", instance_id=kvs, host="h", pid=1,
                                                       model="").model_dump(), True),
        (subjects.heartbeat("decode", "fuzz-ghost"), Heartbeat(service="decode", instance_id="fuzz-ghost", host="h",
                                                               pid=1, model="tiny").model_dump(), True),
        # KV events land in a JetStream stream that later modules' routers replay: keep them small.
        (subjects.kv_events("decode", dec), KVEvent(source=dec, service="decode", namespace="fuzz", seq=1,
                                                     stored=[1]).model_dump(), False),
        (subjects.kv_events("kvstore", kvs), KVEvent(source=kvs, service="kvstore", namespace="fuzz", seq=1,
                                                      stored=[1]).model_dump(), False),
        (subjects.CANCEL, {"v": 2, "kind": "cancel", "request_id": "fuzz-c", "stream_subject": "_INBOX.fuzz.c"}, True),
    ]
    published = Counter()

    async def publish_garbage() -> None:
        prng = random.Random(SEED + 1)
        for i in range(PUBLISH_GARBAGE):
            subject, base, huge = pub_targets[i % len(pub_targets)]
            cls, data = garbage_for_publish(prng, base, max_payload, allow_huge=huge)
            await nc.publish(subject, data)
            published[subject.rsplit(".", 2)[-2] if subject != subjects.CANCEL else "cancel"] += 1
            if i % 20 == 0:
                await asyncio.sleep(0)
        await nc.flush()

    fuzz_done = asyncio.Event()
    during: list = []

    async def legit_loop() -> None:
        while True:
            try:
                during.append(await legit_once(system.url))
            except Exception as exc:  # noqa: BLE001 - a collateral failure, reported by the test
                during.append(f"{type(exc).__name__}: {exc}")
            if fuzz_done.is_set():
                return

    legit = asyncio.create_task(legit_loop())

    async def fuzz_all() -> None:
        await asyncio.gather(publish_garbage(), *(send(t, cls, d) for t, cls, d in work))
        fuzz_done.set()

    await fuzz_all()
    await legit
    await nc.close()
    await asyncio.sleep(0.5)
    try:
        after = await legit_once(system.url)
    except Exception as exc:  # noqa: BLE001
        after = f"{type(exc).__name__}: {exc}"
    beats = await worker_beats(system.url, wait_s=1.5)
    run = FuzzRun(outcomes, tgts, baseline, during, after, published, beats, time.monotonic() - start, max_payload,
                  drain_valid)
    print(table(run))
    return run


def table(run: FuzzRun) -> str:
    rows = [f"bus fuzz, seed {SEED}, max_payload {run.max_payload} B, {run.seconds:.1f} s",
            f"{'subject':<18}{'sent':>6}{'ErrorReply':>12}{'valid reply':>13}{'timeout':>9}{'no resp.':>10}"
            f"{'bad':>5}"]
    total = Counter()
    for t in run.targets:
        o = run.outcomes[t.name]
        bad = len(o.failures)
        rows.append(f"{t.name:<18}{o.sent:>6}{o.error:>12}{o.valid:>13}{o.timeout:>9}{o.no_responders:>10}{bad:>5}")
        total.update(sent=o.sent, error=o.error, valid=o.valid, timeout=o.timeout, nr=o.no_responders, bad=bad)
    rows.append(f"{'total':<18}{total['sent']:>6}{total['error']:>12}{total['valid']:>13}{total['timeout']:>9}"
                f"{total['nr']:>10}{total['bad']:>5}")
    rows.append(f"published garbage: {dict(run.published)}; legit rounds during fuzz: {len(run.during)}")
    return "\n".join(rows)


SUBJECT_NAMES = ["router.generate", "prefill.prefill", "decode.admit", "decode.kv", "kvstore.lookup", "kvstore.get",
                 "kvstore.put", "kvstore.kv", "kvstore.stats", "prefill.blocks", "decode.blocks", "prefill.drain",
                 "decode.drain", "planner.scale", "trainer.start", "trainer.stop", "trainer.status"]


def test_every_subject_was_fuzzed(fuzz, capsys):
    """Prints the counts per subject (the table in README's and the issue's terms)."""
    with capsys.disabled():
        print("\n" + table(fuzz))
    assert sorted(fuzz.outcomes) == sorted(SUBJECT_NAMES), "a request-reply subject was left out of the fuzz"


@pytest.mark.parametrize("name", SUBJECT_NAMES)
def test_every_request_gets_a_typed_reply(fuzz, name):
    target = next(t for t in fuzz.targets if t.name == name)
    out = fuzz.outcomes[name]
    assert out.sent > 0
    assert not out.failures, f"{name}: {len(out.failures)} of {out.sent} payloads went wrong:\n" + "\n".join(
        out.failures[:10])
    if target.served:
        assert out.error + out.valid == out.sent, f"{name}: {out}"
    else:
        assert out.no_responders == out.sent, f"{name}: expected no responders for every request: {out}"


def test_drain_payloads_are_never_valid(system):
    rng = random.Random(SEED)
    base = DrainRequest(exit=False).model_dump()
    for cls in PAYLOAD_CLASSES:
        for _ in range(50):
            data = gen_drain(rng, cls, base, 1 << 20)
            assert not is_valid_drain(data), f"{cls} produced a valid DrainRequest: {short(data)}"


def test_no_service_died(fuzz, system):
    system.check_alive()


def test_workers_and_store_keep_beating(fuzz, system):
    want = {system.instance("prefill"), system.instance("decode"), system.instance("kvstore")}
    assert want <= set(fuzz.beats), f"no heartbeat after the fuzz from {want - set(fuzz.beats)}"
    assert not any(b.draining for i, b in fuzz.beats.items() if i in want), "a worker started draining"


def test_legit_requests_unharmed(fuzz):
    assert all(len(ids) == LEGIT_TOKENS for ids in fuzz.baseline), fuzz.baseline
    assert fuzz.during, "no legitimate round ran during the fuzz"
    collateral = [(i, r) for i, r in enumerate(fuzz.during) if r != fuzz.baseline]
    assert not collateral, f"{len(collateral)} of {len(fuzz.during)} rounds during the fuzz differ from the " \
                           f"baseline {fuzz.baseline}: {collateral[:2]}"
    assert fuzz.after == fuzz.baseline, f"after the fuzz: {fuzz.after} != baseline {fuzz.baseline}"

