"""compose/docker-compose.yml brought up on a real Docker engine, and the planner's Docker actuator
scaling it.

Everything is real: dockerd (started here when none runs, see ``docker_support``), the stand-in
base images made by ``compose/dev/standin_images.py`` (no registry is reachable here), the tandem
image built from ``compose/Dockerfile`` as it stands, nats-server and every tandem service in
its own container, the KV hand-off as NATS frames between the prefill and decode containers.

In order (the tests share one compose project, module-scoped):

1. a request goes router -> prefill -> decode, the KV as NATS frames between containers;
2. the HTTP frontend answers on the host's published port 8000 (/health, /v1/models, a completion)
   and its container's health check turns healthy;
3. ``--scale decode=2`` gives two decode workers and both serve;
4. a container whose process is killed comes back by its restart policy and serves again;
5. :class:`DockerActuator` scales decode 1 -> 2 -> 1 from outside: it copies a replica, then
   drains the newest before removing it, and a stream in flight on that one completes;
6. inside the planner's container (with the socket, ``compose/dev/planner-docker-socket.yml``) the
   actuator finds its compose project from its own labels; without the socket it says it cannot act;
7. the planner itself, ``--planner-actuator auto`` there, carries out an operator's scale requests.

Slow (``-m slow``; ``.ci/run`` runs it) and marked ``docker``. On this project's 2-core machine:
about 7 minutes from nothing (apt, debootstrap, torch's image layer, pip from PyPI), about 2 once
the images are cached (40 s of it rebuilding the ``pip install .`` layer after a source change).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import nats
import pytest
from docker_support import COMPOSE_DIR, Compose, DockerEngine, docker_engine, port_taken, progress, tandem_images

from tandem.cli.supervisor import wait_until_ready
from tandem.client import Completion, connect
from tandem.client.access import bus_options
from tandem.client.discovery import gather_replies
from tandem.services.planner.docker_actuator import DockerActuator
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat, ScaleRequest, ScalingDecision

__all__ = ["docker_engine", "tandem_images"]  # fixtures from docker_support, used by name below

pytestmark = [pytest.mark.slow, pytest.mark.docker]

PROJECT = "tandemtest"
URL = "nats://127.0.0.1:4222"  # the compose file publishes nats on the host's 4222
HTTP_PORT = 8000  # and the frontend's OpenAI-compatible API on the host's 8000
READY_TIMEOUT_S = 180


@dataclass
class ComposeSystem:
    compose: Compose
    client_key: str
    operator_key: str

    def operator(self) -> dict:
        return bus_options("operator", "compose-test", URL, creds=self.operator_key)

    def check(self) -> None:
        """Fails at once, with the logs, when a tandem container crash-loops (its restart policy hides it)."""
        for service in ("router", "frontend", "prefill", "decode", "kvstore", "planner"):
            for container in self.compose.containers(service):
                state = container["State"]
                if state["Restarting"] or (not state["Running"] and state["ExitCode"] not in (0, 137)):
                    raise AssertionError(f"{container['Name']} keeps failing (exit {state['ExitCode']}):\n"
                                         f"{self.compose.logs(service)}")

    async def ready(self, **want: int) -> None:
        last = [0.0]

        def check() -> None:  # docker inspect costs; every 2 s is enough
            if time.monotonic() - last[0] > 2:
                last[0] = time.monotonic()
                self.check()

        try:
            await wait_until_ready(URL, want, check, READY_TIMEOUT_S, options=self.operator())
        except RuntimeError as exc:
            raise AssertionError(f"{exc}\n{self.compose.logs()}") from None


@pytest.fixture(scope="module")
def system(docker_engine: DockerEngine, tandem_images: str, tmp_path_factory) -> Iterator[ComposeSystem]:
    for port, what in ((4222, "nats"), (HTTP_PORT, "the HTTP frontend")):
        if port_taken(port):
            pytest.fail(f"port {port} on this host is taken: stop what listens there (compose publishes {what} on "
                        "it)", pytrace=False)
    tmp = tmp_path_factory.mktemp("compose")
    (tmp / "models").mkdir()
    # An empty models folder of our own (the default ./models would appear in the work tree), and the
    # planner advisory: only this test's actuator scales here.
    env = {"TANDEM_MODELS_DIR": str(tmp / "models"), "TANDEM_PLANNER_ACTUATOR": "up"}
    compose = Compose(docker_engine, PROJECT, env=env)
    compose.run("down", "-v", "--remove-orphans", check=False)  # what a killed run left
    started = time.monotonic()
    progress("docker-compose up -d")
    compose.run("up", "-d", "--no-build")
    keys = {}
    for role in ("client", "operator"):
        path = tmp / f"{role}.key"
        path.write_text(compose.file_from("router", f"/auth/{role}.key"))
        path.chmod(0o600)
        keys[role] = str(path)
    system = ComposeSystem(compose, keys["client"], keys["operator"])
    try:
        asyncio.run(system.ready(router=1, frontend=1, prefill=1, decode=1, kvstore=1))
        assert compose.running("planner"), f"the planner is not running:\n{compose.logs('planner')}"
        progress(f"compose project {PROJECT} serving ({time.monotonic() - started:.0f} s after up)")
        yield system
    finally:
        progress("docker-compose down -v")
        compose.run("down", "-v", "--remove-orphans", timeout_s=300)
        left = compose.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
        assert not left, f"containers of {PROJECT} left after down: {left}"


def host_of(instance_id: str) -> str:
    """A worker's host from its instance id (``decode-<hostname>-<suffix>``)."""
    return instance_id.split("-")[1]


async def complete(system: ComposeSystem, prompt: str, **params) -> Completion:
    async with connect(URL, creds=system.client_key) as client:
        return await client.complete(prompt, temperature=0, **params)


async def test_request_goes_router_prefill_decode(system: ComposeSystem) -> None:
    started = time.monotonic()
    result = await complete(system, "def fibonacci(n):\n    # the n-th Fibonacci number, computed", max_tokens=32,
                            min_tokens=32)
    progress(f"32 tokens in {time.monotonic() - started:.2f} s (ttft {result.ttft_s * 1e3:.0f} ms)")
    assert len(result.token_ids) == 32, f"got {len(result.token_ids)} tokens, asked for 32: {result}"
    assert result.prefill_worker and result.prefill_worker.startswith("prefill-"), \
        f"the router did not use the prefill worker (prefill_worker={result.prefill_worker!r})"
    prefill_hosts = {c["Config"]["Hostname"] for c in system.compose.running("prefill")}
    decode_hosts = {c["Config"]["Hostname"] for c in system.compose.running("decode")}
    assert host_of(result.prefill_worker) in prefill_hosts and host_of(result.decode_worker) in decode_hosts, \
        f"workers {result.prefill_worker}, {result.decode_worker} are not on {prefill_hosts}, {decode_hosts}"
    nc = await nats.connect(URL, **system.operator())
    try:
        stats = await gather_replies(nc, "$SRV.STATS.tandem-decode", 1.0)
    finally:
        await nc.close()
    data = [e.get("data") or {} for s in stats for e in s.get("endpoints") or []]
    nats_frames = sum(d.get("kv_transfers_nats", 0) for d in data)
    ring = sum(d.get("kv_transfers_ring", 0) for d in data)
    assert nats_frames >= 1 and ring == 0, \
        f"the KV hand-off should go as NATS frames between containers: nats={nats_frames}, ring={ring}"


async def test_frontend_serves_http_on_the_published_port_and_turns_healthy(system: ComposeSystem) -> None:
    """The OpenAI-compatible API from the host, through the published port; the container's own
    health check (its /health, run inside it by the engine) says healthy."""
    base = f"http://127.0.0.1:{HTTP_PORT}"
    async with httpx.AsyncClient(timeout=60) as http:
        health = await http.get(f"{base}/health")
        assert health.status_code == 200, health.text
        models = (await http.get(f"{base}/v1/models")).json()["data"]
        answer = await http.post(f"{base}/v1/completions", json={
            "model": models[0]["id"], "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("length", "stop"), answer.json()
    deadline = time.monotonic() + 90  # a few health-check intervals
    while True:
        health_state = system.compose.running("frontend")[0]["State"].get("Health", {}).get("Status")
        if health_state == "healthy":
            break
        assert time.monotonic() < deadline, f"the frontend's health check says {health_state!r}:\n" \
                                            f"{system.compose.logs('frontend')}"
        await asyncio.sleep(1)


async def test_scale_decode_to_two_and_both_serve(system: ComposeSystem) -> None:
    progress("docker-compose up -d --scale decode=2")
    system.compose.run("up", "-d", "--no-build", "--scale", "decode=2")
    await system.ready(decode=2)
    hosts = {c["Config"]["Hostname"] for c in system.compose.running("decode")}
    assert len(hosts) == 2, f"want 2 decode containers running, have {hosts}"
    served: set[str] = set()
    for round_ in range(6):  # concurrent requests spread by load: the router counts what it just placed
        results = await asyncio.gather(*(complete(system, f"# round {round_} request {i}\nimport ", max_tokens=24,
                                                  min_tokens=24) for i in range(4)))
        served |= {host_of(r.decode_worker) for r in results}
        if served == hosts:
            break
    assert served == hosts, f"decode containers {hosts}, only {served} served in 6 rounds of 4 requests"


async def test_killed_container_comes_back(system: ComposeSystem) -> None:
    """A container whose process dies (SIGKILL from the host, as the OOM killer would) comes back by
    its restart policy. Not ``docker kill``: the engine takes that for a manual stop and leaves the
    container stopped whatever the policy says (moby marks it HasBeenManuallyStopped)."""
    victim = system.compose.running("decode")[0]
    name, restarts = victim["Name"].lstrip("/"), victim["RestartCount"]
    progress(f"SIGKILL to {name}'s process {victim['State']['Pid']}")
    os.kill(victim["State"]["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        now = json.loads(system.compose.docker("inspect", name).stdout)[0]
        if now["State"]["Running"] and now["RestartCount"] > restarts:
            break
        assert time.monotonic() < deadline, \
            f"{name} not back 60 s after its process was killed (state {now['State']['Status']}, " \
            f"restarts {now['RestartCount']}): its restart policy is {now['HostConfig']['RestartPolicy']}"
        await asyncio.sleep(0.5)
    await system.ready(decode=2)
    host = now["Config"]["Hostname"]
    for i in range(6):
        results = await asyncio.gather(*(complete(system, f"# after the kill {i}.{j}\n", max_tokens=8)
                                         for j in range(4)))
        if host in {host_of(r.decode_worker) for r in results}:
            break
    else:
        pytest.fail(f"{name} came back (restart policy) but served none of 24 requests")


class Fleet:
    """Heartbeats on the bus, and the drain the planner would send: a DrainRequest to each worker of
    a host, then waiting until its container stopped (the actuator took its restart policy away)."""

    def __init__(self, nc: nats.NATS, compose: Compose) -> None:
        self.nc, self.compose = nc, compose
        self.beats: dict[str, Heartbeat] = {}
        self.drained_at: dict[str, float] = {}
        self.left: list[str] = []  # hosts whose container stopped by itself after the drain

    async def start(self) -> None:
        async def on_beat(msg) -> None:
            beat = decode(msg.data, Heartbeat)
            self.beats[beat.instance_id] = beat

        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)

    async def wait_for_host(self, service: str, host: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            found = [b.instance_id for b in self.beats.values() if b.service == service and b.host == host
                     and not b.draining]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no {service} worker on host {host} beat in {timeout_s:.0f} s"
            await asyncio.sleep(0.2)

    async def drain(self, hosts: list[str]) -> list[str]:
        left = []
        for host in hosts:
            self.drained_at[host] = time.monotonic()
            for beat in [b for b in self.beats.values() if b.host == host]:
                await self.nc.request(subjects.drain(beat.service, beat.instance_id), encode(DrainRequest(exit=True)),
                                      timeout=5)
        for host in hosts:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                inspected = self.compose.docker("inspect", host, check=False)
                if inspected.returncode != 0 or not json.loads(inspected.stdout)[0]["State"]["Running"]:
                    left.append(host)
                    break
                await asyncio.sleep(0.2)
        self.left = left
        return left


async def test_docker_actuator_scales_decode_and_drains_first(system: ComposeSystem, docker_engine) -> None:
    compose = system.compose
    compose.run("up", "-d", "--no-build", "--scale", "decode=1")
    actuator = DockerActuator(PROJECT, socket_file=docker_engine.socket_file)
    nc = await nats.connect(URL, **system.operator())
    fleet = Fleet(nc, compose)
    await fleet.start()
    try:
        assert await actuator.replicas("decode") == 1, f"decode containers: {compose.running('decode')}"
        first = compose.running("decode")[0]

        async def no_drain(hosts: list[str]) -> list[str]:
            raise AssertionError(f"scaling up must drain nobody, drained {hosts}")

        progress("actuator: decode 1 -> 2")
        assert await actuator.scale("decode", 2, no_drain) == 2
        containers = compose.running("decode")
        assert len(containers) == 2, f"want 2 decode containers after scaling up, have {len(containers)}"
        new = containers[-1]
        number = int(new["Config"]["Labels"]["com.docker.compose.container-number"])
        assert new["Name"] == f"/{PROJECT}_decode_{number}" and number > int(
            first["Config"]["Labels"]["com.docker.compose.container-number"]), \
            f"the new replica should be compose's next one, is {new['Name']}"
        assert new["Config"]["Hostname"] != first["Config"]["Hostname"], "the copy took the template's hostname"
        assert new["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped", "the copy lost the restart policy"
        listed = compose.run("ps", "-q", "decode").stdout.split()
        assert new["Id"] in listed, f"docker-compose ps does not count the new replica as decode's: {listed}"
        new_host = new["Config"]["Hostname"]
        await fleet.wait_for_host("decode", new_host)
        await system.ready(decode=2)

        # Streams on both workers; the one on the new replica (the newest: the one to go) is in flight
        # while the actuator scales down.
        async with connect(URL, creds=system.client_key) as client:
            tokens = 1200
            others = []
            victim_stream = None
            for i in range(8):
                stream = client.stream(f"# stream {i}\n", max_tokens=tokens, min_tokens=tokens, temperature=0)
                received: list[int] = []
                task = asyncio.create_task(collect(stream, received, fleet))
                while stream.accepted is None and not task.done():
                    await asyncio.sleep(0.01)
                if stream.accepted is not None and host_of(stream.accepted.decode_worker) == new_host:
                    victim_stream = (stream, task, received)
                    break
                others.append((stream, task))
            assert victim_stream is not None, f"no stream of 8 was placed on the new replica {new_host}"
            stream, task, received = victim_stream
            progress("actuator: decode 2 -> 1, with a stream in flight on the newest")
            assert await actuator.scale("decode", 1, fleet.drain) == 1
            assert list(fleet.drained_at) == [new_host], \
                f"the newest replica ({new_host}) should have been drained, drained {list(fleet.drained_at)}"
            at_drain = await asyncio.wait_for(task, 60)
            progress(f"the stream had {at_drain} of {tokens} tokens when the drain began; it got {len(received)}")
            assert fleet.left == [new_host], \
                f"{new_host}'s worker should have left by itself after the drain, not been stopped: left {fleet.left}"
            assert at_drain is not None and at_drain < tokens, \
                f"the stream had finished before the drain ({at_drain} of {tokens} tokens): make it longer"
            assert len(received) == tokens and stream.migrations == 0, \
                f"the stream on the drained replica got {len(received)} of {tokens} tokens, " \
                f"{stream.migrations} migrations: it should have completed where it was"
            for other, other_task in others:
                other_task.cancel()
                await other.aclose()
        gone = compose.docker("inspect", new["Id"], check=False)
        assert gone.returncode != 0, f"{new['Name']} should be removed after the scale-down"
        assert [c["Id"] for c in compose.running("decode")] == [first["Id"]], "the first replica should stay"
    finally:
        await nc.close()
        await actuator.close()


async def collect(stream, received: list[int], fleet: Fleet) -> int | None:
    """Reads a stream to its end into ``received``; returns how many tokens it had when the first
    drain began (None: it ended before any)."""
    at_drain = None
    async for chunk in stream:
        if at_drain is None and fleet.drained_at:
            at_drain = len(received)
        received.extend(chunk.token_ids)
    return at_drain


def planner_with_socket(system: ComposeSystem, engine: DockerEngine, actuator: str) -> Compose:
    """The planner container made again with the engine's socket (compose/dev/planner-docker-socket.yml)
    and ``--planner-actuator actuator``."""
    env = {**system.compose.env, "TANDEM_DOCKER_SOCKET": engine.socket_file,
           "TANDEM_DOCKER_GID": str(os.stat(engine.socket_file).st_gid), "TANDEM_PLANNER_ACTUATOR": actuator}
    with_socket = Compose(engine, PROJECT, env=env, extra_files=[COMPOSE_DIR / "dev" / "planner-docker-socket.yml"])
    progress(f"planner recreated with the Docker socket, actuator {actuator}")
    with_socket.run("up", "-d", "--no-build", "--no-deps", "planner")
    return with_socket


async def test_actuator_finds_its_project_inside_the_planner(system: ComposeSystem, docker_engine) -> None:
    with_socket = planner_with_socket(system, docker_engine, "up")
    probe = ("import asyncio, json\n"
             "from tandem.services.planner.docker_actuator import DockerActuator, in_compose_container\n"
             "async def main():\n"
             "    actuator = await DockerActuator.from_environment()\n"
             "    try:\n"
             "        print(json.dumps({'inside': in_compose_container(), 'project': actuator.project,\n"
             "                          'decode': await actuator.replicas('decode'),\n"
             "                          'prefill': await actuator.replicas('prefill')}))\n"
             "    finally:\n"
             "        await actuator.close()\n"
             "asyncio.run(main())\n")
    found = json.loads(with_socket.run("exec", "-T", "planner", "python", "-c", probe).stdout.strip().splitlines()[-1])
    assert found == {"inside": True, "project": PROJECT, "decode": 1, "prefill": 1}, \
        f"the planner's actuator should find project {PROJECT} with 1 decode and 1 prefill: {found}"
    outside = ("from tandem.services.planner.docker_actuator import in_compose_container\n"
               "print(in_compose_container())\n")
    answer = system.compose.run("exec", "-T", "router", "python", "-c", outside).stdout.strip()
    assert answer == "False", f"without the socket a container cannot act, yet in_compose_container() said {answer}"


async def test_planner_scales_compose_itself(system: ComposeSystem, docker_engine) -> None:
    """The planner picks the Docker actuator by itself (auto, in a compose container with the socket)
    and carries out an operator's scale requests: decode 1 -> 2 -> 1."""
    with_socket = planner_with_socket(system, docker_engine, "auto")
    nc = await nats.connect(URL, **system.operator())
    try:
        await system.ready(planner=1)
        for wanted in (2, 1):
            reply = await nc.request(subjects.PLANNER_SCALE, encode(ScaleRequest(decode=wanted, reason="test")),
                                     timeout=10)
            decision = decode(reply.data, ScalingDecision)
            assert decision.decode_wanted == wanted, f"the planner would not take decode={wanted}: {decision}"
            deadline = time.monotonic() + 90
            while len(running := system.compose.running("decode")) != wanted:
                assert time.monotonic() < deadline, \
                    f"the planner did not bring decode to {wanted} (runs {len(running)}):\n" \
                    f"{with_socket.logs('planner')}"
                await asyncio.sleep(0.5)
            progress(f"the planner brought decode to {wanted}")
            if wanted == 2:  # the new worker serving, so that the scale-down has a worker to drain
                first = running[0]["Id"]
                await system.ready(decode=2)
        assert [c["Id"] for c in system.compose.running("decode")] == [first], "the newest replica should go"
    finally:
        await nc.close()
    log = with_socket.logs("planner", lines=200)
    assert "docker actuator: compose project" in log, f"the planner did not use the Docker actuator:\n{log}"
