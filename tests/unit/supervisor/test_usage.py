"""What ``tandem up`` refuses before it starts anything (``tandem.cli.up.usage_problem``): a model that
cannot load, named with ``--model`` and the reason in one line, and ``--port`` with ``--nats-url``.
The e2e twin (tests/e2e/test_up_surface.py) runs the command; this covers more bad models cheaply.

Run: ``python3 -m pytest -q tests/unit/supervisor/test_usage.py``.
"""

from __future__ import annotations

import os

import pytest

from tandem.cli.up import usage_problem
from tandem.shared.infra.config import ENV_PREFIX, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def model_dir(tmp_path, case: str):
    path = tmp_path / case
    if case == "missing":
        return path
    path.mkdir()
    if case == "config-not-json":
        (path / "config.json").write_text("{not json")
    elif case == "no-tokenizer":
        (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
                                          '"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, '
                                          '"num_hidden_layers": 2, "num_attention_heads": 4}')
    return path


@pytest.mark.parametrize(("case", "reason"), [
    ("missing", "is neither 'tiny' nor an existing directory"),
    ("empty", "missing config.json in"),
    ("config-not-json", "config.json is not valid JSON"),
    ("no-tokenizer", "missing tokenizer.json in"),
])
def test_a_model_that_cannot_load_is_one_line_naming_the_flag(tmp_path, case: str, reason: str):
    model = model_dir(tmp_path, case)
    problem = usage_problem(Settings(model=str(model), data_dir=tmp_path / "data"))
    assert problem.startswith(f"--model {model}: ") and reason in problem, problem
    assert "\n" not in problem, f"one line: {problem!r}"


@pytest.mark.parametrize("model", ["tiny", "tiny-random", "random:llama3-8b"])
def test_the_built_in_models_pass(tmp_path, model: str):
    assert usage_problem(Settings(model=model, data_dir=tmp_path)) == ""


def test_port_and_an_external_server_are_one_or_the_other(tmp_path):
    problem = usage_problem(Settings(nats_url="nats://127.0.0.1:4222", nats_port=4333, data_dir=tmp_path))
    assert problem.startswith("--port 4333 and --nats-url nats://127.0.0.1:4222: "), problem
    assert usage_problem(Settings(nats_url="nats://127.0.0.1:4222", data_dir=tmp_path)) == ""
