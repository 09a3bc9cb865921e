"""Fixtures: the tiny model once per session; one real nats-server per session, real service
processes per module.

``tiny`` is the built-in tiny model on CPU in float32, loaded once for every test that asks for it
(treat it as read-only: engines and services share its weights). ``nats_server`` starts the
embedded server on a free port once. ``start_system`` launches ``tandem serve`` processes (router,
prefill, decode) against it and waits until each answers ``$SRV.PING``; module-scoped fixtures in
the test files use it so every module gets fresh services.

Helpers live in modules beside this file, never in test files: ``support`` (e2e prompts, bad
inputs, heartbeats), ``factories`` (engine, scheduler, block manager and request builders, engine
drivers), ``fakebus`` (an in-process NATS connection), ``cli_support`` (the ``tandem`` command in
child processes), ``model_support`` (small Hugging Face checkpoints), ``train_support`` (the
plain-PyTorch training reference).
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cli_support import launch, run_sync, service_env, stop_process

from tandem.cli.supervisor import wait_until_ready
from tandem.shared.infra.natsserver import NatsServer

if TYPE_CHECKING:
    from tandem.shared.model.loader import LoadedModel


def pytest_collection_modifyitems(config, items):
    """The folder says what a test costs: tests/e2e/ boot processes, tests/gpu/ need CUDA."""
    for item in items:
        parts = item.path.relative_to(config.rootpath / "tests").parts
        if parts[0] in ("e2e", "gpu"):
            item.add_marker(parts[0])


@pytest.fixture(autouse=True)
def free_gpu_memory_after_gpu_tests(request):
    """After each ``gpu`` test, collect its engines (their parts refer to each other, so only the
    collector frees their pools) and return the cached blocks: in one process the next GPU test
    (a training step near the cap, a 60 GiB KV pool) starts on an empty device, not on the last
    one's leftovers."""
    yield
    if request.node.get_closest_marker("gpu") is None:
        return
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The ``tiny`` spec as ``tandem serve`` loads it from an empty data dir (the checkpoint shipped
    in the package; its seeded random weights where the package lacks one), on CPU in float32.
    Never a checkpoint trained into this machine's data dir. The e2e tests compare the services'
    output with it, so it must be what the services load; a test that needs the random weights
    whatever is shipped loads ``load_model("tiny-random", ...)`` itself."""
    import torch  # here, not at the top: collecting the tests that never load a model needs no torch

    from tandem.shared.model.loader import load_model

    return load_model("tiny", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def nats_server():
    server = NatsServer.start()
    yield server
    server.stop()


@pytest.fixture
async def scripted(nats_server):
    """``await scripted(script, **connect_options)`` -> (a connected client, the router playing
    ``script``: see ``scripted_router``), on the session's nats-server."""
    from scripted_router import ScriptedRouter

    from tandem.client import connect

    routers, contexts = [], []

    async def start(script, **options):
        routers.append(await ScriptedRouter.start(nats_server.url, script))
        context = connect(nats_server.url, **{"worker_timeout_s": 5, **options})
        contexts.append(context)
        return await context.__aenter__(), routers[-1]

    yield start
    for context in contexts:
        await context.__aexit__(None, None, None)
    for router in routers:
        await router.close()


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
        stop_process(self.processes.pop(name), signal.SIGTERM, 20)

    def stop_all(self) -> None:
        """Routers first (no new placements), then every other service at once: each drains for
        its grace period in parallel, not one after the other."""
        routers = [n for n in self.processes if n.startswith("router")]
        for group in (routers, list(self.processes)):
            procs = {name: self.processes.pop(name) for name in group if name in self.processes}
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in procs.values():
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def restart(self, name: str) -> None:
        """Stop one service process and start it again with the same arguments and instance id."""
        proc = self.processes[name]
        self.stop(name)
        self.processes[name] = subprocess.Popen(proc.args, env=self.env, stdout=open(self.logdir / f"{name}.log", "ab"),
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # The whole system by name: a restarted router is ready once it has heard every worker here.
        want: dict[str, list[str]] = {}
        for instance in self.processes:
            want.setdefault(instance.split("-")[0], []).append(instance)
        run_sync(wait_until_ready(self.url, want, self.check_alive, 120))

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        assert not dead, f"service processes exited: {dead}\n{self.logs()}"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logdir.glob("*.log")))


@pytest.fixture(scope="module")
def start_system(nats_server, data_dir, tmp_path_factory):
    """Factory: ``start_system(prefill=1, decode=1, ...)`` -> a running :class:`System`.

    Module-scoped: every system a module started is stopped when the module ends, so modules
    never see each other's workers on the shared server."""
    systems: list[System] = []

    def start(prefill: int = 1, decode: int = 1, router: int = 1, model_args: list[str] = (),
              prefill_args: list[str] = (), decode_args: list[str] = (), kvstore: int = 0,
              kvstore_args: list[str] = (), router_args: list[str] = (), env: dict[str, str] | None = None) -> System:
        logdir = tmp_path_factory.mktemp("logs")
        system = System(nats_server.url, logdir, service_env(data_dir) | (env or {}))
        plan = [("kvstore", kvstore), ("decode", decode), ("prefill", prefill), ("router", router)]
        for service, count in plan:
            for i in range(count):
                name = f"{service}-{len(systems)}-{i}"
                if service == "kvstore":
                    extra = ["--kvstore-dir", str(logdir / name), *kvstore_args]
                else:
                    extra = [*model_args, *{"prefill": prefill_args, "decode": decode_args,
                                            "router": router_args}.get(service, ())]
                system.processes[name] = launch(nats_server.url, service, name, logdir, system.env, extra)
        # By name: the module's earlier systems share the server, and their instances must not stand in.
        want = {s: [n for n in system.processes if n.startswith(f"{s}-{len(systems)}-")] for s, n in plan if n}
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
