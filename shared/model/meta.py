"""What a model spec names, read without loading weights or torch: config, tokenizer, name and
where its weights are.

Specs: ``tiny`` (the built-in byte-level model: a checkpoint the user trained into
``<data_dir>/models/tiny/``, else the one shipped in ``weights/tiny/`` beside this file, else seeded
random weights), ``tiny-random`` (always those random weights), ``coder`` (the small code model with
its own BPE tokenizer and chat template that ``tandem train``'s coder presets make: a checkpoint in
``<data_dir>/models/coder/``, else one shipped in ``weights/coder/``; none is shipped until its GPU
run, and then it refuses in one line), ``random:<preset>`` (a real model's
shape with random weights, see :data:`PRESETS`) and a Hugging Face directory (config.json,
tokenizer.json, safetensors). The router and ``tandem up`` need only this; serving workers load the
weights through :mod:`tandem.shared.model.loader`.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tandem.shared.model.config import ModelConfig, ModelLoadError, normalize_token_ids
from tandem.shared.text.tokenizer import ByteTokenizer, HFTokenizer, SyntheticTokenizer, Tokenizer

TINY = "tiny"
CODER = "coder"
TINY_RANDOM = "tiny-random"  # the tiny model's seeded random weights, whatever checkpoints exist
RANDOM_PREFIX = "random:"
_WEIGHTS = "weights"  # package data of tandem.shared.model: one folder per shipped model
_FINGERPRINT_SAMPLE = 1 << 16  # bytes read at the start, middle and end of each weight file

log = logging.getLogger(__name__)

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=[128001],
    ),
    # The same structure at a size CPU tests run in a second (GQA 4:1, head_dim 64, a vocabulary > 256).
    "llama-test": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_layers=2, num_heads=4, num_kv_heads=1, head_dim=64, rope_theta=500000.0,
        max_position_embeddings=4096, bos_token_id=1000, eos_token_ids=[1001],
    ),
}


@dataclass
class ModelMeta:
    """What a model is without its weights: enough for a router to tokenize and validate."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    checkpoint: Path | None  # None: seeded random weights (tiny-random, random:<preset>, or no tiny checkpoint)
    source: str = "directory"  # tiny: "data-dir", "shipped" or "random"; "random" for random:<preset>
    # How an embedding request that names none is pooled: "last" (a decoder's usual choice), or
    # what a sentence-transformers pooling config beside the checkpoint says.
    default_pooling: str = "last"

    def weights_id(self) -> str:
        """A short name for these weights, equal in every process that loads the same files: KV made
        by other weights under the same model name (a retrained tiny model, a KV-store's disk tier from
        an older run) must not be taken for this model's. Reads a few samples of each weight file,
        not the whole file."""
        if self.checkpoint is None:
            return "seeded"
        digest = hashlib.blake2b(digest_size=6)
        for file in weight_files(self.checkpoint):
            size = file.stat().st_size
            digest.update(f"{file.name}:{size}".encode())
            with file.open("rb") as weights:
                for offset in (0, size // 2, max(0, size - _FINGERPRINT_SAMPLE)):
                    weights.seek(offset)
                    digest.update(weights.read(_FINGERPRINT_SAMPLE))
        return digest.hexdigest()


def trained_tiny_dir(data_dir: str | os.PathLike) -> Path:
    """Where ``tandem train --default`` saves the tiny model and where ``tiny`` looks first."""
    return trained_model_dir(data_dir, TINY)


def trained_model_dir(data_dir: str | os.PathLike, name: str) -> Path:
    """Where the built-in model ``name`` looks first: the user's own checkpoint of it."""
    return Path(data_dir) / "models" / name


def load_model_meta(spec: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> ModelMeta:
    """Config, tokenizer and name of "tiny", "tiny-random" or a Hugging Face directory, reading no weights."""
    if is_random_spec(spec):
        config = preset_config(str(spec))
        tokenizer = SyntheticTokenizer(config.vocab_size, config.bos_token_id, config.eos_token_ids)
        return ModelMeta(config, tokenizer, str(spec), None, "random")
    if str(spec) == TINY:
        saved = trained_tiny_dir(data_dir) if data_dir is not None else None
        if saved is not None and _is_checkpoint(saved):
            return ModelMeta(read_hf_config(saved), ByteTokenizer(), TINY, saved, "data-dir")
        shipped = shipped_checkpoint(TINY)
        if shipped is not None:
            return ModelMeta(read_hf_config(shipped), ByteTokenizer(), TINY, shipped, "shipped")
        log.warning("no tiny checkpoint in %s nor in the package; serving random weights", saved or "a data dir")
        return ModelMeta(ModelConfig.tiny(), ByteTokenizer(), TINY, None, "random")
    if str(spec) == CODER:
        saved = trained_model_dir(data_dir, CODER) if data_dir is not None else None
        path = saved if saved is not None and _is_checkpoint(saved) else shipped_checkpoint(CODER)
        if path is None:
            raise ModelLoadError(f"the {CODER!r} model's weights are missing from this install "
                                 f"({_WEIGHTS}/{CODER}/ in tandem's package); reinstall tandem or serve --model tiny")
        config = read_hf_config(path)
        return ModelMeta(config, _checkpoint_tokenizer(path, config), CODER, path,
                         "data-dir" if path == saved else "shipped")
    if str(spec) == TINY_RANDOM:
        return ModelMeta(ModelConfig.tiny(), ByteTokenizer(), TINY_RANDOM, None, "random")
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"model spec {str(spec)!r} is neither 'coder', 'tiny' nor an existing directory")
    config = read_hf_config(path)
    return ModelMeta(config, _checkpoint_tokenizer(path, config), path.resolve().name, path,
                     default_pooling=sentence_transformers_pooling(path) or "last")


def sentence_transformers_pooling(path: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares (``modules.json`` naming a Pooling
    module whose ``config.json`` says ``pooling_mode_lasttoken`` or ``pooling_mode_mean_tokens``),
    or None: none declared, or one tandem does not pool by (CLS, max)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        folder = next(m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = read_json(path / folder / "config.json")
    except (StopIteration, ValueError, AttributeError, TypeError, ModelLoadError):
        return None
    if config.get("pooling_mode_lasttoken"):
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    return None


def is_random_spec(spec: object) -> bool:
    return str(spec).startswith(RANDOM_PREFIX)


def preset_config(spec: str) -> ModelConfig:
    name = str(spec).removeprefix(RANDOM_PREFIX)
    if name not in PRESETS:
        raise ModelLoadError(f"unknown random model {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def shipped_checkpoint(name: str) -> Path | None:
    """The checkpoint of model ``name`` shipped as package data (``weights/<name>/``), or None where it is absent."""
    try:
        root = resources.files("tandem.shared.model").joinpath(_WEIGHTS, name)
    except (ModuleNotFoundError, TypeError):
        return None
    if not isinstance(root, Path):  # a zipped install: safe_open wants real files
        root = _extracted(root)
    return root if root is not None and _is_checkpoint(root) else None


@functools.cache
def _extracted(root: resources.abc.Traversable) -> Path | None:
    if not root.is_dir():
        return None
    target = Path(tempfile.mkdtemp(prefix=f"tandem-{root.name}-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    for entry in root.iterdir():
        if entry.is_file():
            (target / entry.name).write_bytes(entry.read_bytes())
    return target


def read_hf_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig, adding EOS ids from generation_config.json when present."""
    config_dict = read_json(path / "config.json")
    config = ModelConfig.from_hf_dict(config_dict)
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        generation = read_json(generation_file)
        extra = [i for i in normalize_token_ids(generation.get("eos_token_id")) if i not in config.eos_token_ids]
        bos = config.bos_token_id if config.bos_token_id is not None else generation.get("bos_token_id")
        config = config.replace(eos_token_ids=config.eos_token_ids + extra, bos_token_id=bos)
    return config


def read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ModelLoadError(f"missing {file.name} in {file.parent}")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{file} is not valid JSON: {error}") from None


def _has_weights(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and _has_weights(path)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights (one, or the shards its index names)."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        raise ModelLoadError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_file} has no weight_map")
    shards = sorted(set(weight_map.values()))
    absent = [shard for shard in shards if not (path / shard).is_file()]
    if absent:
        raise ModelLoadError(f"{index_file.name} names shards missing from {path}: {absent}")
    return [path / shard for shard in shards]


def _checkpoint_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    if config.byte_tokenizer:
        return ByteTokenizer()
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"missing tokenizer.json in {path}")
    return HFTokenizer(tokenizer_file, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
