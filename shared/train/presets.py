"""Model presets of the trainer and how a job's ``model`` spec becomes a config.

``tiny`` is the built-in byte-level model (:meth:`ModelConfig.tiny`). ``1b``, ``3b`` and ``7b`` are
Llama-shaped models with a 32000-entry vocabulary (the shapes of ``../shared/anchors``); ``13b``,
``34b`` and ``70b`` have Llama 2 13B's, Code Llama 34B's and Llama 2 70B's shapes (grouped KV heads
on the last two), for measuring what fits (a LoRA run keeps only the frozen base in host RAM, at 2
bytes a parameter). They use the byte tokenizer's ids (a byte corpus trains them, and a saved
checkpoint serves with the byte tokenizer). ``coder-s``, ``coder-m`` and ``coder-deep`` are the
small code models the default served model ``coder`` is to be chosen from by measurement
(scripts/train_default_model.py): trained from scratch with a byte-level BPE of :data:`CODER_VOCAB` entries that the job
trains on its own dataset first (shared/text/bpe_trainer.py), tied embeddings, ChatML special
tokens. Any other spec is a Hugging Face checkpoint directory to start from.

    config, init_from, name = resolve_model("3b")
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem.shared.model.config import ModelConfig, ModelLoadError
from tandem.shared.model.meta import read_hf_config
from tandem.shared.text.bpe_trainer import END_OF_TEXT as BPE_END_OF_TEXT
from tandem.shared.text.bpe_trainer import PAD, SPECIAL_TOKENS, TURN_END
from tandem.shared.text.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID

_SHAPES = {
    "1b": dict(hidden_size=2048, num_layers=16, intermediate_size=8192, num_heads=32, num_kv_heads=8),
    "3b": dict(hidden_size=3072, num_layers=28, intermediate_size=8192, num_heads=24, num_kv_heads=8),
    "7b": dict(hidden_size=4096, num_layers=32, intermediate_size=11008, num_heads=32, num_kv_heads=32),
    "13b": dict(hidden_size=5120, num_layers=40, intermediate_size=13824, num_heads=40, num_kv_heads=40),
    "34b": dict(hidden_size=8192, num_layers=48, intermediate_size=22016, num_heads=64, num_kv_heads=8),
    "70b": dict(hidden_size=8192, num_layers=80, intermediate_size=28672, num_heads=64, num_kv_heads=8),
}
# Candidates of one size class (fp16 weights of at most ~25 MB), head_dim 64, one or two KV heads.
_CODER_SHAPES = {
    "coder-s": dict(hidden_size=256, num_layers=8, intermediate_size=704, num_heads=4, num_kv_heads=2),
    "coder-m": dict(hidden_size=384, num_layers=6, intermediate_size=960, num_heads=6, num_kv_heads=2),
    "coder-deep": dict(hidden_size=320, num_layers=9, intermediate_size=864, num_heads=5, num_kv_heads=1),
}
CODER_VOCAB = 8192
CODER_CONTEXT = 2048
PRESETS = ("tiny", *_SHAPES, *_CODER_SHAPES)


def trained_tokenizer_vocab(spec: str | os.PathLike) -> int | None:
    """The vocabulary of the BPE a preset trains on its job's data before the model (None: the
    preset uses the byte tokenizer, or ``spec`` is a directory with its own tokenizer)."""
    return CODER_VOCAB if str(spec) in _CODER_SHAPES else None


def preset_config(name: str, max_position_embeddings: int = 131072) -> ModelConfig:
    """The config of a preset (see the module docstring); raises ModelLoadError for unknown names."""
    if name == "tiny":
        return ModelConfig.tiny()
    if name in _CODER_SHAPES:
        return ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=CODER_VOCAB, head_dim=64, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=CODER_CONTEXT, tie_word_embeddings=True,
            bos_token_id=None, eos_token_ids=[SPECIAL_TOKENS.index(BPE_END_OF_TEXT), SPECIAL_TOKENS.index(TURN_END)],
            pad_token_id=SPECIAL_TOKENS.index(PAD), **_CODER_SHAPES[name],
        )
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
