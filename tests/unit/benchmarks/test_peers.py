"""The peer baselines in ``benchmarks/peers/``: transformers ``generate`` runs here on the CPU on a
tiny Llama built in-process; DeepSpeed's ZeRO-3 offload needs deepspeed and a GPU, so here only its
command line and its one-line refusal are checked, also as a row of ``benchmarks/train_offload.py``.

Run: ``python3 -m pytest -q -m "slow or not slow" tests/unit/benchmarks/test_peers.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PEERS = ROOT / "benchmarks" / "peers"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A script of the checkout, against the checkout's package."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # two processes that import transformers and generate on the CPU
def test_hf_generate_decodes_n_new_tokens_greedily_the_same_each_run() -> None:
    args = (str(PEERS / "hf_generate.py"), "--model", "random:llama-test", "--device", "cpu", "--batches", "2",
            "--prompt-len", "16", "--new-tokens", "6", "--warmup", "0", "--repeats", "2")
    runs = []
    for _ in range(2):
        out = run_script(*args)
        assert out.returncode == 0, f"hf_generate.py failed:\n{out.stderr[-2000:]}"
        (row,) = json_lines(out.stdout)
        runs.append(row)
    for row in runs:
        assert (row["peer"], row["model"], row["dtype"], row["batch"]) == ("hf_generate", "random:llama-test",
                                                                           "float32", 2), row
        assert row["new_tokens_generated"] == 6 and row["decode_steps"] == 5, f"6 new tokens, 5 decode steps: {row}"
        assert row["decode_tok_s"] > 0 and row["prefill_ms"] > 0, row
        assert row["same_output_across_repeats"], f"greedy: every timed call gives the same tokens: {row}"
    assert runs[0]["output_sha256"] == runs[1]["output_sha256"], "greedy output differs between two runs"


def test_zero3_offload_help_needs_no_deepspeed() -> None:
    out = run_script(str(PEERS / "zero3_offload.py"), "--help", timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    for option in ("--preset", "--batch", "--seq", "--steps", "--warmup", "--gpu-cap-gib"):
        assert option in out.stdout, f"{option} missing from --help:\n{out.stdout}"


@pytest.mark.skipif(HAS_DEEPSPEED, reason="deepspeed is installed here: the refusal cannot be seen")
def test_zero3_offload_without_deepspeed_exits_with_one_line_naming_it() -> None:
    out = run_script(str(PEERS / "zero3_offload.py"), "--preset", "1b", "--steps", "1", timeout=60)
    assert out.returncode != 0, "a peer that cannot run must not exit 0"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "deepspeed" in lines[0], f"one line naming deepspeed, got:\n{out.stderr[-2000:]}"
    assert not json_lines(out.stdout), out.stdout


@pytest.mark.slow  # a whole trainer benchmark run on the CPU
@pytest.mark.skipif(HAS_DEEPSPEED, reason="deepspeed is installed here: the peer's failure cannot be seen")
def test_train_offload_keeps_its_rows_when_the_peer_cannot_run(tmp_path: Path) -> None:
    kept = tmp_path / "rows.json"
    out = run_script(str(ROOT / "benchmarks" / "train_offload.py"), "--device", "cpu", "--runs", "tiny", "--steps",
                     "1", "--peer", "--json-out", str(kept), timeout=600)
    assert out.returncode == 1, f"a failed peer row fails the run: exit {out.returncode}\n{out.stderr[-2000:]}"
    rows = {row["run"]: row for row in json.loads(kept.read_text())}
    assert rows["tiny:auto"]["tokens_per_s"] > 0, rows["tiny:auto"]
    reason = rows["peer"]["error"]
    assert "deepspeed" in reason and "\n" not in reason, f"the peer row's reason, in one line: {reason!r}"
    assert "peer: DeepSpeed ZeRO-3 offload did not run: " in out.stdout, out.stdout[-2000:]
