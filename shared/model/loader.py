"""Loading a model's weights for serving; :mod:`tandem.shared.model.meta` says what a spec names.

`load_model("random:<preset>")` builds a random model of a real shape (see presets.py). The tiny
model's random weights (``tiny-random``, or ``tiny`` with no checkpoint) are the same in every
process, since they are drawn on CPU from one seeded generator in parameter order. Checkpoints are
built on the meta device and take their tensors straight from safetensors, so no float32 copy of the
whole model is ever made.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.shared.model.config import ModelConfig, ModelLoadError
from tandem.shared.model.fp8 import check_quantization, quantize_model
from tandem.shared.model.llama import LlamaForCausalLM
from tandem.shared.model.meta import is_random_spec, load_model_meta, weight_files
from tandem.shared.model.presets import build_preset_model
from tandem.shared.text.tokenizer import Tokenizer

TINY_SEED = 1234
INIT_STD = 0.02
_IGNORED_CHECKPOINT_KEYS = ("rotary_emb.inv_freq",)  # stale buffers some old checkpoints carry


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    name: str  # stable model name for APIs and logs: "tiny" or the checkpoint directory's name
    # Which weights: ModelMeta.weights_id, "+fp8" when quantized (part of the KV namespace: KV that
    # fp8 weights computed is not the float model's).
    weights_id: str = "seeded"
    quantization: str = "none"  # "none" or "fp8" (see fp8.py)


def load_model(
    spec: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    data_dir: str | os.PathLike | None = None,
    quantization: str = "none",
    shard: Callable[[LlamaForCausalLM], object] | None = None,
) -> LoadedModel:
    """Load "tiny", "tiny-random" or a Hugging Face directory, ready for serving (eval mode, no grads).

    ``quantization="fp8"`` stores the decoder layers' linears as fp8 (``fp8.quantize_model``: fused
    first, the float copies freed), so a worker sizes its KV pool with the smaller weights.
    ``shard`` cuts the model to one tensor-parallel rank's share in place, before quantizing
    (``parallel.sharding.sharder`` makes it); ``LoadedModel.config`` stays the whole model's."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    check_quantization(quantization, dtype)  # before the weights are read: a refusal costs nothing
    meta = load_model_meta(spec, data_dir)
    if is_random_spec(spec):
        model = build_preset_model(meta.config, device, dtype)
    elif meta.checkpoint is None:
        model = build_random_model(meta.config).to(device=device, dtype=dtype)
    else:
        model = _load_checkpoint(meta.checkpoint, meta.config, device, dtype)
    loaded = LoadedModel(model, meta.tokenizer, meta.config, meta.name, meta.weights_id())
    loaded.model.eval()
    loaded.model.requires_grad_(False)
    if shard is not None:
        shard(loaded.model)
    if quantization != "none":
        quantize_model(loaded.model, quantization)
        loaded.weights_id = f"{loaded.weights_id}+{quantization}"
        loaded.quantization = quantization
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


def _load_checkpoint(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)  # no memory; RoPE tables are built on CPU regardless
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
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


