"""``tandem train`` as a user runs it, and the benchmark's CPU mode.

Ctrl-C (SIGINT) or SIGTERM in the middle of a run: a checkpoint of the last whole step, one line
saying where and how to continue, exit 130 or 143; the command it names continues from that step.

Run: ``python -m pytest -q tests/e2e/test_train_cli.py``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_support import ctrl_c_reaches_it

from tandem.shared.model.loader import load_model
from tandem.shared.model.meta import load_model_meta

ROOT = Path(__file__).resolve().parents[2]
TANDEM = [sys.executable, "-m", "tandem"]


def train_env(data_dir: Path) -> dict[str, str]:
    env = dict(os.environ, TANDEM_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", TANDEM_LOG_LEVEL="WARNING")
    env.pop("TANDEM_NATS_URL", None)
    return env


def run(args: list[str], data_dir: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=train_env(data_dir), capture_output=True, text=True, timeout=timeout)


class Training:
    """A ``tandem train`` in the background, its standard output read line by line as it comes."""

    def __init__(self, args: list[str], data_dir: Path) -> None:
        self.proc = subprocess.Popen(args, env=train_env(data_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, preexec_fn=ctrl_c_reaches_it)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for_line(self, pattern: str, timeout_s: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.stdout.append(line)
            found = re.search(pattern, line)
            if found:
                return found
        self.proc.kill()
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s; stdout:\n" + "\n".join(self.stdout)
                             + f"\nstderr:\n{self.proc.stderr.read()[-3000:]}")

    def finish(self, timeout_s: float = 60) -> tuple[int, list[str], str]:
        """(exit status, every stdout line, stderr) once it exits."""
        code = self.proc.wait(timeout_s)
        while (line := self.lines.get(timeout=10)) is not None:
            self.stdout.append(line)
        return code, self.stdout, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def trainings():
    """Start :class:`Training`s; any still running after the test is killed."""
    started: list[Training] = []

    def start(args: list[str], data_dir: Path) -> Training:
        started.append(Training(args, data_dir))
        return started[-1]

    yield start
    for training in started:
        training.kill()


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

    from tandem.cli.train import add_train_parser, build_job

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(), lambda p: None)
    job = build_job(parser.parse_args(["train", *flags]), tmp_path)
    assert {k: getattr(job, k) for k in expected} == expected


# slow: a run stopped by the signal, then the run that continues it, stopped again (9 s on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_the_printed_command_continues(tmp_path, trainings, signum: signal.Signals):
    out = tmp_path / "out"
    command = [*TANDEM, "train", "--model", "tiny", "--dataset", "random", "--steps", "5000", "--batch-size", "2",
               "--seq-len", "32", "--log-every", "1", "--output-dir", str(out), "--device", "cpu", "--threads", "1"]
    first = trainings(command, tmp_path)
    first.wait_for_line(r"step 3/5000 ")
    first.proc.send_signal(signum)
    code, stdout, stderr = first.finish()
    assert code == 128 + signum, f"exit status {code}, not {128 + signum}: {stderr[-2000:]}"
    last = stdout[-1]
    stopped = re.fullmatch(rf"tandem train: stopped by {signum.name} after step (\d+) of 5000; checkpoint saved in "
                           rf"{re.escape(str(out))}; to continue, run the same command again with --resume", last)
    assert stopped, f"the last line does not say where it saved and how to continue: {last!r}"
    step = int(stopped[1])
    assert step >= 3 and f"step {step}/5000 " in "\n".join(stdout), "the checkpoint is not of the last step shown"
    assert json.loads((out / "trainer_state.json").read_text())["step"] == step
    assert "Traceback" not in stderr, stderr

    resumed = trainings([*command, "--resume"], tmp_path)
    found = resumed.wait_for_line(r"step (\d+)/5000 ")
    assert int(found[1]) == step + 1, f"the resumed run went on at step {found[1]}, not {step + 1}"
    resumed.proc.send_signal(signal.SIGINT)
    code, stdout, stderr = resumed.finish()
    assert code == 130 and re.search(r"stopped by SIGINT after step \d+ of 5000", stdout[-1]), stdout[-3:] + [stderr]
    assert json.loads((out / "trainer_state.json").read_text())["step"] > step
