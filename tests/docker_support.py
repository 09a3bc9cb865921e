"""A real Docker engine for the tests that bring compose up: installed, started and stopped here.

``docker_engine`` (session-scoped, yield teardown) gives a running engine: one that already answers
(``DOCKER_HOST`` or ``/var/run/docker.sock``; left running afterwards), else a ``dockerd`` started
here with its own socket, pid file and exec root under ``/run/tandem-dockerd`` and its data root in
``~/.cache/tandem/dockerd`` (the images and build cache stay there, so a second run on one machine
builds nothing), stopped at the end. Debian's ``docker.io``, ``docker-compose`` and ``debootstrap``
are installed with apt where missing. An engine that cannot start here for want of privileges
(no root, no namespaces, no overlay) skips the tests with one line; any other failure fails them.

``tandem_images`` makes the stand-in base images and ``tandem:latest`` on it
(``compose/dev/standin_images.py``). :class:`Compose` runs ``docker-compose`` on the repository's
compose file under a project name of the test's own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
from cli_support import stop_process

REPO = Path(__file__).resolve().parents[1]
COMPOSE_DIR = REPO / "compose"
RUN_DIR = Path("/run/tandem-dockerd")  # short: containerd's sockets go under the exec root
DATA_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "dockerd"
APT_PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
# Lines of dockerd's log that mean this machine cannot run an engine at all (a skip, not a failure).
CANNOT_RUN = ("operation not permitted", "permission denied", "no such file or directory: /sys/fs/cgroup",
              "failed to mount overlay", "devmapper", "iptables failed", "is not supported")


def progress(message: str) -> None:
    print(f"[docker {time.strftime('%H:%M:%S')}] {message}", flush=True)


@functools.cache
def standin_images() -> ModuleType:
    """``compose/dev/standin_images.py``, which is a script beside the compose file, not a package."""
    path = COMPOSE_DIR / "dev" / "standin_images.py"
    spec = importlib.util.spec_from_file_location("tandem_standin_images", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_installed() -> None:
    missing = sorted({pkg for binary, pkg in APT_PACKAGES.items() if shutil.which(binary) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        pytest.skip(f"needs {', '.join(missing)} installed, and root to install them with apt")
    if shutil.which("apt-get") is None:
        pytest.skip(f"needs {', '.join(missing)} (no apt-get here to install them)")
    progress(f"apt-get install {' '.join(missing)} (about a minute)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    started = time.monotonic()
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *missing]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.fail(f"`{' '.join(command)}` failed: {tail}", pytrace=False)
    progress(f"installed {' '.join(missing)} ({time.monotonic() - started:.0f} s)")


def ping(socket_file: str, timeout_s: float = 2.0) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_file)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return sock.recv(64).split(b" ")[1:2] == [b"200"]
        except (OSError, IndexError):
            return False


@dataclass
class DockerEngine:
    socket_file: str
    process: subprocess.Popen | None = None  # None: an engine that ran before; it keeps running
    log_file: Path | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a docker or docker-compose command needs to talk to this engine."""
        return {"DOCKER_HOST": f"unix://{self.socket_file}"}

    def log_tail(self, lines: int = 30) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None:
            return
        progress("stopping dockerd")
        stop_process(self.process, signal.SIGTERM, 60)
        for leftover in ("docker.sock", "docker.pid"):
            with contextlib.suppress(FileNotFoundError):
                (RUN_DIR / leftover).unlink()


def start_engine() -> DockerEngine:
    """An engine that answers: the one already running, else a dockerd of our own."""
    for candidate in (os.environ.get("DOCKER_HOST", "").removeprefix("unix://"), "/var/run/docker.sock"):
        if candidate.startswith("/") and ping(candidate):
            progress(f"using the Docker engine already running at {candidate}")
            return DockerEngine(candidate)
    own = RUN_DIR / "docker.sock"
    if ping(str(own)):  # an earlier run's that was killed before its teardown: ours to reuse and stop
        pid = int((RUN_DIR / "docker.pid").read_text())
        progress(f"reusing dockerd {pid} left by an earlier run at {own}")
        engine = DockerEngine(str(own))
        engine.process = _Adopted(pid)
        return engine
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root here (no rootless engine is set up)")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    log_file = RUN_DIR / "dockerd.log"
    command = ["dockerd", "--data-root", str(DATA_ROOT), "--exec-root", str(RUN_DIR / "exec"),
               "--pidfile", str(RUN_DIR / "docker.pid"), "-H", f"unix://{own}"]
    progress(f"starting {' '.join(command)}")
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=open(log_file, "wb"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    engine = DockerEngine(str(own), process, log_file)
    deadline = time.monotonic() + 60
    while not ping(str(own)):
        if process.poll() is not None:
            tail = engine.log_tail()
            reason = next((line for line in reversed(tail.splitlines()) if "level=fatal" in line or "failed" in line),
                          tail.splitlines()[-1] if tail else f"exit code {process.returncode}")
            if any(marker in reason.lower() for marker in CANNOT_RUN):
                pytest.skip(f"dockerd cannot run on this machine: {reason.strip()[:200]}")
            pytest.fail(f"dockerd exited with code {process.returncode}: {reason.strip()}", pytrace=False)
        if time.monotonic() > deadline:
            engine.stop()
            pytest.fail(f"dockerd did not answer on {own} within 60 s:\n{engine.log_tail()}", pytrace=False)
        time.sleep(0.2)
    progress(f"dockerd {process.pid} answers on {own} (data root {DATA_ROOT})")
    return engine


class _Adopted:
    """A dockerd an earlier run started, stopped like a child of ours."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def send_signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 1e9)
        while Path(f"/proc/{self.pid}").exists():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("dockerd", timeout or 0)
            time.sleep(0.2)
        return 0

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    ensure_installed()
    engine = start_engine()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def tandem_images(docker_engine: DockerEngine) -> str:
    """The stand-in base images and ``tandem:latest`` built from compose/Dockerfile as it stands."""
    images = standin_images()
    started = time.monotonic()
    try:
        images.make_standins(env=docker_engine.env)
        images.build_tandem(env=docker_engine.env)
    except images.StandinError as exc:
        pytest.fail(str(exc), pytrace=False)
    if docker_engine.process is not None:  # our own engine's cache: the images a rebuild replaced go
        images.docker("image", "prune", "-f", env=docker_engine.env, capture=True, check=False)
    progress(f"images ready ({time.monotonic() - started:.0f} s)")
    return images.TANDEM_TAG


@dataclass
class Compose:
    """``docker-compose`` on compose/docker-compose.yml (plus ``extra_files``) as project ``project``."""

    engine: DockerEngine
    project: str
    env: dict[str, str] = field(default_factory=dict)
    extra_files: list[Path] = field(default_factory=list)

    def command(self, *args: str) -> list[str]:
        files = [COMPOSE_DIR / "docker-compose.yml", *self.extra_files]
        return ["docker-compose", "-p", self.project, *[a for f in files for a in ("-f", str(f))], *args]

    def run(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        # The project directory is compose/, where the file's relative paths and .env are read.
        result = subprocess.run(self.command(*args), cwd=COMPOSE_DIR, env={**os.environ, **self.engine.env, **self.env},
                                capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise AssertionError(f"`docker-compose {' '.join(args)}` failed (exit {result.returncode}):\n{tail}")
        return result

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cli = standin_images().docker_cli()
        result = subprocess.run([cli, *args], env={**os.environ, **self.engine.env}, capture_output=True, text=True,
                                stdin=subprocess.DEVNULL, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"`docker {' '.join(args)}` failed: {result.stderr.strip()}")
        return result

    def containers(self, service: str) -> list[dict]:
        """``docker inspect`` of the service's containers (one-off ones left out), by container number."""
        ids = self.docker("ps", "-aq", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                          "--filter", f"label=com.docker.compose.service={service}",
                          "--filter", "label=com.docker.compose.oneoff=False").stdout.split()
        if not ids:
            return []
        found = json.loads(self.docker("inspect", *ids).stdout)
        return sorted(found, key=lambda c: int(c["Config"]["Labels"].get("com.docker.compose.container-number", 0)))

    def running(self, service: str) -> list[dict]:
        return [c for c in self.containers(service) if c["State"]["Running"]]

    def logs(self, *services: str, lines: int = 40) -> str:
        return self.run("logs", "--no-color", "--tail", str(lines), *services, check=False).stdout

    def file_from(self, service: str, path: str) -> str:
        return self.run("exec", "-T", service, "cat", path).stdout


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
