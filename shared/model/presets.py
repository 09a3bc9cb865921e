"""Random-weight models of real shapes, for speed work without downloading checkpoints.

``load_model("random:llama3-8b")`` builds a Llama-3-8B-shaped decoder (hidden 4096, 32 layers,
intermediate 14336, 32 heads, 8 KV heads, vocab 128256) directly on the target device in the target
dtype, with weights drawn from one seeded generator of that device in parameter order. Every process
on the same kind of device therefore holds the same weights, so a prefill worker and a decode worker
can hand KV to each other, with no 16 GB checkpoint written or read. The shapes and the text side
(:class:`~tandem.shared.text.tokenizer.SyntheticTokenizer`) are in :mod:`tandem.shared.model.meta`.

    python -c "from tandem.shared.model.loader import load_model; print(load_model('random:llama-test').config)"
"""

from __future__ import annotations

import torch

from tandem.shared.model.config import ModelConfig
from tandem.shared.model.llama import LlamaForCausalLM

PRESET_SEED = 4321
PRESET_STD = 0.02

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
