"""Model presets of the trainer and how a job's ``model`` spec becomes a config.

``tiny`` is the built-in byte-level model (:meth:`ModelConfig.tiny`). ``1b``, ``3b`` and ``7b`` are
Llama-shaped models with a 32000-entry vocabulary (the shapes of ``../shared/anchors``); ``13b``,
``34b`` and ``70b`` have Llama 2 13B's, Code Llama 34B's and Llama 2 70B's shapes (grouped KV heads
on the last two), for measuring what fits (a LoRA run keeps only the frozen base in host RAM, at 2
bytes a parameter). They use the byte tokenizer's ids (a byte corpus trains them, and a saved
checkpoint serves with the byte tokenizer). Any other spec is a Hugging Face checkpoint directory
to start from.

    config, init_from, name = resolve_model("3b")
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem.shared.model.config import ModelConfig, ModelLoadError
from tandem.shared.model.meta import read_hf_config
from tandem.shared.text.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID

_SHAPES = {
    "1b": dict(hidden_size=2048, num_layers=16, intermediate_size=8192, num_heads=32, num_kv_heads=8),
    "3b": dict(hidden_size=3072, num_layers=28, intermediate_size=8192, num_heads=24, num_kv_heads=8),
    "7b": dict(hidden_size=4096, num_layers=32, intermediate_size=11008, num_heads=32, num_kv_heads=32),
    "13b": dict(hidden_size=5120, num_layers=40, intermediate_size=13824, num_heads=40, num_kv_heads=40),
    "34b": dict(hidden_size=8192, num_layers=48, intermediate_size=22016, num_heads=64, num_kv_heads=8),
    "70b": dict(hidden_size=8192, num_layers=80, intermediate_size=28672, num_heads=64, num_kv_heads=8),
}
PRESETS = ("tiny", *_SHAPES)


def preset_config(name: str, max_position_embeddings: int = 131072) -> ModelConfig:
    """The config of a preset (see the module docstring); raises ModelLoadError for unknown names."""
    if name == "tiny":
        return ModelConfig.tiny()
    if name not in _SHAPES:
        raise ModelLoadError(f"unknown preset {name!r}; presets: {PRESETS}")
    shape = _SHAPES[name]
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32000, head_dim=shape["hidden_size"] // shape["num_heads"],
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=BYTE_BOS_ID, eos_token_ids=[BYTE_EOS_ID],
        pad_token_id=BYTE_PAD_ID, byte_tokenizer=True, **shape,
    )


def resolve_model(spec: str | os.PathLike) -> tuple[ModelConfig, Path | None, str]:
    """``(config, checkpoint to start from or None, served model name)`` for a job's model spec."""
    if str(spec) in PRESETS:
        return preset_config(str(spec)), None, str(spec)
    path = Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"model {str(spec)!r} is neither a preset {PRESETS} nor a checkpoint directory")
    config = read_hf_config(path)
    return config, path, path.resolve().name
