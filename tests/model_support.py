"""Small Hugging Face checkpoints for tests: a random ``transformers`` model of a real architecture
(Llama 3, Qwen2, Qwen3) saved as safetensors with a word-level tokenizer.json, so the loader, the
reference forward and whole services can be checked against ``transformers`` on CPU in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
HF_CASES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_theta=10000.0, eos_token_id=[2, 3],
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, eos_token_id=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, eos_token_id=2)),
}


def write_tokenizer_json(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the quick brown fox jumps over a lazy dog".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def make_hf_checkpoint(case: str, directory: Path):
    """Save a tiny random transformers model (with perturbed norms and biases) plus tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra = HF_CASES[case]
    hf_config = getattr(transformers, config_cls)(**SMALL, **extra)
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_cls)(hf_config).float().eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; perturb so parity covers them
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf_model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer_json(directory)
    return hf_model
