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
from dataclasses import dataclass

import nats
import pytest
from fuzz_support import (
    PAYLOAD_CLASSES,
    SUBJECT_NAMES,
    Outcome,
    Target,
    classify,
    garbage_for_publish,
    gen_drain,
    is_valid_drain,
    legit_round,
    payloads,
    short,
    targets,
)
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from support import flushed, worker_beats

from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat
from tandem.shared.protocol.kv import KVEvent

pytestmark = pytest.mark.slow  # over a thousand fuzzed messages against every service, legit rounds beside them

SEED = 1234
IN_FLIGHT = 32
REPLY_TIMEOUT_S = 5.0
PUBLISH_GARBAGE = 300
LEGIT = 4
LEGIT_TOKENS = 12


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(prefill=1, decode=1, kvstore=1)


async def legit_once(url: str) -> list[list[int]]:
    return await legit_round(url, LEGIT, LEGIT_TOKENS, salt=3)


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
        (subjects.cancel("fuzz"), {"v": SCHEMA_VERSION, "kind": "cancel", "request_id": "fuzz-c",
                           "stream_subject": "_INBOX.fuzz.c"}, True),
    ]
    published = Counter()

    async def publish_garbage() -> None:
        prng = random.Random(SEED + 1)
        for i in range(PUBLISH_GARBAGE):
            subject, base, huge = pub_targets[i % len(pub_targets)]
            cls, data = garbage_for_publish(prng, base, max_payload, allow_huge=huge)
            await nc.publish(subject, data)
            published[subject.rsplit(".", 2)[-2] if subject != subjects.cancel("fuzz") else "cancel"] += 1
            if i % 20 == 0:
                await asyncio.sleep(0)
        await flushed(nc)

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

