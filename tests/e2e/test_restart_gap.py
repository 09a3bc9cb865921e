"""A request waits out its only decode worker's restart instead of failing: ``benchmarks/restart_gap.py``
runs a real ``tandem up`` with one decode worker, kills it with SIGKILL while requests keep coming,
and every request completes token-exact, those sent in the gap after waiting in the router's queue.
On the landed code before this, about half of them failed at once with ``NoWorkersError``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "restart_gap.py"


@pytest.mark.slow  # a whole tandem up, its decode worker killed and restarted (about 30 s on 2 cores)
def test_no_request_fails_while_the_only_decode_worker_restarts(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "40", "--rate", "6", "--kill-after-s", "1",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "restart-gap-up.log").read_text()[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["failed"] == 0, f"{figures['failed']} requests failed in the restart gap: {figures}"
    assert figures["token_exact"] == "40/40", figures
    assert figures["waited_for_restart"] > 0 and figures["sent_after_kill"] > 0, \
        f"no request met the restart, so the test shows nothing: {figures}"
