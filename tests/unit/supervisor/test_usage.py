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
    ("missing", "is neither 'coder', 'tiny' nor an existing directory"),
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


@pytest.fixture
def tiny_adapter(tmp_path):
    """A rank-8 PEFT adapter of the tiny model on q_proj (zeros: only its shapes are checked)."""
    import torch

    from tandem.shared.lora.peft_format import AdapterConfig, LoraWeights, projection_shapes, save_adapter
    from tandem.shared.model.config import ModelConfig

    config = ModelConfig.tiny()
    out_features, in_features = projection_shapes(config)["q_proj"]
    layers = range(config.num_layers)
    weights = LoraWeights(AdapterConfig(8, 16.0, ("q_proj",)),
                          {(i, "q_proj"): torch.zeros(8, in_features) for i in layers},
                          {(i, "q_proj"): torch.zeros(out_features, 8) for i in layers})
    return save_adapter(tmp_path / "adapter", weights)


@pytest.mark.parametrize(("flags", "words"), [
    ({}, ""),
    ({"max_loras": 0}, "add --max-loras 1"),
    ({"max_lora_rank": 4}, "raise --max-lora-rank"),
    ({"path": "missing"}, "does not exist"),
], ids=["served", "no-slots", "rank-over-the-limit", "missing-directory"])
def test_lora_modules_are_checked_before_anything_starts(tmp_path, tiny_adapter, flags: dict, words: str):
    path = tmp_path / "missing" if flags.get("path") else tiny_adapter
    settings = {"max_loras": 2, "max_lora_rank": 16, **{k: v for k, v in flags.items() if k != "path"}}
    problem = usage_problem(Settings(model="tiny", data_dir=tmp_path / "data", lora_modules=f"code={path}",
                                     **settings))
    if not words:
        assert problem == "", problem
        return
    assert words in problem and problem.startswith("--lora-modules") and "\n" not in problem, problem
