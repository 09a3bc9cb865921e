"""README's Quick start, run as it stands there: the curl line, the openai snippet and the client
library snippet, against a real ``tandem up`` (its HTTP API on a free port, put in place of README's
8000; the client snippet finds the system by itself, through the state file in the data dir)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import TANDEM, tandem_env, wait_for

from tandem.client.runstate import find_running

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"


def quick_start_blocks() -> dict[str, list[str]]:
    """The fenced code blocks of README's Quick start section, by language."""
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    section = section[:section.index("\n## ", 3)]
    blocks: dict[str, list[str]] = {}
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        blocks.setdefault(language, []).append(body)
    return blocks


def snippet(language: str, marker: str) -> str:
    """The one Quick start block of ``language`` that holds ``marker``."""
    found = [body for body in quick_start_blocks().get(language, []) if marker in body]
    assert len(found) == 1, f"README's Quick start has {len(found)} {language} blocks holding {marker!r}, not one"
    return found[0]


SNIPPETS = {"curl": ("sh", "curl "), "openai-client": ("python", "from openai import"),
            "tandem-client": ("python", "from tandem.client import")}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("readme")
    proc = subprocess.Popen([*TANDEM, "up"], env=tandem_env(data_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    state = wait_for(lambda: find_running(data_dir) or proc.poll() is not None, 180, "tandem up to be ready")
    assert proc.poll() is None, f"tandem up exited early:\n{proc.stdout.read()}"
    assert state.http_url, "tandem up's state file has no HTTP URL"
    yield state, data_dir
    proc.send_signal(signal.SIGINT)
    proc.wait(60)


@pytest.mark.parametrize("name", SNIPPETS)
def test_quick_start_has_the_snippet(name):
    assert snippet(*SNIPPETS[name]).strip()


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_the_curl_line(up):
    state, data_dir = up
    command = snippet(*SNIPPETS["curl"]).replace(README_URL, state.http_url)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["object"] == "text_completion" and reply["choices"][0]["finish_reason"] in ("length", "stop"), reply
    assert 0 < reply["usage"]["completion_tokens"] <= 32 and reply["usage"]["prompt_tokens"] == len("def fibonacci(n):")


@pytest.mark.parametrize("name", ["openai-client", "tandem-client"])
def test_the_python_snippets(up, name):
    state, data_dir = up
    source = snippet(*SNIPPETS[name]).replace(README_URL, state.http_url)
    done = subprocess.run([sys.executable, "-c", source], env=tandem_env(data_dir), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"the README snippet failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), "the snippet printed nothing"
    if name == "tandem-client":
        last = done.stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"(length|stop): \d+ tokens, first after \d+ ms", last), last
