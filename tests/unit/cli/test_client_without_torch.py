"""The client side runs without the engine's packages: ``pip install tandem`` has no torch.

In a fresh interpreter whose ``sys.modules`` holds ``None`` for torch and every other module of the
``serve`` and ``train`` extras (so importing one raises ImportError, as in an install without
them), the client library and the console import, every client command's ``--help`` prints, the
client commands run their whole body against a NATS URL where nothing listens (the lazy imports
included) and fail there with their one line, ``tandem auth init`` makes a keyring, and each command
that needs the engine says in one line which extra to install, exit status 2.
tests/unit/test_dependencies.py checks the same from the source; tests/e2e/test_client_only_install.py
installs the wheel alone in a virtual environment and talks to a running tandem from there.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli.extras import EXTRA_MODULES

REPO = Path(__file__).resolve().parents[3]
# Everything outside the base install that the package imports anywhere (triton comes with CUDA torch).
BLOCKED = sorted({*EXTRA_MODULES["serve"], *EXTRA_MODULES["train"], "triton", "kubernetes"})

PROBE = r'''
import contextlib, io, json, sys
for name in sys.argv[2:]:
    sys.modules[name] = None  # `import torch` now raises ImportError, as where torch is not installed
runs = json.loads(sys.argv[1])
import tandem.client, tandem.console.app  # the library and the console, whole
from tandem.cli.main import main
results = []
for argv in runs:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        code = f"{type(exc).__name__}: {exc}"
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()})
blocked = sorted(n for n in sys.argv[2:] if sys.modules.get(n) is not None)
print(json.dumps({"results": results, "loaded": blocked}))
'''

CLIENT_HELP = [["--help"], ["generate", "--help"], ["services", "--help"], ["ping", "--help"], ["console", "--help"],
               ["bench", "serve", "--help"], ["auth", "--help"], ["auth", "init", "--help"], ["bundle", "--help"],
               # --help of the engine's commands needs no engine either: their flags come from the settings
               ["up", "--help"], ["serve", "decode", "--help"], ["train", "--help"], ["bench", "compare", "--help"]]
ENGINE = {("up",): "serve", ("serve", "router"): "serve", ("serve", "frontend"): "serve",
          ("serve", "trainer"): "train", ("train",): "train", ("bench", "compare"): "serve", ("bench",): "serve"}


def closed_port() -> int:
    """A port where nothing listens (bound and released: free for the moment the probe needs it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("no-torch")
    url = f"nats://127.0.0.1:{closed_port()}"
    unreachable = [["generate", "hello", "--max-tokens", "2", "--nats-url", url],
                   ["services", "--nats-url", url, "--wait", "0.2"],
                   ["ping", "router", "--nats-url", url, "--wait", "0.2"],
                   ["bench", "serve", "--num-prompts", "1", "--nats-url", url]]
    runs = [*CLIENT_HELP, *unreachable, ["auth", "init", str(tmp / "keys")], *[list(argv) for argv in ENGINE]]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "TANDEM_DATA_DIR": str(tmp / "data"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(runs), *BLOCKED], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"the probe failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report = json.loads(done.stdout.splitlines()[-1])
    report["by_argv"] = {tuple(r["argv"]): r for r in report["results"]}
    report["keys"] = tmp / "keys"
    return report


def test_nothing_blocked_was_loaded(probe):
    assert not probe["loaded"], probe["loaded"]


@pytest.mark.parametrize("argv", CLIENT_HELP, ids=" ".join)
def test_help_prints_without_the_engine(probe, argv):
    run = probe["by_argv"][tuple(argv)]
    assert run["code"] == 0 and "usage: tandem" in run["out"], run


@pytest.mark.parametrize("command", ["generate", "services", "ping", "bench"])
def test_client_commands_run_to_the_bus_without_the_engine(probe, command):
    """Their whole body runs (the lazy imports too) and stops where the bus does not answer."""
    run = next(r for r in probe["results"] if r["argv"][0] == command and "--nats-url" in r["argv"])
    assert run["code"] == 1 and "Traceback" not in run["err"], run
    assert "cannot reach NATS" in run["err"].strip().splitlines()[-1], run


def test_auth_init_makes_a_keyring_without_the_engine(probe):
    run = probe["by_argv"][("auth", "init", str(probe["keys"]))]
    assert run["code"] == 0, run
    assert (probe["keys"] / "nats-auth.conf").is_file() and (probe["keys"] / "client.key").is_file()


@pytest.mark.parametrize("argv", list(ENGINE), ids=" ".join)
def test_engine_commands_name_the_extra_to_install(probe, argv):
    run = probe["by_argv"][argv]
    extra = ENGINE[argv]
    lines = run["err"].strip().splitlines()
    assert run["code"] == 2 and len(lines) == 1, run
    assert f"pip install 'tandem[{extra}]'" in lines[0] and "torch" in lines[0], lines


def test_help_imports_no_torch_or_numpy():
    """``python -X importtime -m tandem --help`` lists every module it loads: neither is among them."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tandem", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "tandem.cli.main" in loaded, "importtime printed nothing useful"
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "numpy")]
    assert not heavy, heavy
