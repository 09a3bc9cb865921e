"""``pip install tandem`` alone, the client side, against a running tandem: no torch on the client.

The wheel is built as a release would be (``wheel_support``), installed into a fresh virtual
environment without the system's site-packages, its dependencies from the package index (the
machine's pip configuration and cache: a rerun installs from the cache). In that environment
``import torch`` must fail. A ``tandem up`` started from the development environment serves; from
the client environment, with that up's data dir (so it finds the running tandem and its client key
the way a user's commands do):

* the library: ``tandem.client.connect()`` and a completion, and torch never loaded;
* ``tandem generate --json``;
* ``tandem bench serve`` over NATS and over the HTTP API (``--base-url``), a few requests each;
* ``tandem services``.

Slow (``-m slow``; .ci/run runs it): about 100 s on 2 cores with a warm pip cache (the wheel build
and the venv's install about 55 s of it, ``tandem up`` about 20), longer when every wheel has to
come from the index.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_support import running_up, tandem_env
from wheel_support import build_wheel

pytestmark = pytest.mark.slow

CLIENT_SCRIPT = textwrap.dedent('''
    import asyncio, json, sys
    from tandem.client import connect

    async def main():
        async with connect() as client:  # the running `tandem up` of TANDEM_DATA_DIR, with its client key
            result = await client.complete("def add(a, b):", max_tokens=6, temperature=0, ignore_eos=True)
            chunks = [chunk.text async for chunk in client.generate("x = ", max_tokens=3, ignore_eos=True)]
        print(json.dumps({"text": result.text, "tokens": len(result.token_ids), "reason": result.finish_reason,
                          "chunks": len(chunks), "torch_loaded": "torch" in sys.modules}))

    asyncio.run(main())
''')


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh venv holding tandem's wheel and its base dependencies only; its bin/ folder."""
    wheel = build_wheel(tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel"))
    venv = tmp_path_factory.mktemp("client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)  # no system site-packages
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR", "PIP_REQUIRE_VIRTUALENV")}
    install = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", str(wheel)],
                             capture_output=True, text=True, timeout=900, env=env, cwd=venv)
    assert install.returncode == 0, f"pip install {wheel.name} failed:\n{install.stdout[-4000:]}\n{install.stderr}"
    return venv / "bin"


def run_client(venv_bin: Path, args: list[str], data_dir: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """A command of the client venv, run as a user would: its own interpreter, not the repository's
    (no PYTHONPATH, started outside the checkout), pointed at the running tandem by its data dir."""
    env = tandem_env(data_dir)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(args, env=env, cwd=venv_bin.parent, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """``tandem up`` from the development environment (it has the engine); its data dir."""
    with running_up(tmp_path_factory.mktemp("client-only-up"), "--kvstore", "0") as data_dir:
        yield data_dir


def test_the_client_venv_has_no_engine(client_venv, tmp_path):
    for module in ("torch", "numpy", "safetensors", "tokenizers", "fastapi"):
        probe = run_client(client_venv, [str(client_venv / "python"), "-c", f"import {module}"], tmp_path)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, f"{module} is installed in the venv"
    where = run_client(client_venv, [str(client_venv / "python"), "-c", "import tandem; print(tandem.__file__)"],
                       tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(client_venv.parent)), (where.stdout, where.stderr)
    # a command that needs the engine says which extra, in one line
    up = run_client(client_venv, [str(client_venv / "tandem"), "up"], tmp_path)
    assert up.returncode == 2 and "pip install 'tandem[serve]'" in up.stderr, up.stderr


def test_library_generates_against_a_running_tandem(client_venv, up):
    done = run_client(client_venv, [str(client_venv / "python"), "-c", CLIENT_SCRIPT], up)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["tokens"] == 6 and result["reason"] == "length" and result["chunks"] >= 1, result
    assert not result["torch_loaded"]


def test_generate_command(client_venv, up):
    done = run_client(client_venv, [str(client_venv / "tandem"), "generate", "def fib(n):", "--max-tokens", "5",
                                    "--temperature", "0", "--ignore-eos", "--json"], up)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert len(result["token_ids"]) == 5 and result["prompt_token_ids"] == list(b"def fib(n):"), result


@pytest.mark.parametrize("over", ["nats", "http"])
def test_bench_serve(client_venv, up, over, tmp_path):
    out_file = tmp_path / "result.json"
    args = [str(client_venv / "tandem"), "bench", "serve", "--input-len", "16", "--output-len", "4",
            "--num-prompts", "4", "--num-warmups", "1", "--max-concurrency", "2", "--json-out", str(out_file)]
    if over == "http":
        http_url = json.loads((up / "run" / "up.json").read_text())["http_url"]
        assert http_url, "tandem up serves no HTTP API"
        args += ["--base-url", http_url]
    done = run_client(client_venv, args, up, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out_file.read_text())["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0, summary


def test_services_command(client_venv, up):
    done = run_client(client_venv, [str(client_venv / "tandem"), "services", "--json"], up)
    assert done.returncode == 0, done.stderr[-3000:]
    names = {row["service"] for row in json.loads(done.stdout)}
    assert {"tandem-router", "tandem-prefill", "tandem-decode", "tandem-frontend"} <= names, names
