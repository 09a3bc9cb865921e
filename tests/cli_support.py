"""Running ``tandem`` as a user does, in child processes: the command, its environment, waiting on it.

``TANDEM``, ``tandem_env``, ``ctrl_c_reaches_it``, ``wait_for`` and ``stop_process`` serve the tests of ``tandem up`` /
``generate`` / ``bench``; ``running_up`` keeps a ``tandem up`` running for a block of them;
``service_env`` and ``launch`` start one ``tandem serve <service>`` (conftest's ``start_system``
uses them, as do tests that start a service of their own); ``run_sync`` runs a coroutine to the end
from sync code or from inside a running loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

TANDEM = [sys.executable, "-m", "tandem"]


def ctrl_c_reaches_it() -> None:
    """``preexec_fn`` of a child that a test interrupts with SIGINT as Ctrl-C would: a shell that
    runs the suite in the background (``./.ci/run &``) hands its children SIGINT ignored, and Python
    then never raises KeyboardInterrupt (``tandem up`` sets its handler itself; a plain command
    keeps what it inherited, as a background command should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tandem_env(data_dir: Path) -> dict[str, str]:
    """The environment of a ``tandem`` command with its own data dir, no NATS URL from outside, and a
    free port for the HTTP API (tests run beside each other and beside whatever holds port 8000)."""
    env = dict(os.environ, TANDEM_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", TANDEM_LOG_LEVEL="WARNING",
               TANDEM_HTTP_PORT="0")
    env.pop("TANDEM_NATS_URL", None)
    return env


def wait_for(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` every 0.2 s until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def stop_process(proc: subprocess.Popen, sig: int, timeout_s: float) -> None:
    """Send ``sig`` and wait up to ``timeout_s`` for ``proc`` to end; kill it if it has not, so a
    failing test leaves nothing running."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_up(data_dir: Path, *args: str) -> Iterator[Path]:
    """``tandem up ARGS`` in its own data dir, from the moment its state file says it serves until
    the block ends (then Ctrl-C, as a user stops it); yields the data dir."""
    proc = subprocess.Popen([*TANDEM, "up", *args], env=tandem_env(data_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (data_dir / "run" / "up.json").exists() or proc.poll() is not None, 120, "tandem up")
        assert proc.poll() is None, f"tandem up exited early:\n{proc.stdout.read()}"
        yield data_dir
    finally:
        stop_process(proc, signal.SIGINT, 60)


def service_env(data_dir: Path) -> dict[str, str]:
    # CPU unless a test passes --device; one thread each, as `tandem up` would share out 2 cores.
    return dict(os.environ, TANDEM_DATA_DIR=str(data_dir), TANDEM_PROBE_INTERVAL_S="0.5",
                TANDEM_HEARTBEAT_INTERVAL_S="0.2", TANDEM_DEVICE="cpu", TANDEM_TORCH_THREADS="1",
                PYTHONUNBUFFERED="1")


def launch(url: str, service: str, instance_id: str, logdir: Path, env: dict[str, str],
           args: list[str]) -> subprocess.Popen:
    """``tandem serve <service>`` against the NATS server at ``url``, logging to ``<logdir>/<instance_id>.log``."""
    cmd = [*TANDEM, "serve", service, "--nats-url", url, "--instance-id", instance_id, *args]
    log = open(logdir / f"{instance_id}.log", "wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def operator_options(url: str, data_dir: Path) -> dict:
    """``nats.connect`` options of an operator of the ``tandem up`` on ``data_dir`` (its state file's key)."""
    from tandem.client.access import bus_options

    return bus_options("operator", "tandem-test", url, data_dir=data_dir)


def run_sync(coro):
    """Run a coroutine to the end on a private loop in another thread: callers may be sync fixtures
    or async tests whose own loop is running."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
