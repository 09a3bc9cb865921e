"""The running ``tandem up``'s claim on its data dir and its state file: how every other command on
this machine finds it.

``tandem up`` first takes ``<data-dir>/run/up.lock`` with an exclusive ``flock`` (:func:`claim`) and
holds it while it runs: the kernel gives the lock to one process only, so two ``up`` started at the
same moment cannot both win, and releases it when the holder dies however it dies, so a lock
never outlives its process (no stale pid to guess about). Whoever holds it may remove what a killed
``up`` left: its state file, its nats-server folder ``<data-dir>/run/nats`` (config, log, JetStream
store), and the server itself should it still run there (it gets SIGTERM when its ``up`` dies, and
may still be stopping, or writing to its store, when the next ``up`` starts).

Once its services are ready it writes ``<data-dir>/run/up.json`` (its pid and every URL it serves,
rewritten when a restarted child's URL changes) and removes it when it stops. :func:`find_running`
reads it back, and only while that pid is alive, so a file left by a killed ``up`` is never taken
for a running one. No torch: the client library imports this.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tandem.shared.auth.keyring import write_private
from tandem.shared.infra.config import from_env


def data_dir_in_use() -> Path:
    """The settings' ``data_dir`` as the environment gives it (``TANDEM_DATA_DIR``, else the
    default): the data dir a command given none uses."""
    return from_env("data_dir")


@dataclass
class RunState:
    pid: int
    nats_url: str
    http_url: str = ""  # the frontend's OpenAI-compatible API ("" when none runs)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # instance id -> its /metrics page
    nats_monitor_url: str = ""  # the embedded nats-server's monitoring port ("": off, the default, or --nats-url)
    data_dir: str = ""
    # role -> its role key (RoleKey.to_text's fields), for the commands that connect to this up
    # (tandem.client.access); empty with --insecure. Why the file is written 0600.
    keys: dict[str, dict[str, str]] = field(default_factory=dict)


def run_dir(data_dir: Path | str) -> Path:
    return Path(data_dir) / "run"


def state_file(data_dir: Path | str) -> Path:
    return run_dir(data_dir) / "up.json"


def lock_file(data_dir: Path | str) -> Path:
    return run_dir(data_dir) / "up.lock"


def nats_dir(data_dir: Path | str) -> Path:
    """The embedded nats-server's folder (config, log, JetStream store) of the ``up`` on ``data_dir``."""
    return run_dir(data_dir) / "nats"


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    try:  # a zombie answers signal 0 too: dead for every purpose here
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_state(data_dir: Path | str) -> RunState | None:
    """The state file as written, alive or not (None: absent or unreadable)."""
    try:
        raw = json.loads(state_file(data_dir).read_text())
        known = {f.name for f in fields(RunState)}
        state = RunState(**{k: v for k, v in raw.items() if k in known})
        state.pid, state.nats_url, state.http_url = int(state.pid), str(state.nats_url), str(state.http_url)
        state.metrics_urls = {str(k): str(v) for k, v in dict(state.metrics_urls).items()}
        state.keys = {str(role): {str(k): str(v) for k, v in dict(key).items()}
                      for role, key in dict(state.keys).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return state


def find_running(data_dir: Path | str | None = None) -> RunState | None:
    """The state of the ``tandem up`` running on ``data_dir`` (default: :func:`data_dir_in_use`), if any."""
    state = read_state(data_dir_in_use() if data_dir is None else data_dir)
    return state if state is not None and pid_alive(state.pid) else None


def find_running_url(data_dir: Path | str | None = None) -> str | None:
    """The NATS URL of the ``tandem up`` running on ``data_dir``, if any."""
    state = find_running(data_dir)
    return state.nats_url if state else None


def write_state(data_dir: Path | str, state: RunState) -> None:
    path = state_file(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"up.{os.getpid()}.tmp")
    write_private(tmp, json.dumps(asdict(state)))  # it holds role keys: readable by this user only
    tmp.replace(path)  # readers never see half a file


def remove_state(data_dir: Path | str, pid: int) -> None:
    """Remove the state file if it is ``pid``'s (never another ``up``'s)."""
    path = state_file(data_dir)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


class AlreadyRunning(RuntimeError):
    """Another ``tandem up`` holds the data dir; the message says which and what to do."""

    def __init__(self, data_dir: Path, pid: int | None, state: RunState | None) -> None:
        self.data_dir, self.pid, self.state = data_dir, pid, state
        where = [f"pid {pid}" if pid else "pid unknown"]
        if state is not None:
            where.append(f"NATS at {state.nats_url}")
            if state.http_url:
                where.append(f"HTTP at {state.http_url}")
        else:
            where.append("still starting")
        super().__init__(f"already running ({', '.join(where)}) on data dir {data_dir}; stop it first or use "
                         "--data-dir")


@dataclass
class Claim:
    """This process's hold on a data dir: the open, locked ``up.lock``; :meth:`release` lets go."""

    data_dir: Path
    fd: int
    removed: list[str] = field(default_factory=list)  # what a dead predecessor had left, now removed

    def release(self) -> None:
        """Remove this process's state file, then unlock. The lock file stays: removing it would let
        a newcomer lock a fresh file while a third process still waits on the old one. Safe twice."""
        if self.fd < 0:
            return
        remove_state(self.data_dir, os.getpid())
        os.close(self.fd)  # closing the only descriptor drops the flock
        self.fd = -1


def claim(data_dir: Path | str) -> Claim:
    """Take ``data_dir`` for this process, or raise :class:`AlreadyRunning`. Once taken, whatever a
    killed ``up`` left there (state file, nats-server folder) is removed: the lock proves its owner gone."""
    import fcntl  # here: this module is imported by the client library, fcntl is Unix-only

    data_dir = Path(data_dir)
    path = lock_file(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(data_dir, _holder_pid(path), find_running(data_dir)) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    held = Claim(data_dir, fd)
    old = read_state(data_dir)
    if state_file(data_dir).exists():
        state_file(data_dir).unlink(missing_ok=True)
        held.removed.append(f"removed the state file of pid {old.pid if old else '?'}")
    if nats_dir(data_dir).exists():
        for pid in stop_leftover_servers(nats_dir(data_dir)):
            held.removed.append(f"stopped its nats-server (pid {pid})")
        shutil.rmtree(nats_dir(data_dir), ignore_errors=True)
        held.removed.append(f"removed the nats-server folder {nats_dir(data_dir)} (config, log, JetStream store)")
    return held


def stop_leftover_servers(folder: Path, wait_s: float = 5.0) -> list[int]:
    """Stop any nats-server still running on ``folder``: its ports file names its pid, and the pid
    counts only while its command line names the folder's config (a reused pid is left alone).
    SIGTERM, then SIGKILL after ``wait_s``; returns the pids stopped."""
    stopped = []
    for ports in folder.glob("*.ports"):
        pid_text = ports.stem.rsplit("_", 1)[-1]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone (or no /proc to tell by)
            continue
        if str(folder / "nats.conf").encode() not in argv or not pid_alive(pid):
            continue
        for signum, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, wait_s)):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not pid_alive(pid):
                break
        stopped.append(pid)
    return stopped


def _holder_pid(path: Path, wait_s: float = 1.0) -> int | None:
    """The pid the lock's holder wrote; it writes just after locking, so wait a moment for it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit() and pid_alive(int(text)):  # (a dead pid: the previous holder's, not yet overwritten)
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)

