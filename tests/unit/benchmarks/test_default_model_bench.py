"""``benchmarks/default_model.py``: what counts as a completed function head, and the script's run on
the tiny model (every figure printed, the held-out files found among tandem's dependencies)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "default_model.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("default_model_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize(("head", "completion", "passes"), [
    ("def f(n):\n", "    return n * 2\n\n\ndef g():\n    pass\n", True),
    ("def f(n):\n", "    if n < 2:\n        return n\n    return f(n - 1) + f(n - 2)\n", True),
    ("def f(n):\n", '    """Twice n."""\n\nclass X:\n', False),  # a docstring is not a body
    ("def f(n):\n", "    pass\n", False),
    ("def f(n):\n", "                                \n", False),  # whitespace: what the old tiny model wrote
    ("def f(n):\n", "    x = [1, 2,\n    return x\n", False),  # does not parse
    # cut off by the token limit: the partial last line is dropped
    ("def f(n):\n", "    total = 0\n    for i in range(n):\n        total += i\n    ret", True),
])
def test_a_head_passes_only_with_a_parsing_body(bench, head, completion, passes):
    text = bench.function_text(head, completion)
    assert bench.has_real_body(text) is passes, f"{text!r} should {'pass' if passes else 'fail'}"


def test_function_ends_at_the_first_line_back_at_the_heads_indentation(bench):
    text = bench.function_text("def f():\n", "    return 1\nprint(f())\n")
    assert text == "def f():\n    return 1"


@pytest.mark.slow  # scores 277 kB of held-out source: 35 s on 2 cores
def test_script_prints_every_figure_for_the_tiny_model(tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(SCRIPT), "tiny", "--max-new-tokens", "8", "--decode-tokens", "16",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "held-out source: 8 files" in proc.stdout and "bits/byte" in proc.stdout and "tok/s" in proc.stdout
    row = json.loads(out.read_text())["models"][0]
    assert row["heads_total"] == 24 and row["size_bytes"] > 0 and row["window"] == 256
    assert 0.5 < row["bits_per_byte"] < 8, row["bits_per_byte"]
    assert row["decode_tokens_per_s"] > 0
