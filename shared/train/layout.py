"""Flat, layer-contiguous parameter layouts for the streaming trainer.

A *unit* is what moves between host and GPU in one copy: one decoder layer, or the "extras"
(token embedding, final norm and, when untied, the LM head). Its parameters live back to back in
one flat 1-D tensor; a :class:`UnitLayout` says where each parameter (by its Hugging Face name)
starts, and :meth:`UnitLayout.views` turns any flat buffer of the right size — the fp32 master,
the pinned working copy, a GPU slot, a gradient buffer — into named views without copying.
Matrices come first and vectors (norms, biases) last, so weight decay applies to one prefix range.

    from tandem.shared.train.layout import layer_layout
    views = layer_layout(config).views(flat)   # {"self_attn.q_proj.weight": tensor, ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.shared.model.config import ModelConfig

ALIGN = 64  # elements: every parameter starts 128-byte aligned in bf16, 256 in fp32


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    """Where each parameter of one unit sits in its flat buffer."""

    params: tuple[ParamSpec, ...]
    numel: int
    decay_end: int  # [0, decay_end) holds the matrices (weight-decayed); the rest norms and biases

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of ``flat`` (1-D, ``numel`` long); no copies."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"flat buffer of shape {tuple(flat.shape)} does not hold a unit of {self.numel}")
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params}

    def decay_ranges(self, weight_decay: float) -> list[tuple[int, int, float]]:
        """``(start, end, weight_decay)`` of the matrices, then ``(start, end, 0.0)`` of the rest;
        empty ranges left out."""
        ranges = [(0, self.decay_end, weight_decay), (self.decay_end, self.numel, 0.0)]
        return [r for r in ranges if r[0] < r[1]]

    def names(self) -> list[str]:
        return [p.name for p in self.params]


def _build(entries: list[tuple[str, tuple[int, ...]]]) -> UnitLayout:
    ordered = [e for e in entries if len(e[1]) >= 2] + [e for e in entries if len(e[1]) < 2]
    params, offset, decay_end = [], 0, 0
    for name, shape in ordered:
        params.append(ParamSpec(name, shape, offset))
        offset += -(-math.prod(shape) // ALIGN) * ALIGN
        if len(shape) >= 2:
            decay_end = offset
    return UnitLayout(tuple(params), offset, decay_end)


def layer_layout(cfg: ModelConfig) -> UnitLayout:
    """One decoder layer, parameter names relative to ``model.layers.<i>.``."""
    d, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    entries: list[tuple[str, tuple[int, ...]]] = [
        ("input_layernorm.weight", (d,)),
        ("self_attn.q_proj.weight", (q_out, d)),
        ("self_attn.k_proj.weight", (kv_out, d)),
        ("self_attn.v_proj.weight", (kv_out, d)),
        ("self_attn.o_proj.weight", (d, q_out)),
        ("post_attention_layernorm.weight", (d,)),
        ("mlp.gate_proj.weight", (cfg.intermediate_size, d)),
        ("mlp.up_proj.weight", (cfg.intermediate_size, d)),
        ("mlp.down_proj.weight", (d, cfg.intermediate_size)),
    ]
    if cfg.attention_bias:
        entries += [("self_attn.q_proj.bias", (q_out,)), ("self_attn.k_proj.bias", (kv_out,)),
                    ("self_attn.v_proj.bias", (kv_out,))]
    if cfg.o_proj_bias:
        entries.append(("self_attn.o_proj.bias", (d,)))
    if cfg.qk_norm:
        entries += [("self_attn.q_norm.weight", (cfg.head_dim,)), ("self_attn.k_norm.weight", (cfg.head_dim,))]
    return _build(entries)


def extras_layout(cfg: ModelConfig) -> UnitLayout:
    """Embedding, final norm and (untied) LM head, with their full Hugging Face names."""
    entries: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
        ("model.norm.weight", (cfg.hidden_size,)),
    ]
    if not cfg.tie_word_embeddings:
        entries.append(("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    return _build(entries)


def head_weight_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model (tied weights once), the N of the model-FLOPs formula (loop.flops_per_token)."""
    layer = sum(p.numel for p in layer_layout(cfg).params)
    return cfg.num_layers * layer + sum(p.numel for p in extras_layout(cfg).params)
