"""``benchmarks/service_startup.py`` runs: one client start prints a table row and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "service_startup.py"


def test_client_row(tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--repeat", "1", "--services", "client",
                           "--json-out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["service", "start"], done.stdout
    row = next(line.split() for line in lines if line.startswith("client "))
    assert float(row[1]) > 0 and float(row[4]) > 0  # start-up seconds, VmRSS MiB
    assert row[6] in ("yes", "no")
    result = json.loads(out.read_text())["results"]["client"]
    assert result["runs"] == 1 and result["modules_median"] > 0
