"""Fixtures: one real nats-server per session, real service processes per module.

``nats_server`` starts the embedded server on a free port once. ``start_system`` launches
``tandem serve`` processes (router, prefill, decode) against it and waits until each answers
``$SRV.PING``; module-scoped fixtures in the test files use it so every module gets fresh services.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tandem.shared.infra.natsserver import NatsServer
from tandem.supervisor import wait_until_ready


@pytest.fixture(scope="session")
def nats_server():
    server = NatsServer.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """An empty data dir, so a trained tiny checkpoint on this machine never changes test outputs."""
    return tmp_path_factory.mktemp("tandem-data")


@dataclass
class System:
    url: str
    logdir: Path
    env: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def instance(self, service: str) -> str:
        return next(name for name in self.processes if name.startswith(service))

    def stop(self, name: str) -> None:
        proc = self.processes.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for name in [n for n in self.processes if n.startswith("router")] + list(self.processes):
            if name in self.processes:
                self.stop(name)

    def restart(self, name: str) -> None:
        """Stop one service process and start it again with the same arguments and instance id."""
        proc = self.processes[name]
        self.stop(name)
        self.processes[name] = subprocess.Popen(proc.args, env=self.env, stdout=open(self.logdir / f"{name}.log", "ab"),
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        service = name.split("-")[0]
        want = {service: sum(n.startswith(service) for n in self.processes)}
        run_sync(wait_until_ready(self.url, want, self.check_alive, 120))

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        assert not dead, f"service processes exited: {dead}\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logdir.glob("*.log")))


def service_env(data_dir: Path) -> dict[str, str]:
    # CPU unless a test passes --device; one thread each, as `tandem up` would share out 2 cores.
    return dict(os.environ, TANDEM_DATA_DIR=str(data_dir), TANDEM_PROBE_INTERVAL_S="0.5",
                TANDEM_HEARTBEAT_INTERVAL_S="0.2", TANDEM_DEVICE="cpu", TANDEM_TORCH_THREADS="1",
                PYTHONUNBUFFERED="1")


def launch(url: str, service: str, instance_id: str, logdir: Path, env: dict[str, str], args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "serve", service, "--nats-url", url,
           "--instance-id", instance_id, *args]
    log = open(logdir / f"{instance_id}.log", "wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def run_sync(coro):
    """Run a coroutine to the end on a private loop in another thread: callers may be sync fixtures
    or async tests whose own loop is running."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture(scope="module")
def start_system(nats_server, data_dir, tmp_path_factory):
    """Factory: ``start_system(prefill=1, decode=1, ...)`` -> a running :class:`System`.

    Module-scoped: every system a module started is stopped when the module ends, so modules
    never see each other's workers on the shared server."""
    systems: list[System] = []

    def start(prefill: int = 1, decode: int = 1, router: int = 1, model_args: list[str] = (),
              prefill_args: list[str] = (), decode_args: list[str] = (), kvstore: int = 0,
              kvstore_args: list[str] = ()) -> System:
        logdir = tmp_path_factory.mktemp("logs")
        system = System(nats_server.url, logdir, service_env(data_dir))
        plan = [("kvstore", kvstore), ("decode", decode), ("prefill", prefill), ("router", router)]
        for service, count in plan:
            for i in range(count):
                name = f"{service}-{len(systems)}-{i}"
                if service == "kvstore":
                    extra = ["--kvstore-dir", str(logdir / name), *kvstore_args]
                else:
                    extra = [*model_args, *{"prefill": prefill_args, "decode": decode_args}.get(service, ())]
                system.processes[name] = launch(nats_server.url, service, name, logdir, system.env, extra)
        want = {s: n for s, n in plan if n}
        try:
            run_sync(wait_until_ready(nats_server.url, want, system.check_alive, 120))
        except BaseException:
            system.stop_all()
            print(system.logs())
            raise
        systems.append(system)
        return system

    yield start
    for system in systems:
        system.stop_all()
