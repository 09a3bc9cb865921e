"""The tiny model ships trained: the package's checkpoint is found, loads and writes Python-shaped
text; a checkpoint the user trained into the data dir wins over it; ``tiny-random`` (and a package
without the checkpoint) gives the seeded random weights."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from tandem.shared.model import meta as model_meta
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.loader import build_random_model, load_model, save_hf_checkpoint
from tandem.shared.model.meta import load_model_meta
from tandem.shared.model.reference import reference_generate, reference_logits

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PROMPTS = ("def fibonacci(n):", "class Foo:\n    def __init__(self", "for i in range(")
PYTHON_TOKENS = ("self", "):", "return", "assert", "import", "def ", " in ", "None", " = ")
SNIPPET = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self):
        self.value += 1
        return self.value
'''


def shipped_dir() -> Path:
    return Path(str(resources.files("tandem.shared.model").joinpath("weights", "tiny")))


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def python_shape_failures(model: torch.nn.Module) -> list[str]:
    """Why greedy continuations of PROMPTS do not read as Python-shaped ASCII (empty: they do)."""
    failures, texts = [], []
    for prompt in PROMPTS:
        tokens, _ = reference_generate(model, list(prompt.encode()), 48)
        text = bytes(t for t in tokens if t < 256).decode("utf-8", "replace")
        texts.append(text)
        printable = sum(t < 128 and (chr(t).isprintable() or chr(t) in "\n\t") for t in tokens) / len(tokens)
        if printable < 0.95:
            failures.append(f"{prompt!r} -> {text!r}: only {printable:.0%} printable ASCII")
    body = texts[0]
    if not (body.startswith("\n") and body[1:5] == "    "):
        failures.append(f"{PROMPTS[0]!r} -> {body!r}: no indented body after the colon")
    seen = [t for t in PYTHON_TOKENS if any(t in text for text in texts)]
    if len(seen) < 2:
        failures.append(f"Python tokens seen: {seen} in {texts!r}")
    logits = reference_logits(model, list(SNIPPET.encode()))
    nll = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(list(SNIPPET.encode())[1:])))
    if nll > 3.5:  # uniform over 259 ids: ln 259 = 5.56 nats per byte
        failures.append(f"{nll:.2f} nats per byte on a Python snippet")
    return failures


@pytest.fixture(scope="module")
def shipped():
    return load_model("tiny")


def test_the_package_ships_a_small_float16_checkpoint_found_through_importlib_resources(tmp_path):
    root = resources.files("tandem.shared.model").joinpath("weights", "tiny")
    for name in ("config.json", "model.safetensors", "PROVENANCE.md"):
        assert root.joinpath(name).is_file(), f"{name} missing from the package's weights/tiny"
    meta = load_model_meta("tiny", data_dir=tmp_path)  # an empty data dir
    assert meta.source == "shipped" and meta.checkpoint == shipped_dir() == model_meta.shipped_checkpoint("tiny")
    assert meta.config == ModelConfig.tiny() and meta.name == "tiny"
    weights = shipped_dir() / "model.safetensors"
    assert weights.stat().st_size < 8 * 2**20
    with safe_open(str(weights), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    assert json.loads((shipped_dir() / "config.json").read_text())["torch_dtype"] == "float16"


def test_shipped_weights_write_python_shaped_text(shipped):
    assert shipped.model.model.embed_tokens.weight.dtype == torch.float32  # cast back for CPU serving
    assert python_shape_failures(shipped.model) == []


def test_the_python_check_rejects_random_weights():
    random = load_model("tiny-random")
    assert random.name == "tiny-random" and load_model_meta("tiny-random").source == "random"
    assert len(python_shape_failures(random.model)) >= 3


def test_tiny_random_is_the_seeded_random_model(shipped):
    random = state_of(load_model("tiny-random").model)
    expected = state_of(build_random_model(ModelConfig.tiny()))
    assert random.keys() == expected.keys() and all(torch.equal(random[k], expected[k]) for k in random)
    assert not torch.equal(random["model.embed_tokens.weight"], shipped.model.state_dict()["model.embed_tokens.weight"])


def test_a_checkpoint_in_the_data_dir_overrides_the_shipped_one(tmp_path, shipped):
    config = ModelConfig.tiny()
    mine = build_random_model(config, seed=7)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")  # no weights: not a checkpoint yet
    assert load_model_meta("tiny", data_dir=tmp_path).source == "shipped"
    save_hf_checkpoint(mine, config, tmp_path / "models" / "tiny")
    meta = load_model_meta("tiny", data_dir=tmp_path)
    assert meta.source == "data-dir" and meta.checkpoint == tmp_path / "models" / "tiny"
    loaded = state_of(load_model("tiny", data_dir=tmp_path).model)
    for name, tensor in state_of(mine).items():
        assert torch.equal(tensor, loaded[name]), f"{name} not taken from the data dir's checkpoint"


def test_random_weights_only_when_no_checkpoint_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(model_meta, "_WEIGHTS", "no-such-weights")
    meta = load_model_meta("tiny", data_dir=tmp_path)
    assert meta.source == "random" and meta.checkpoint is None and meta.name == "tiny"
    fallback = state_of(load_model("tiny", data_dir=tmp_path).model)
    expected = state_of(build_random_model(ModelConfig.tiny()))
    assert all(torch.equal(fallback[k], expected[k]) for k in expected)


def test_tandem_up_says_which_weights_it_serves(tmp_path, capsys, monkeypatch):
    from tandem.cli.up import weights_note

    weights_note(SimpleNamespace(model="tiny", data_dir=tmp_path))
    assert "shipped with tandem" in capsys.readouterr().out
    save_hf_checkpoint(build_random_model(ModelConfig.tiny(), seed=7), ModelConfig.tiny(), tmp_path / "models" / "tiny")
    weights_note(SimpleNamespace(model="tiny", data_dir=tmp_path))
    assert str(tmp_path / "models" / "tiny") in capsys.readouterr().out
    monkeypatch.setattr(model_meta, "_WEIGHTS", "no-such-weights")
    weights_note(SimpleNamespace(model="tiny", data_dir=tmp_path / "empty"))
    out = capsys.readouterr().out
    assert "random weights" in out and "tandem train --default" in out


def test_weights_id_names_the_weights_not_the_folder(tmp_path):
    """The KV namespace carries it: other weights under the same name must never share KV."""
    shipped = load_model_meta("tiny")
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in shipped_dir().iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert load_model_meta(copy).weights_id() == shipped.weights_id(), "the same files elsewhere"
    save_hf_checkpoint(build_random_model(ModelConfig.tiny()), ModelConfig.tiny(),
                       tmp_path / "data" / "models" / "tiny")
    retrained = load_model_meta("tiny", data_dir=tmp_path / "data")
    assert retrained.name == shipped.name and retrained.weights_id() != shipped.weights_id()
    assert load_model_meta("tiny-random").weights_id() == "seeded"
    assert load_model("tiny").weights_id == shipped.weights_id()
