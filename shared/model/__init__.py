"""Llama-family models for tandem: config, paged-attention decoder, checkpoint loading, and the
contiguous-cache reference used as the parity oracle.

Public API:
- `ModelConfig` (`.tiny()`, `.from_hf_dict()`, `.to_hf_dict()`), `ModelLoadError`
- `LlamaForCausalLM`: `forward(input_ids, positions, kv_cache, meta) -> hidden [T, H]`,
  `compute_logits(hidden) -> float32 logits`
- `load_model(spec, device, dtype, data_dir) -> LoadedModel(model, tokenizer, config, name)`,
  `load_model_meta(spec, data_dir) -> ModelMeta` (config, tokenizer, name; no weights),
  `save_hf_checkpoint(model, config, path)`, `build_random_model(config, seed)`
- `reference_logits(model, ids)`, `reference_generate(model, prompt_ids, max_new_tokens)`
"""

from tandem.shared.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from tandem.shared.model.llama import LlamaForCausalLM
from tandem.shared.model.loader import (
    LoadedModel,
    ModelMeta,
    build_random_model,
    load_model,
    load_model_meta,
    resolve_dtype,
    save_hf_checkpoint,
)
from tandem.shared.model.reference import reference_generate, reference_logits

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelMeta",
    "ModelConfig",
    "ModelLoadError",
    "build_random_model",
    "load_model",
    "load_model_meta",
    "reference_generate",
    "reference_logits",
    "resolve_dtype",
    "save_hf_checkpoint",
]
