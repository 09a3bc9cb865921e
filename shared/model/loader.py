"""Loading models for serving: the built-in tiny model or a Hugging Face checkpoint directory.

`load_model("random:<preset>")` builds a random model of a real shape (see presets.py).
`load_model("tiny")` gives deterministic random weights (same in every process, since they are
drawn on CPU from one seeded generator in parameter order), unless the trainer has saved a tiny
checkpoint under `<data_dir>/models/tiny/`. Any other spec is a Hugging Face directory holding
config.json, model.safetensors (or model.safetensors.index.json + shards) and tokenizer.json.
Large models are built on the meta device and take their tensors straight from safetensors, so
no float32 copy of the whole model is ever made.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.shared.model.config import ModelConfig, ModelLoadError, normalize_token_ids
from tandem.shared.model.llama import LlamaForCausalLM
from tandem.shared.model.presets import SyntheticTokenizer, build_preset_model, is_random_spec, preset_config
from tandem.shared.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TINY_SEED = 1234
INIT_STD = 0.02
_IGNORED_CHECKPOINT_KEYS = ("rotary_emb.inv_freq",)  # stale buffers some old checkpoints carry


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    name: str  # stable model name for APIs and logs: "tiny" or the checkpoint directory's name


@dataclass
class ModelMeta:
    """What a model is without its weights: enough for a router to tokenize and validate."""

    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    checkpoint: Path | None  # None: the built-in tiny model's seeded random weights


def load_model_meta(spec: str | os.PathLike, data_dir: str | os.PathLike | None = None) -> ModelMeta:
    """Config, tokenizer and name of "tiny" or a Hugging Face directory, reading no weights."""
    if is_random_spec(spec):
        config = preset_config(str(spec))
        return ModelMeta(config, SyntheticTokenizer(config), str(spec), None)
    if str(spec) == "tiny":
        saved = Path(data_dir) / "models" / "tiny" if data_dir is not None else None
        if saved is not None and (saved / "config.json").is_file() and _has_weights(saved):
            return ModelMeta(read_hf_config(saved), ByteTokenizer(), "tiny", saved)
        return ModelMeta(ModelConfig.tiny(), ByteTokenizer(), "tiny", None)
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"model spec {str(spec)!r} is neither 'tiny' nor an existing directory")
    config = read_hf_config(path)
    return ModelMeta(config, _checkpoint_tokenizer(path, config), path.resolve().name, path)


def load_model(
    spec: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    data_dir: str | os.PathLike | None = None,
) -> LoadedModel:
    """Load "tiny" or a Hugging Face directory, ready for serving (eval mode, no grads)."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    meta = load_model_meta(spec, data_dir)
    if is_random_spec(spec):
        model = build_preset_model(meta.config, device, dtype)
    elif meta.checkpoint is None:
        model = build_random_model(meta.config).to(device=device, dtype=dtype)
    else:
        model = _load_checkpoint(meta.checkpoint, meta.config, device, dtype)
    loaded = LoadedModel(model, meta.tokenizer, meta.config, meta.name)
    loaded.model.eval()
    loaded.model.requires_grad_(False)
    return loaded


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None/"auto" -> float32 on CPU, bfloat16 on CUDA; strings like "bfloat16" -> torch dtypes."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'float16'")
    return resolved


def read_hf_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig, adding EOS ids from generation_config.json when present."""
    config_dict = _read_json(path / "config.json")
    config = ModelConfig.from_hf_dict(config_dict)
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        generation = _read_json(generation_file)
        extra = [i for i in normalize_token_ids(generation.get("eos_token_id")) if i not in config.eos_token_ids]
        bos = config.bos_token_id if config.bos_token_id is not None else generation.get("bos_token_id")
        config = config.replace(eos_token_ids=config.eos_token_ids + extra, bos_token_id=bos)
    return config


def build_random_model(config: ModelConfig, seed: int = TINY_SEED, std: float = INIT_STD) -> LlamaForCausalLM:
    """A float32 CPU model with reproducible weights: N(0, std) matrices, unit norms, zero biases."""
    model = LlamaForCausalLM(config)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # fixed registration order; tied weights once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)
    return model


def save_hf_checkpoint(model: LlamaForCausalLM, config: ModelConfig, path: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors loadable by load_model and by transformers.

    The weights go first and config.json last, each through a rename, so a reader that sees
    config.json always sees complete weights.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliases
    weights_tmp = path / "model.safetensors.tmp"
    save_file(state, str(weights_tmp), metadata={"format": "pt"})
    os.replace(weights_tmp, path / "model.safetensors")
    config_tmp = path / "config.json.tmp"
    config_tmp.write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    os.replace(config_tmp, path / "config.json")
    return path


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ModelLoadError(f"missing {file.name} in {file.parent}")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{file} is not valid JSON: {error}") from None


def _has_weights(path: Path) -> bool:
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _weight_files(path: Path) -> list[Path]:
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        raise ModelLoadError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_file} has no weight_map")
    shards = sorted(set(weight_map.values()))
    absent = [shard for shard in shards if not (path / shard).is_file()]
    if absent:
        raise ModelLoadError(f"{index_file.name} names shards missing from {path}: {absent}")
    return [path / shard for shard in shards]


def _load_checkpoint(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)  # no memory; RoPE tables are built on CPU regardless
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if not name.endswith(_IGNORED_CHECKPOINT_KEYS):
                    state[name] = shard.get_tensor(name).to(device=device, dtype=dtype)
    expected = set(model.state_dict().keys())
    missing = expected - state.keys()
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    unexpected = state.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint {path} does not match {config.architecture}: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as error:  # shape mismatches between config.json and the tensors
        raise ModelLoadError(f"checkpoint {path} does not fit its config.json: {error}") from None
    model.tie_weights()
    return model.to(device=device, dtype=dtype)


def _checkpoint_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    if config.byte_tokenizer:
        return ByteTokenizer()
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"missing tokenizer.json in {path}")
    return HFTokenizer(tokenizer_file, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
