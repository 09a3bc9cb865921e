"""Random-weight models of real shapes, for speed work without downloading checkpoints.

``load_model("random:llama3-8b")`` builds a Llama-3-8B-shaped decoder (hidden 4096, 32 layers,
intermediate 14336, 32 heads, 8 KV heads, vocab 128256) directly on the target device in the target
dtype, with weights drawn from one seeded generator of that device in parameter order. Every process
on the same kind of device therefore holds the same weights, so a prefill worker and a decode worker
can hand KV to each other, with no 16 GB checkpoint written or read. The text side is a
:class:`SyntheticTokenizer`: benchmarks send token ids, and ids decode to short words.

    python -c "from tandem.shared.model import load_model; print(load_model('random:llama-test').config)"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.shared.model.config import ModelConfig, ModelLoadError
from tandem.shared.model.llama import LlamaForCausalLM

RANDOM_PREFIX = "random:"
PRESET_SEED = 4321
PRESET_STD = 0.02

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


def is_random_spec(spec: object) -> bool:
    return str(spec).startswith(RANDOM_PREFIX)


def preset_config(spec: str) -> ModelConfig:
    name = str(spec).removeprefix(RANDOM_PREFIX)
    if name not in PRESETS:
        raise ModelLoadError(f"unknown random model {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def build_preset_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """N(0, std) matrices, unit norms, drawn on ``device`` in ``dtype`` (no float32 CPU copy)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(PRESET_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, PRESET_STD, generator=generator)
        rotary = model.model.rotary_emb  # buffers are not parameters: rebuild them for real
        cos, sin = rotary.build_tables(config)
        rotary.cos_cached, rotary.sin_cached = cos.to(device), sin.to(device)
    model.tie_weights()
    return model


class SyntheticTokenizer:
    """Ids 0..255 are UTF-8 bytes (so any text encodes); every other id decodes to `` t<id>``."""

    def __init__(self, config: ModelConfig) -> None:
        self.vocab_size = config.vocab_size
        self.bos_token_id = config.bos_token_id
        self.eos_token_ids = list(config.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i != self.bos_token_id and i not in self.eos_token_ids:
                out.append(f" t{i}")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)
