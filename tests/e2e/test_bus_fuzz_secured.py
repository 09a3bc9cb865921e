"""The bus fuzz on a bus that requires identities, sent as a client (the role every user holds).

The same seeded payloads as ``test_bus_fuzz.py`` go to every request-reply subject of a system whose
services connect with their role keys (as under ``tandem up``). The router's generate subject under
the client's own key is a client's to use: every payload gets a typed reply. Every other subject is
not, the generate subject under another client's key included: nats-server refuses each publish
with a permission error, so no payload reaches a service at all. Garbage heartbeats and KV events
are refused the same way, and so are cancels under another client's key; garbage cancels under its
own key are a client's to send and change nothing.
Nothing dies, every worker keeps beating, and greedy completions running meanwhile give the tokens
they gave before.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from cli_support import launch, run_sync, service_env
from fuzz_support import (
    OTHER_OWNER,
    SUBJECT_NAMES,
    Target,
    classify,
    garbage_for_publish,
    legit_round,
    payloads,
    short,
    targets,
)
from nats.errors import TimeoutError as NatsTimeoutError
from support import flushed, worker_beats

from tandem.cli.supervisor import wait_until_ready
from tandem.shared.auth.credentials import connect_options, load_credentials
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION

pytestmark = pytest.mark.slow  # the fuzz again, on a bus with identities

SEED = 4321
IN_FLIGHT = 32
REPLY_TIMEOUT_S = 5.0
PUBLISH_GARBAGE = 120
LEGIT, LEGIT_TOKENS = 4, 12


@dataclass
class SecuredSystem:
    url: str
    keys: dict[str, Path]
    operator: dict
    processes: dict = field(default_factory=dict)
    logdir: Path | None = None

    def instance(self, service: str) -> str:
        return next(name for name in self.processes if name.startswith(service))

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        assert not dead, f"service processes exited: {dead}\n" + "\n".join(
            (self.logdir / f"{n}.log").read_text()[-2000:] for n in dead)


@pytest.fixture(scope="module")
def secured(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("fuzz-secured")
    ring = Keyring.generate()
    keys = ring.write_role_keys(root / "keys")
    server = NatsServer.start(workdir=root / "server", auth_config=ring.server_config())
    system = SecuredSystem(server.url, keys, connect_options(ring.role_key("operator"), "fuzz-operator"),
                           logdir=root)
    try:
        for service in ("kvstore", "decode", "prefill", "router"):
            name = f"{service}-sec-0"
            extra = ["--creds", str(keys[service])]
            if service == "kvstore":
                extra += ["--kvstore-dir", str(root / name)]
            system.processes[name] = launch(server.url, service, name, root, service_env(data_dir), extra)
        run_sync(wait_until_ready(server.url, {"kvstore": 1, "decode": 1, "prefill": 1, "router": 1},
                                  system.check_alive, 120, system.operator))
        yield system
    finally:
        for proc in system.processes.values():
            proc.terminate()
        for proc in system.processes.values():
            try:
                proc.wait(20)
            except Exception:  # noqa: BLE001 - stopping regardless
                proc.kill()
        server.stop()


@dataclass
class Outcome:
    sent: int = 0
    error: int = 0  # a typed ErrorReply
    valid: int = 0
    refused: int = 0  # nats-server's permission error: the payload reached no service
    failures: list[str] = field(default_factory=list)


async def legit_once(system: SecuredSystem) -> list[list[int]]:
    return await legit_round(system.url, LEGIT, LEGIT_TOKENS, salt=5, creds=str(system.keys["client"]))


@dataclass
class FuzzRun:
    outcomes: dict[str, Outcome]
    targets: list[Target]
    published: dict[str, tuple[int, int]]  # publish-only subject -> (sent, refused)
    baseline: list[list[int]]
    during: list
    after: list | str
    beats: dict
    seconds: float
    own_cancel: str  # the fuzzing client's own cancel subject


def refusals(errors: list[str], subject: str) -> int:
    return sum(f'permissions violation for publish to "{subject.lower()}"' in e for e in errors)


@pytest.fixture(scope="module")
async def fuzz(secured) -> FuzzRun:
    start = time.monotonic()
    baseline = await legit_once(secured)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(secured.url, error_cb=on_error, pending_size=256 * 1024 * 1024,
                            **connect_options(load_credentials(secured.keys["client"]), "fuzz-client"))
    rng = random.Random(SEED)
    owner = subjects.stream_owner(nc.new_inbox())  # the connection's user key
    own = subjects.router_generate(owner)
    tgts = targets(secured, owner)
    outcomes = {t.name: Outcome() for t in tgts}
    work = [(t, cls, data) for t in tgts for cls, data in payloads(t, rng, nc.max_payload)]
    rng.shuffle(work)
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def send(target: Target, cls: str, data: bytes) -> None:
        out = outcomes[target.name]
        out.sent += 1
        async with sem:  # paced as the open fuzz's requests are (a flush waits for the server)
            if target.subject != own:  # not this client's: the server must refuse it
                await nc.publish(target.subject, data, reply=nc.new_inbox())
                await flushed(nc, REPLY_TIMEOUT_S)
                return
            try:
                reply = await nc.request(target.subject, data, timeout=REPLY_TIMEOUT_S)
            except NatsTimeoutError:
                out.failures.append(f"no reply within {REPLY_TIMEOUT_S} s to {cls}: {short(data)}")
                return
        verdict = classify(target, reply.data)
        if verdict in ("error", "valid"):
            setattr(out, verdict, getattr(out, verdict) + 1)
        else:
            out.failures.append(f"{cls}: {verdict}")

    dec, kvs = secured.instance("decode"), secured.instance("kvstore")
    garbage_targets = {subjects.heartbeat("decode", dec): {"v": SCHEMA_VERSION, "kind": "heartbeat"},
                       subjects.kv_events("kvstore", kvs): {"v": SCHEMA_VERSION, "kind": "kv_event"},
                       subjects.cancel(owner): {"v": SCHEMA_VERSION, "kind": "cancel", "request_id": "x",
                                                "stream_subject": f"_INBOX.{owner}.x"},
                       subjects.cancel(OTHER_OWNER): {"v": SCHEMA_VERSION, "kind": "cancel", "request_id": "x",
                                                      "stream_subject": f"_INBOX.{OTHER_OWNER}.x"}}
    sent = Counter()

    async def publish_garbage() -> None:
        prng = random.Random(SEED + 1)
        for i in range(PUBLISH_GARBAGE):
            subject = list(garbage_targets)[i % len(garbage_targets)]
            _cls, data = garbage_for_publish(prng, garbage_targets[subject], nc.max_payload, allow_huge=False)
            await nc.publish(subject, data)
            sent[subject] += 1
            await asyncio.sleep(0)

    during: list = []
    done = asyncio.Event()

    async def legit_loop() -> None:
        while not done.is_set():
            try:
                during.append(await legit_once(secured))
            except Exception as exc:  # noqa: BLE001 - a collateral failure, reported by the test
                during.append(f"{type(exc).__name__}: {exc}")

    legit = asyncio.create_task(legit_loop())
    await asyncio.gather(publish_garbage(), *(send(t, cls, d) for t, cls, d in work))
    await flushed(nc)
    expected = sum(o.sent for t, o in ((t, outcomes[t.name]) for t in tgts) if t.subject != own)
    for _ in range(100):  # the refusals trail the flush a little
        if sum(refusals(errors, t.subject) for t in tgts) >= expected:
            break
        await asyncio.sleep(0.1)
    for t in tgts:
        if t.subject != own:
            outcomes[t.name].refused = refusals(errors, t.subject)
    done.set()
    await legit
    await nc.close()
    try:
        after = await legit_once(secured)
    except Exception as exc:  # noqa: BLE001
        after = f"{type(exc).__name__}: {exc}"
    beats = await worker_beats(secured.url, wait_s=1.5, options=secured.operator)
    published = {s: (n, refusals(errors, s)) for s, n in sent.items()}
    return FuzzRun(outcomes, tgts, published, baseline, during, after, beats, time.monotonic() - start,
                   subjects.cancel(owner))


def name_of(subject: str, own_cancel: str) -> str:
    if subject.startswith(subjects.CANCEL_ALL[:-1]):
        return "cancel" if subject == own_cancel else "cancel (another key)"
    return subject.rsplit(".", 2)[-2]


def table(run: FuzzRun) -> str:
    rows = [f"bus fuzz as a client on a bus with identities, seed {SEED}, {run.seconds:.1f} s",
            f"{'subject':<18}{'sent':>6}{'ErrorReply':>12}{'valid':>7}{'refused':>9}{'bad':>5}"]
    for t in run.targets:
        o = run.outcomes[t.name]
        rows.append(f"{t.name:<18}{o.sent:>6}{o.error:>12}{o.valid:>7}{o.refused:>9}{len(o.failures):>5}")
    rows.append("published garbage (sent, refused): " + ", ".join(
        f"{name_of(s, run.own_cancel)} {v}" for s, v in run.published.items()))
    rows.append(f"legit rounds during the fuzz: {len(run.during)}")
    return "\n".join(rows)


def test_every_subject_was_fuzzed(fuzz, capsys):
    with capsys.disabled():
        print("\n" + table(fuzz))
    assert sorted(fuzz.outcomes) == sorted(SUBJECT_NAMES)


@pytest.mark.parametrize("name", SUBJECT_NAMES)
def test_a_client_reaches_only_its_own_subject(fuzz, name):
    out = fuzz.outcomes[name]
    assert out.sent > 0 and not out.failures, f"{name}: {out.failures[:5]}"
    if name == "router.generate":
        assert out.error + out.valid == out.sent and out.refused == 0, f"{name}: {out}"
    else:
        assert out.refused == out.sent, f"{name}: {out.sent} sent, only {out.refused} refused by the server"


def test_garbage_heartbeats_kv_events_and_others_cancels_are_refused_own_cancels_are_not(fuzz):
    assert fuzz.own_cancel in fuzz.published and len(fuzz.published) == 4, sorted(fuzz.published)
    for subject, (sent, refused) in fuzz.published.items():
        assert refused == (0 if subject == fuzz.own_cancel else sent), (subject, sent, refused)


def test_nothing_died_every_worker_beats_and_legit_requests_are_unharmed(fuzz, secured):
    secured.check_alive()
    want = {secured.instance("prefill"), secured.instance("decode"), secured.instance("kvstore")}
    assert want <= set(fuzz.beats), f"no heartbeat after the fuzz from {want - set(fuzz.beats)}"
    assert fuzz.during, "no legitimate round ran during the fuzz"
    collateral = [r for r in fuzz.during if r != fuzz.baseline]
    assert not collateral, f"{len(collateral)} of {len(fuzz.during)} rounds differ: {collateral[:2]}"
    assert fuzz.after == fuzz.baseline, fuzz.after
