"""The claim on a data dir (``tandem.client.runstate.claim``): one process wins however many try at once,
the losers learn who holds it and touch nothing of its, the claim dies with its holder (even by
SIGKILL), and the next claimant removes what a killed ``up`` left (state file, nats-server folder).

The claimants are real processes (``python -c``): an flock is per open file, so only separate
processes show that two cannot both win. Run: ``python3 -m pytest -q tests/unit/supervisor/test_runstate.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.client.runstate import (
    AlreadyRunning,
    RunState,
    claim,
    find_running,
    lock_file,
    nats_dir,
    read_state,
    state_file,
    write_state,
)

# Waits for the go file, claims, says how it went, then holds the claim until killed.
CLAIMANT = """
import os, sys, time
from pathlib import Path
from tandem.client.runstate import AlreadyRunning, claim
data_dir, go = Path(sys.argv[1]), Path(sys.argv[2])
while not go.exists():
    time.sleep(0.001)
try:
    held = claim(data_dir)
except AlreadyRunning as exc:
    print("refused", exc.pid, exc, flush=True)
    sys.exit(0)
print("won", os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def claimants(tmp_path):
    """Start claimant processes on a data dir; every one is killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(data_dir: Path, n: int, go: Path) -> list[subprocess.Popen]:
        new = [subprocess.Popen([sys.executable, "-c", CLAIMANT, str(data_dir), str(go)], stdout=subprocess.PIPE,
                                text=True) for _ in range(n)]
        procs.extend(new)
        return new

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def first_line(proc: subprocess.Popen) -> list[str]:
    return proc.stdout.readline().split()


def test_of_claimants_started_at_once_exactly_one_wins(tmp_path, claimants):
    go = tmp_path / "go"
    procs = claimants(tmp_path / "data", 4, go)
    time.sleep(1.5)  # every one imported and polling for the go file
    go.touch()
    said = [first_line(p) for p in procs]
    winners = [s for s in said if s[:1] == ["won"]]
    assert len(winners) == 1, f"exactly one claim wins: {said}"
    winner_pid = winners[0][1]
    for words in said:
        if words[0] == "refused":
            assert words[1] == winner_pid, f"a refusal names the holder's pid {winner_pid}: {words}"


def test_a_refused_claim_leaves_the_holders_state_alone(tmp_path, claimants):
    data_dir, go = tmp_path / "data", tmp_path / "go"
    go.touch()
    holder, = claimants(data_dir, 1, go)
    assert first_line(holder)[0] == "won"
    write_state(data_dir, RunState(pid=holder.pid, nats_url="nats://127.0.0.1:4999", http_url="http://127.0.0.1:8999"))
    before = state_file(data_dir).read_bytes()
    with pytest.raises(AlreadyRunning) as refused:
        claim(data_dir)
    assert str(refused.value) == (f"already running (pid {holder.pid}, NATS at nats://127.0.0.1:4999, HTTP at "
                                  f"http://127.0.0.1:8999) on data dir {data_dir}; stop it first or use --data-dir")
    assert state_file(data_dir).read_bytes() == before, "the refused claimant changed the holder's state file"
    assert find_running(data_dir).pid == holder.pid


def test_a_holder_still_starting_is_named_without_urls(tmp_path, claimants):
    data_dir, go = tmp_path / "data", tmp_path / "go"
    go.touch()
    holder, = claimants(data_dir, 1, go)
    assert first_line(holder)[0] == "won"
    with pytest.raises(AlreadyRunning, match=rf"^already running \(pid {holder.pid}, still starting\) on data dir"):
        claim(data_dir)


def test_a_killed_holders_leftovers_go_to_the_next_claimant(tmp_path, claimants):
    data_dir, go = tmp_path / "data", tmp_path / "go"
    go.touch()
    holder, = claimants(data_dir, 1, go)
    assert first_line(holder)[0] == "won"
    write_state(data_dir, RunState(pid=holder.pid, nats_url="nats://127.0.0.1:4999"))
    (nats_dir(data_dir) / "jetstream").mkdir(parents=True)
    (nats_dir(data_dir) / "jetstream" / "kv-events.blk").write_bytes(b"x" * 100)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert find_running(data_dir) is None, "a state file of a dead pid is not a running up"
    assert read_state(data_dir).pid == holder.pid, "(the leftover the next claim must remove)"
    held = claim(data_dir)
    try:
        assert not state_file(data_dir).exists(), "the dead holder's state file is still there"
        assert not nats_dir(data_dir).exists(), "the dead holder's nats-server folder is still there"
        assert len(held.removed) == 2 and str(holder.pid) in held.removed[0], held.removed
        assert lock_file(data_dir).read_text().strip() == str(os.getpid())
    finally:
        held.release()


def test_release_removes_only_the_own_state_file_and_the_data_dir_can_be_claimed_again(tmp_path):
    held = claim(tmp_path)
    write_state(tmp_path, RunState(pid=os.getpid(), nats_url="nats://127.0.0.1:4999"))
    held.release()
    held.release()  # twice is harmless
    assert not state_file(tmp_path).exists() and lock_file(tmp_path).exists()
    again = claim(tmp_path)
    try:
        assert again.removed == [], "a clean release leaves nothing to remove"
        other = RunState(pid=os.getpid() + 1, nats_url="nats://127.0.0.1:5000")
        write_state(tmp_path, other)  # not this process's: release must keep it
    finally:
        again.release()
    assert json.loads(state_file(tmp_path).read_text())["pid"] == other.pid
