"""The ``tandem`` command as a user runs it: up, generate, clean shutdown, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from cli_support import TANDEM, tandem_env, wait_for


def processes_with_data_dir(data_dir: Path) -> list[int]:
    """PIDs whose environment names ``data_dir``: every child that ``tandem up`` started."""
    marker = f"TANDEM_DATA_DIR={data_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def up(tmp_path):
    """A background ``tandem up`` with its own data dir; stopped (SIGINT) at teardown if still running."""
    proc = subprocess.Popen([*TANDEM, "up"], env=tandem_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    state = tmp_path / "run" / "up.json"
    wait_for(lambda: state.exists() or proc.poll() is not None, 120, "tandem up to write its state file")
    assert proc.poll() is None, f"tandem up exited early:\n{proc.stdout.read()}"
    yield proc, tmp_path
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_generate_json_against_up_then_ctrl_c_leaves_nothing(up):
    proc, data_dir = up
    out = subprocess.run([*TANDEM, "generate", "def add(a, b):", "--max-tokens", "8", "--temperature", "0",
                          "--ignore-eos", "--json"], env=tandem_env(data_dir), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in ("text", "prompt_token_ids", "token_ids", "finish_reason", "ttft_s", "tpot_s"):
        assert key in result, f"--json output lacks {key}: {result}"
    assert result["prompt_token_ids"] == list(b"def add(a, b):")
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
    assert result["ttft_s"] > 0 and result["tpot_s"] > 0

    streamed = subprocess.run([*TANDEM, "generate", "x = ", "--max-tokens", "4", "--seed", "3"],
                              env=tandem_env(data_dir), capture_output=True, text=True, timeout=60)
    assert streamed.returncode == 0, streamed.stderr

    assert len(processes_with_data_dir(data_dir)) >= 4, "expected nats-server, router, prefill and decode"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    stdout = proc.stdout.read()
    assert "tandem up: NATS at nats://127.0.0.1:" in stdout
    wait_for(lambda: not processes_with_data_dir(data_dir), 10, "every child of tandem up to exit")
    assert not (data_dir / "run" / "up.json").exists(), "the state file outlived tandem up"


@pytest.mark.slow  # 12 s: a whole `tandem up` booted to be killed
def test_children_die_with_a_killed_up(up):
    proc, data_dir = up
    children = processes_with_data_dir(data_dir)
    assert children, "tandem up started no children"
    proc.kill()
    proc.wait()
    wait_for(lambda: not processes_with_data_dir(data_dir), 30, "orphaned children to exit after SIGKILL of up")


def test_up_demo_prints_a_generation(tmp_path):
    out = subprocess.run([*TANDEM, "up", "--demo", "print(", "--exit-after-demo"], env=tandem_env(tmp_path),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tandem up: NATS at nats://" in out.stdout
    assert "--- demo: 'print('" in out.stdout and "tandem up: stopped" in out.stdout
    assert not processes_with_data_dir(tmp_path)


def test_generate_without_a_running_system_says_how_to_start_one(tmp_path):
    out = subprocess.run([*TANDEM, "generate", "hi"], env=tandem_env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "tandem up" in out.stderr and "Traceback" not in out.stderr


def test_serve_without_nats_url_is_a_clear_error(tmp_path):
    out = subprocess.run([*TANDEM, "serve", "router"], env=tandem_env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "--nats-url" in out.stderr and "Traceback" not in out.stderr


def test_up_without_nats_binary_is_a_clear_error(tmp_path):
    env = {**tandem_env(tmp_path), "TANDEM_NATS_BINARY": str(tmp_path / "missing")}
    out = subprocess.run([*TANDEM, "up"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "nats-server" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(("flags", "overlap", "passed_on"), [
    ([], None, []),  # None: wherever decode CUDA graphs run
    (["--no-overlap-steps"], False, ["--no-overlap-steps"]),
    (["--overlap-steps", "--enforce-eager"], True, ["--enforce-eager", "--overlap-steps"]),
])
def test_engine_flags_reach_settings_and_workers(flags: list[str], overlap: bool | None, passed_on: list[str]) -> None:
    """Engine flags become settings, and ``up`` hands the ones given to the workers it starts."""
    from tandem.cli.flags import SERVICE_SETTINGS, argv, given, settings_from
    from tandem.cli.main import parser
    from tandem.cli.supervisor import DECIDED_HERE

    args = parser().parse_args(["up", *flags])
    assert settings_from(args).engine.overlap_steps is overlap
    assert argv(given(args), *SERVICE_SETTINGS["decode"], skip=DECIDED_HERE) == passed_on
