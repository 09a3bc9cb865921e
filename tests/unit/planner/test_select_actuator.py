"""The planner's wiring to its actuator (``services/planner/service.py``): which actuator runs where
(:func:`select_actuator`), the one-line refusal of one that cannot work, the decisions handed to it
in the background, and the ``drain`` it is given: hosts mapped to the workers beating from there,
each sent a ``DrainRequest`` over a real nats-server, waited for until its heartbeats stop.

The drain runs on two servers: an open one (the mapping) and one that requires identities, the
planner connecting with the planner role's key and the stand-in workers with theirs (the bus
permissions of ``shared/auth/roles.py`` must let the planner send drain requests).

Run: ``python3 -m pytest -q tests/unit/planner/test_select_actuator.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import nats
import pytest

from tandem.services.planner import service as planner_service
from tandem.services.planner.actuator import ActuatorError
from tandem.services.planner.kubernetes_actuator import INSTALL_HINT
from tandem.services.planner.policy import Decision
from tandem.services.planner.service import PlannerService, actuator_kind, in_compose, select_actuator
from tandem.shared.auth.credentials import connect_options
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra.config import Settings
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat

BEAT_S = 0.05


def account(folder, namespace: str = "tandem"):
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text("token")
    (folder / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nnot checked before the first call\n")
    (folder / "namespace").write_text(namespace)
    return folder


POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


# -- which actuator --------------------------------------------------------------------------------------
@pytest.mark.parametrize("chosen, pod_env, token, compose, expected", [
    ("auto", True, True, False, "kubernetes"),
    ("auto", True, True, True, "kubernetes"),  # a pod first: a compose check cannot be what is meant there
    ("auto", False, True, True, "docker"),
    ("auto", True, False, False, "up"),  # a pod without a service account token cannot act
    ("auto", False, False, False, "up"),
    ("up", True, True, True, "up"),
    ("docker", True, True, False, "docker"),
    ("kubernetes", False, False, False, "kubernetes"),
])
def test_actuator_kind(tmp_path, monkeypatch, chosen, pod_env, token, compose, expected):
    monkeypatch.setattr(planner_service, "in_compose", lambda: compose)
    folder = account(tmp_path / "sa") if token else tmp_path / "absent"
    settings = Settings(planner_actuator=chosen)
    got = actuator_kind(settings, POD_ENV if pod_env else {}, folder)
    assert got == expected, f"--planner-actuator {chosen}, pod env {pod_env}, token {token}, compose {compose}: {got}"


def test_in_compose_is_the_docker_actuators_answer_or_false_without_it():
    try:
        from tandem.services.planner.docker_actuator import in_compose_container
    except ImportError:
        assert in_compose() is False, "without the Docker actuator in this install, never compose"
    else:
        assert in_compose() is bool(in_compose_container())


async def test_up_selects_no_actuator(tmp_path):
    assert await select_actuator(Settings(planner_actuator="up"), POD_ENV, account(tmp_path / "sa")) is None


async def test_in_a_pod_auto_selects_kubernetes_in_the_accounts_namespace(tmp_path):
    pytest.importorskip("kubernetes")
    actuator = await select_actuator(Settings(planner_actuator="auto"), POD_ENV, account(tmp_path / "sa", "serving"))
    try:
        assert actuator is not None and actuator.where == "kubernetes"
        assert actuator.namespace == "serving", "the namespace comes from the service account's namespace file"
    finally:
        await actuator.close()


async def test_kubernetes_outside_a_pod_is_one_error(tmp_path):
    pytest.importorskip("kubernetes")
    with pytest.raises(ActuatorError, match="no in-cluster service account"):
        await select_actuator(Settings(planner_actuator="kubernetes"), {}, tmp_path)


def test_kubernetes_without_the_package_is_one_line_naming_the_extra(tmp_path):
    """A real ``tandem serve planner`` whose interpreter cannot import ``kubernetes``."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "kubernetes.py").write_text("raise ImportError('not installed (blocked by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "planner", "--planner-actuator", "kubernetes",
                           "--nats-url", "nats://127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, f"one line and a failure expected, got {done.returncode}: " \
                                                     f"{done.stderr!r}"
    assert INSTALL_HINT in lines[0] and lines[0].startswith("tandem serve planner:"), lines[0]


def test_an_actuator_that_cannot_work_here_stops_the_planner_with_one_line(nats_server, tmp_path):
    """Outside a pod, ``--planner-actuator kubernetes`` finds no service account once connected: the
    planner must not go on publishing decisions nobody carries out."""
    pytest.importorskip("kubernetes")
    env = {**os.environ, "TANDEM_DATA_DIR": str(tmp_path), "KUBERNETES_SERVICE_HOST": ""}
    done = subprocess.run([sys.executable, "-m", "tandem", "serve", "planner", "--planner-actuator", "kubernetes",
                           "--nats-url", nats_server.url, "--metrics-port", "-1"], env=env, capture_output=True,
                          text=True, timeout=60)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0, f"the planner must fail, not serve: {done.stderr[-2000:]}"
    assert last.startswith("tandem serve planner: kubernetes: no in-cluster service account"), done.stderr[-2000:]


# -- decisions handed to the actuator ----------------------------------------------------------------------
class Recording:
    """An actuator that records its calls; ``fail`` makes a service's steps refused, ``hold`` keeps
    the first step waiting until released."""

    where = "recording"

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, int]] = []
        self.drains: list = []
        self.fail = fail
        self.hold = asyncio.Event()
        self.hold.set()
        self.closed = False

    async def replicas(self, service: str) -> int:
        return 0

    async def scale(self, service: str, wanted: int, drain) -> int:
        self.calls.append((service, wanted))
        self.drains.append(drain)
        await self.hold.wait()
        if service == self.fail:
            raise ActuatorError(f"{service} refused")
        return wanted

    async def close(self) -> None:
        self.closed = True


def decision(prefill: int, decode: int) -> Decision:
    return Decision(prefill=prefill, decode=decode, reason="test", changed=True)


async def test_a_decision_scales_prefill_then_decode_with_drains_for_each():
    actuator = Recording()
    planner = PlannerService(Settings(), actuator)
    planner.actuate(decision(2, 3))
    await asyncio.wait_for(planner.acting, 5)
    assert actuator.calls == [("prefill", 2), ("decode", 3)]
    assert [d.args for d in actuator.drains] == [("prefill",), ("decode",)], \
        "each step's drain must be bound to the service it scales"


async def test_decisions_made_during_a_step_are_taken_up_after_it():
    actuator = Recording()
    actuator.hold.clear()
    planner = PlannerService(Settings(), actuator)
    planner.actuate(decision(1, 4))
    await asyncio.sleep(0.05)
    planner.actuate(decision(1, 2))
    planner.actuate(decision(2, 1))  # only the newest counts
    actuator.hold.set()
    await asyncio.wait_for(planner.acting, 5)
    assert actuator.calls == [("prefill", 1), ("decode", 4), ("prefill", 2), ("decode", 1)], actuator.calls


async def test_a_refused_step_is_logged_and_tried_again(caplog):
    actuator = Recording(fail="decode")
    planner = PlannerService(Settings(), actuator)
    with caplog.at_level(logging.WARNING, logger="tandem.planner"):
        planner.actuate(decision(1, 3))
        await asyncio.wait_for(planner.acting, 5)
    assert planner.act_failed, "a failed step must be marked for another try"
    assert any("decode not scaled to 3" in r.getMessage() and "decode refused" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    planner.actuate()  # what the loop does at its next interval
    await asyncio.wait_for(planner.acting, 5)
    assert actuator.calls[-2:] == [("prefill", 1), ("decode", 3)], "the same target again"


async def test_without_an_actuator_nothing_is_started():
    planner = PlannerService(Settings())
    planner.actuate(decision(1, 1))
    assert planner.acting is None


# -- the drain, over a real nats-server ----------------------------------------------------------------
@pytest.fixture(scope="module")
def keyring_server():
    ring = Keyring.generate()
    server = NatsServer.start(auth_config=ring.server_config(), jetstream=False)
    yield server, ring
    server.stop()


@pytest.fixture(params=["open", "identities"])
def bus(request, nats_server, keyring_server):
    """(url, role -> nats.connect options for a connection named so)."""
    if request.param == "open":
        return nats_server.url, lambda role, name: {}
    server, ring = keyring_server
    return server.url, lambda role, name: connect_options(ring.role_key(role), name)


class StandIn:
    """A worker on its own connection: beats as ``service``/``instance`` from ``host``, answers its
    drain subject with an Ack and then stops beating (as a drained worker exits), unless ``stubborn``."""

    def __init__(self, service: str, instance: str, host: str, stubborn: bool = False) -> None:
        self.service, self.instance, self.host, self.stubborn = service, instance, host, stubborn
        self.drain_requests: list[DrainRequest] = []
        self.left_at: float | None = None  # time.monotonic() of its last heartbeat after a drain
        self.beating = True

    async def start(self, url: str, options: dict) -> None:
        self.nc = await nats.connect(url, **options)
        await self.nc.subscribe(subjects.drain(self.service, self.instance), cb=self.on_drain)
        self.task = asyncio.create_task(self.beat())

    async def on_drain(self, msg) -> None:
        self.drain_requests.append(decode(msg.data, DrainRequest))
        await msg.respond(encode(Ack()))
        if not self.stubborn:
            await asyncio.sleep(0.1)  # finishing what it holds
            self.beating = False
            self.left_at = time.monotonic()

    async def beat(self) -> None:
        beat = Heartbeat(service=self.service, instance_id=self.instance, host=self.host, pid=os.getpid(), model="m")
        while self.beating:
            await self.nc.publish(subjects.heartbeat(self.service, self.instance), encode(beat))
            await asyncio.sleep(BEAT_S)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.nc.close()


@pytest.fixture
async def fleet(bus):
    """``await fleet(*stand_ins)`` -> a PlannerService connected as the planner role that has heard
    every stand-in's heartbeats."""
    url, options = bus
    started: list[StandIn] = []
    planners: list[PlannerService] = []

    async def start(*workers: StandIn) -> PlannerService:
        planner = PlannerService(Settings(nats_url=url, worker_timeout_s=0.4, drain_timeout_s=2.0,
                                          instance_id="planner-test"))
        planner.nc = await nats.connect(url, **options("planner", planner.instance_id))
        planners.append(planner)
        await planner.nc.subscribe(subjects.HEARTBEAT_ALL, cb=planner.on_heartbeat)
        for worker in workers:
            await worker.start(url, options(worker.service, worker.instance))
            started.append(worker)
        for _ in range(100):
            if all(w.instance in planner.beats for w in workers):
                break
            await asyncio.sleep(BEAT_S)
        assert all(w.instance in planner.beats for w in workers), "the planner never heard the stand-ins beat"
        return planner

    yield start
    for worker in started:
        await worker.stop()
    for planner in planners:
        await planner.nc.close()


async def test_drain_asks_exactly_the_services_workers_on_those_hosts_and_waits_until_they_leave(fleet, bus):
    gone = StandIn("decode", "decode-b", "pod-b")
    also_gone = StandIn("decode", "decode-b2", "pod-b")  # a restarted container beats from its pod too
    stays = StandIn("decode", "decode-a", "pod-a")
    other_service = StandIn("prefill", "prefill-b", "pod-b")
    planner = await fleet(gone, also_gone, stays, other_service)
    left = await asyncio.wait_for(planner.drain_hosts("decode", ["pod-b", "pod-none"]), 10)
    assert len(gone.drain_requests) == 1 and len(also_gone.drain_requests) == 1, \
        "each decode worker on pod-b must get one DrainRequest" + (
            " (the planner role may not publish tandem.v1.<service>.<id>.drain: shared/auth/roles.py)"
            if bus[1]("planner", "x") else "")
    assert gone.drain_requests[0].exit is True, "a scale-down's drain ends the worker's process"
    assert stays.drain_requests == [] and other_service.drain_requests == [], \
        "only the named service's workers on the named hosts are drained"
    assert left == ["pod-b", "pod-none"], f"both hosts are empty of decode workers now; got {left}"
    assert planner.gone("decode-b") and not planner.gone("decode-a")


async def test_a_worker_still_beating_at_the_timeout_keeps_its_host_out_of_the_answer(fleet):
    busy = StandIn("decode", "decode-busy", "pod-busy", stubborn=True)
    done = StandIn("decode", "decode-done", "pod-done")
    planner = await fleet(busy, done)
    started = asyncio.get_running_loop().time()
    left = await asyncio.wait_for(planner.drain_hosts("decode", ["pod-busy", "pod-done"]), 10)
    waited = asyncio.get_running_loop().time() - started
    assert left == ["pod-done"], f"only the host whose worker left counts as drained; got {left}"
    assert busy.drain_requests, "the busy worker was asked all the same"
    assert 1.9 <= waited < 5, f"the wait must end at the drain timeout (2 s), not before or long after: {waited:.1f}s"


async def test_a_scale_down_through_the_planner_drains_the_pods_workers_before_any_patch(fleet):
    """The whole path: the planner's decision, the Kubernetes actuator against the fake API server,
    its drain of the chosen pods mapped to the workers beating from them over the bus."""
    pytest.importorskip("kubernetes")
    from fake_kubernetes import FakeKubernetes
    from kubernetes import client

    from tandem.services.planner.kubernetes_actuator import KubernetesActuator

    fake = FakeKubernetes(namespace="tandem")
    fake.add_deployment("tandem-prefill", "prefill", 1)
    fake.add_deployment("tandem-decode", "decode", 3)
    fake.start()
    try:
        pods = fake.pod_names("tandem-decode")
        workers = [StandIn("decode", f"decode-{i}", pod) for i, pod in enumerate(pods)]
        planner = await fleet(StandIn("prefill", "prefill-0", fake.pod_names("tandem-prefill")[0]), *workers)
        planner.actuator = KubernetesActuator(client.ApiClient(client.Configuration(host=fake.url)), "tandem")
        planner.actuate(decision(1, 1))
        await asyncio.wait_for(planner.acting, 20)
        await planner.actuator.close()
        assert fake.pod_names("tandem-decode") == [pods[0]], "the two newest pods should be gone"
        assert [len(w.drain_requests) for w in workers] == [0, 1, 1], "the workers of the pods to go, drained once"
        patches = fake.of("PATCH")
        assert patches and min(r.at for r in patches) > max(w.left_at for w in workers[1:]), \
            "no pod or scale patch before both drained workers had left"
        assert fake.pod_names("tandem-prefill") != [] and not fake.of("PATCH", "tandem-prefill/scale"), \
            "prefill was at its wanted count: untouched"
    finally:
        fake.stop()
