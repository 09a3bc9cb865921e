"""``tandem up`` stops by draining, keeps its nats-server up, and leaves nothing a later ``up`` trips over.

Measured before: SIGTERM of ``up`` with 16 streams in flight completed none (every client got a raw
``ConnectionReconnectingError``), a killed nats-server stayed dead, and a killed ``up``'s state file
and nats folder were in the next one's way. Every test here boots a real ``tandem up`` (the tiny
model, no KV-store) and talks to it with ``tandem.client``.

Run: ``python3 -m pytest -q -m slow tests/e2e/test_up_shutdown.py``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_support import TANDEM, tandem_env, wait_for
from support import prompt_of

from tandem.client import TandemError, connect
from tandem.client.runstate import find_running, pid_alive, read_state

pytestmark = pytest.mark.slow  # each boots its own up (and most stop it): 20-60 s apiece on 2 cores

LONG = 1900  # tokens: a stream this long is mid-way for many seconds on the tiny model


class Up:
    """One background ``tandem up`` on its own data dir, its output in a file."""

    def __init__(self, data_dir: Path, *flags: str) -> None:
        self.data_dir = data_dir
        self.log_path = data_dir / f"up-{time.monotonic_ns()}.log"
        env = {**tandem_env(data_dir), "TANDEM_LOG_LEVEL": "INFO"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*TANDEM, "up", "--kvstore", "0", *flags], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        state = wait_for(lambda: find_running(data_dir) or self.proc.poll() is not None, 180, "tandem up ready")
        assert self.proc.poll() is None, self.log()[-3000:]
        self.url = state.nats_url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)  # a second one: at once
            self.proc.wait(60)


async def stream(client, max_tokens: int, started: asyncio.Event, salt: int) -> tuple:
    """("done", tokens, finish_reason), ("typed", error class, message) or ("raw", error class, message)."""
    tokens = 0
    finish = None
    try:
        async for chunk in client.generate(prompt_of(24, salt), max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True):
            tokens += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
            if tokens >= 4:
                started.set()
    except TandemError as exc:
        return "typed", type(exc).__name__, str(exc)
    except Exception as exc:  # what must not happen: a connection error reaching the caller
        return "raw", type(exc).__name__, str(exc)
    return "done", tokens, finish


async def sigterm_mid_stream(up: Up, lengths: list[int]) -> tuple[list[tuple], float, int]:
    """Start a stream per entry of ``lengths``, SIGTERM ``up`` once every one has tokens, and return
    each stream's outcome, the seconds from SIGTERM to ``up``'s exit, and its exit code."""
    async with connect(up.url, request_timeout_s=120, data_dir=str(up.data_dir)) as client:
        started = [asyncio.Event() for _ in lengths]
        tasks = [asyncio.ensure_future(stream(client, n, e, i)) for i, (n, e) in enumerate(zip(lengths, started))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        assert not any(t.done() for t in tasks), "a stream ended before the SIGTERM: make them longer"
        sent = time.monotonic()
        up.proc.send_signal(signal.SIGTERM)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        code = await asyncio.get_running_loop().run_in_executor(None, up.proc.wait, 120)
        return outcomes, time.monotonic() - sent, code


async def test_sigterm_of_up_lets_every_stream_in_flight_finish(tmp_path):
    up = Up(tmp_path, "--shutdown-timeout", "60")
    try:
        lengths = [400, 500, 600, 700]
        outcomes, took, code = await sigterm_mid_stream(up, lengths)
    finally:
        up.stop()
    log = up.log()
    assert [o[0] for o in outcomes] == ["done"] * len(lengths), (outcomes, log[-3000:])
    assert [(o[1], o[2]) for o in outcomes] == [(n, "length") for n in lengths], outcomes
    assert code == 0 and took < 60, (code, took, log[-3000:])
    assert f"tandem up: draining: {len(lengths)} requests in flight" in log, log[-3000:]
    assert "every worker drained" in log, log[-3000:]
    assert not (tmp_path / "run" / "up.json").exists() and not (tmp_path / "run" / "nats").exists()
    print(f"SIGTERM to exit with {len(lengths)} streams in flight: {took:.1f}s")


async def test_a_stream_past_the_shutdown_timeout_ends_with_a_typed_error(tmp_path):
    up = Up(tmp_path, "--shutdown-timeout", "2")
    try:
        outcomes, took, code = await sigterm_mid_stream(up, [LONG, LONG])
    finally:
        up.stop()
    log = up.log()
    assert [o[0] for o in outcomes] == ["typed", "typed"], (outcomes, log[-3000:])
    # Under the client's reconnect_s (10 s): a stream told shutting_down must not wait for a bus
    # that the stopping up will not bring back (3.5 s measured alone on 2 cores).
    assert code == 0 and took < 2 + 8, (code, took, log[-3000:])
    assert "still busy after 2s" in log, log[-3000:]
    print(f"SIGTERM to exit past a 2 s shutdown timeout: {took:.1f}s; the streams got {outcomes}")


def nats_server_pid(data_dir: Path) -> int:
    """The pid of the nats-server the up on ``data_dir`` runs (its ports file is named after it)."""
    (ports,) = (data_dir / "run" / "nats").glob("*.ports")
    return int(ports.stem.rsplit("_", 1)[1])


def serves(url: str, data_dir: Path) -> bool:
    async def one() -> int:
        async with connect(url, request_timeout_s=10, data_dir=str(data_dir)) as client:
            return len((await client.complete(prompt_of(20), max_tokens=4, temperature=0.0,
                                              ignore_eos=True)).token_ids)

    try:
        return asyncio.run(one()) == 4
    except Exception:
        return False


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


async def sigterm_worker_mid_stream(up: Up, pid: int, lengths: list[int]) -> list[tuple]:
    async with connect(up.url, request_timeout_s=120, data_dir=str(up.data_dir)) as client:
        started = [asyncio.Event() for _ in lengths]
        tasks = [asyncio.ensure_future(stream(client, n, e, i)) for i, (n, e) in enumerate(zip(lengths, started))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        os.kill(pid, signal.SIGTERM)  # as compose or Kubernetes stop one container
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def test_a_worker_sigtermed_alone_drains_then_a_killed_nats_server_comes_back_then_a_killed_up_leaves_nothing(
        tmp_path):
    up = Up(tmp_path)
    try:
        (decode,) = re.findall(r"started decode (\S+) \(pid (\d+)\)", up.log())
        outcomes = asyncio.run(sigterm_worker_mid_stream(up, int(decode[1]), [300, 400]))
        assert outcomes == [("done", 300, "length"), ("done", 400, "length")], (outcomes, up.log()[-3000:])
        # Seen draining in a heartbeat (then replaced at once), or only leaving with code 0: no crash either way.
        said = (f"{decode[0]} is draining, not asked by tandem up", f"{decode[0]} left on its own (exit code 0")
        wait_for(lambda: any(s in up.log() for s in said), 30, "up seeing a drain")
        wait_for(lambda: re.search(rf"{decode[0]} left.*\(exit code 0", up.log()), 30, "the drained worker's exit")
        assert not re.search(rf"{decode[0]} \(pid \d+\) exited with code", up.log()), "a drained exit is no crash"
        wait_for(lambda: serves(up.url, tmp_path), 90, "the replacement decode worker serving")

        old_server = nats_server_pid(tmp_path)
        assert serves(up.url, tmp_path)
        store = tmp_path / "run" / "nats" / "jetstream"
        assert store.is_dir()
        os.kill(old_server, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: f"nats-server (pid {old_server}) exited" in up.log(), 10, "up noticing the dead server")
        new_server = nats_server_pid(tmp_path)
        assert new_server != old_server and store.is_dir(), "restarted in place, with its JetStream store"
        assert f"restarted on {up.url}" in up.log(), up.log()[-3000:]
        wait_for(lambda: serves(up.url, tmp_path), 60, "a request served after the server's restart")
        print(f"kill -9 of the nats-server to a request served again: {time.monotonic() - killed:.1f}s")
        assert read_state(tmp_path).nats_url == up.url

        old_children = children_of(up.proc.pid)
        up.proc.kill()  # SIGKILL: nothing of up runs to clean up
        up.proc.wait()
        assert (tmp_path / "run" / "up.json").exists() and (tmp_path / "run" / "nats").exists()
        up = Up(tmp_path)  # at once: the killed one's server may still be on its way out
        assert "cleaned up after a tandem up that was killed: removed the state file of pid" in up.log(), \
            up.log()[-3000:]
        assert serves(up.url, tmp_path)
        wait_for(lambda: not any(pid_alive(p) for p in old_children), 30, "the killed up's children to be gone")
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        assert not (tmp_path / "run" / "up.json").exists() and not (tmp_path / "run" / "nats").exists()
    finally:
        up.stop()
