"""``tandem train`` as a user runs it, and the benchmark's CPU mode.

Run: ``python -m pytest -q tests/e2e/test_train_cli.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.shared.model.loader import load_model
from tandem.shared.model.meta import load_model_meta

ROOT = Path(__file__).resolve().parents[2]
TANDEM = [sys.executable, "-m", "tandem.cli"]


def run(args: list[str], data_dir: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, TANDEM_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", TANDEM_LOG_LEVEL="WARNING")
    env.pop("TANDEM_NATS_URL", None)
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def test_train_runs_a_job_with_progress_lines(tmp_path):
    out = tmp_path / "out"
    proc = run([*TANDEM, "train", "--model", "tiny", "--dataset", "random", "--steps", "4", "--batch-size", "2",
                "--seq-len", "32", "--log-every", "2", "--output-dir", str(out), "--device", "cpu", "--threads", "1"],
               tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = [line for line in proc.stdout.splitlines() if "step " in line and "tok/s" in line]
    assert [line.split("step ")[1].split()[0] for line in progress] == ["2/4", "4/4"], proc.stdout
    assert "finished at step 4" in proc.stdout
    assert load_model(str(out)).config.num_layers == 4


@pytest.mark.slow  # two CLI runs, 8 s on 2 cores
def test_default_saves_where_tandem_up_finds_the_tiny_model(tmp_path):
    proc = run([*TANDEM, "train", "--default", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                "--device", "cpu", "--threads", "1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stdlib" in proc.stdout and "--- sample" in proc.stdout
    meta = load_model_meta("tiny", data_dir=tmp_path)
    assert meta.checkpoint == tmp_path / "models" / "tiny"


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    proc = run([*TANDEM, "train", "--model", "no-such-model", "--steps", "1"], tmp_path)
    assert proc.returncode == 2 and "no-such-model" in proc.stderr
    proc = run([*TANDEM, "train", "--steps", "0"], tmp_path)
    assert proc.returncode == 2 and "steps" in proc.stderr


def test_fine_tunes_on_a_jsonl_file(tmp_path):
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                                {"role": "assistant", "content": "4"}]}) + "\n"
                       + json.dumps({"prompt": "def add(a, b):", "completion": "\n    return a + b"}) + "\n")
    out = tmp_path / "tuned"
    proc = run([*TANDEM, "train", "--model", "tiny", "--dataset", str(dataset), "--steps", "2", "--batch-size", "2",
                "--seq-len", "64", "--log-every", "1", "--output-dir", str(out), "--device", "cpu", "--threads", "1"],
               tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 examples (1 chat, 1 prompt/completion), packed into" in proc.stdout, proc.stdout
    assert "finished at step 2" in proc.stdout and (out / "chat_template.jinja").is_file()


@pytest.mark.slow  # 7 s on 2 cores
def test_the_users_own_run_reads_their_files_wherever_they_are(tmp_path, monkeypatch):
    """``--trainer-read-dirs`` confines jobs from the bus; ``tandem train`` is the user's own process
    on the user's own files: a dataset and a model outside the data dir (one through a relative path
    and a link, counted from the working directory) train."""
    data_dir, mine = tmp_path / "data", tmp_path / "mine"
    data_dir.mkdir()
    (mine / "texts").mkdir(parents=True)
    (mine / "texts" / "a.py").write_text("def add(a, b):\n    return a + b\n" * 40)
    (mine / "notes").symlink_to(mine / "texts", target_is_directory=True)
    monkeypatch.setenv("TANDEM_TRAINER_READ_DIRS", str(data_dir))  # whatever the service's setting says
    monkeypatch.chdir(mine)

    def train(model: str, out: str) -> subprocess.CompletedProcess:
        return run([*TANDEM, "train", "--model", model, "--dataset", "notes", "--steps", "2", "--batch-size", "2",
                    "--seq-len", "32", "--output-dir", out, "--device", "cpu", "--threads", "1"], data_dir)

    proc = train("tiny", "base")
    assert proc.returncode == 0 and "finished at step 2" in proc.stdout, proc.stdout + proc.stderr
    proc = train(str(mine / "base"), str(mine / "tuned"))
    assert proc.returncode == 0 and "finished at step 2" in proc.stdout, proc.stdout + proc.stderr
    assert load_model(str(mine / "tuned")).config.num_layers == 4


def test_a_bad_jsonl_line_is_refused_in_one_line(tmp_path):
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user"}]}\n')
    proc = run([*TANDEM, "train", "--dataset", str(dataset), "--steps", "1", "--device", "cpu"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "chat.jsonl line 2: has no assistant message" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a whole benchmark script run
def test_benchmark_cpu_mode_prints_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    timeline = tmp_path / "timeline"
    timeline.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_offload.py"), "--device", "cpu",
                           "--runs", "tiny", "--json-out", str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TANDEM_TIMELINE_DIR": str(timeline)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["tokens_per_s"] > 0 and result["hidden_fraction"] is not None and len(result["losses"]) == 3
    assert result["host_pass_in_step_Gparams_per_s"] > 0, "the host optimizer's in-step rate was not measured"
    assert "tok/s" in proc.stdout and "passes inside the step" in proc.stdout, proc.stdout
    (dump,) = timeline.iterdir()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_timeline.py"), str(dump)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    windows = [json.loads(line) for line in proc.stdout.splitlines()[1:]]
    assert len(windows) == 2, f"3 measured steps give 2 windows between them: {proc.stdout}"
    for w in windows:
        assert w["backward_compute_ms"] > 0 and w["next_forward_last_ms"] > w["next_forward_first_ms"] > 0, w
        assert len(w["host_pass_each_ms"]) > 0, f"the host optimizer's passes are missing: {w}"


@pytest.mark.parametrize("flags,expected", [
    ([], dict(compile_layers=None, split_update=None)),
    (["--split-update", "--no-compile-layers"], dict(compile_layers=False, split_update=True)),
    (["--no-split-update", "--compile-layers"], dict(compile_layers=True, split_update=False)),
])
def test_engine_flags_reach_the_job(tmp_path, flags, expected):
    import argparse

    from tandem.train_cli import add_train_parser, build_job

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(), lambda p: None)
    job = build_job(parser.parse_args(["train", *flags]), tmp_path)
    assert {k: getattr(job, k) for k in expected} == expected
