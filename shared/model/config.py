"""Model configuration for the Llama-family decoders tandem serves and trains.

`ModelConfig` is the one description of an architecture that the model, loader, KV cache
sizing and trainer share. It reads Hugging Face `config.json` dictionaries (both the classic
`rope_theta` + `rope_scaling` form and the transformers-5 `rope_parameters` form) and writes
them back, so a checkpoint saved here loads in transformers and vice versa.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tandem.shared.text.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}



class ModelLoadError(ValueError):
    """A model spec, config or checkpoint that tandem cannot load; the message says what is wrong."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False  # Llama/Qwen3 `attention_bias` also puts a bias on o_proj; Qwen2 does not
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    byte_tokenizer: bool = False  # checkpoint uses tandem's ByteTokenizer, not tokenizer.json

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The built-in byte-level model used by tests, demos and the trainer's smoke runs."""
        return cls(
            architecture="LlamaForCausalLM",
            vocab_size=BYTE_VOCAB_SIZE,
            hidden_size=256,
            intermediate_size=704,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=BYTE_BOS_ID,
            eos_token_ids=[BYTE_EOS_ID],
            pad_token_id=BYTE_PAD_ID,
            byte_tokenizer=True,
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary; raises ModelLoadError when unsupported."""
        architectures = d.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r} in config.json; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' is implemented")
        if d.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise ModelLoadError("use_sliding_window=true is not supported")
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            rope_theta, rope_scaling = _parse_rope(d)
            is_qwen2 = architecture == "Qwen2ForCausalLM"
            bias = bool(d.get("attention_bias", False))
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if is_qwen2 else bias,
                o_proj_bias=False if is_qwen2 else bias,
                qk_norm=architecture == "Qwen3ForCausalLM",
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=normalize_token_ids(d.get("eos_token_id")),
                pad_token_id=d.get("pad_token_id"),
                byte_tokenizer=d.get("tandem_tokenizer") == "byte",
            )
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks required key {missing}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-compatible config.json dictionary (classic rope_theta/rope_scaling form)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
        }
        if self.architecture != "Qwen2ForCausalLM":  # Qwen2's q/k/v bias is implied by the architecture
            d["attention_bias"] = self.attention_bias
        if self.byte_tokenizer:
            d["tandem_tokenizer"] = "byte"
        return d

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def normalize_token_ids(value: int | list[int] | None) -> list[int]:
    """HF stores eos_token_id as an int, a list, or null; always hand back a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read theta and scaling from either `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(d.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        needed = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        absent = [k for k in needed if k not in params]
        if absent:
            raise ModelLoadError(f"llama3 rope scaling lacks {absent}")
    return theta, {"rope_type": rope_type, **params}
