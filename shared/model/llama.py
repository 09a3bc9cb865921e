"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3) for serving over a paged KV cache.

Parameter names match Hugging Face exactly so safetensors checkpoints load by name. The forward
takes a flattened variable-length batch (vLLM style): all tokens of all sequences in one [T] row,
with per-token positions; attention goes through `paged_attention`, which writes this step's K/V
into the block cache and attends through each sequence's block table. There are no per-token
Python loops and no host syncs in the forward, so it runs unchanged on CPU and on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.shared.model.config import ModelConfig

if TYPE_CHECKING:
    from tandem.shared.kvcache.attention import AttentionMetadata

# Resolved on first use: the kvcache package is written in parallel and imports torch kernels
# (Triton on CUDA) that the reference path and the loader do not need.
_PAGED_ATTENTION: Callable[..., torch.Tensor] | None = None


def _paged_attention() -> Callable[..., torch.Tensor]:
    global _PAGED_ATTENTION
    if _PAGED_ATTENTION is None:
        from tandem.shared.kvcache.attention import paged_attention

        _PAGED_ATTENTION = paged_attention
    return _PAGED_ATTENTION


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as Hugging Face does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with Llama-3 frequency scaling when configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if not scaling or scaling.get("rope_type") != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim/2], gathered by position each forward.

    The tables are non-persistent buffers (not in checkpoints) built in float32 on CPU; they follow
    the module's device and dtype like Hugging Face's, whose cos/sin are also cast to the activation
    dtype before use.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cos, sin = self.build_tables(config)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    @staticmethod
    def build_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, rope_inv_freq(config))
        return freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cached[positions], self.sin_cached[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by half-split (rotate_half) RoPE; cos/sin are [T, D/2]."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _AdapterProducts:
    """What a projection does with LoRA adapters attached (``LlamaForCausalLM.attach_lora``): adds the
    running batch's low-rank products to its output in place (see shared/lora/slots.py)."""

    lora = None  # the model's AdapterSlots once attached
    layer_idx = 0

    def lora_active(self) -> bool:
        return self.lora is not None and self.lora.batch is not None

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, group: str) -> torch.Tensor:
        if self.lora is not None:
            self.lora.add(out, x, self.layer_idx, group)
        return out


def reduce_across_ranks(module: nn.Module, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's output summed over the tensor-parallel ranks (as is with one rank):
    each rank holds some heads' (or MLP columns') share of the product (see shared/parallel/sharding.py)."""
    group = module.tensor_parallel
    return partial if group is None else group.all_reduce(partial)


class LlamaAttention(_AdapterProducts, nn.Module):
    tensor_parallel = None  # a TensorParallelGroup once sharded: this module holds its heads only

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_out, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def fuse_projections(self) -> None:
        """One [q; k; v] matmul instead of three: the separate weights become views of the fused one,
        so checkpoints still load into them by their Hugging Face names and no memory is doubled."""
        if getattr(self, "qkv_proj", None) is None:  # a second engine on the same model: already done
            self.qkv_proj = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def project_qkv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D] with q/k norm (Qwen3) and RoPE applied."""
        num_tokens = hidden.shape[0]
        sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        if getattr(self, "qkv_proj", None) is not None:
            q, k, v = self.add_lora(self.qkv_proj(hidden), hidden, "qkv").split(sizes, -1)
        elif self.lora_active():
            qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], -1)
            q, k, v = self.add_lora(qkv, hidden, "qkv").split(sizes, -1)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def can_fuse(self) -> bool:
        """The fused CUDA path covers a fused qkv projection without Qwen3's q/k norms."""
        return getattr(self, "qkv_proj", None) is not None and self.q_norm is None

    def forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """CUDA: one projection, one RoPE + cache-write kernel, attention over the cache, o_proj."""
        from tandem.shared.kvcache.attention import triton_attend
        from tandem.shared.model.triton_ops import rope_and_cache

        qkv = self.add_lora(self.qkv_proj(hidden), hidden, "qkv")
        q = rope_and_cache(qkv, positions, rotary.cos_cached, rotary.sin_cached,
                           self.num_heads, self.num_kv_heads, kv_cache, self.layer_idx, meta.slot_mapping)
        out = triton_attend(q, kv_cache, self.layer_idx, meta, self.scaling)
        return self.output(out.view(hidden.shape[0], self.num_heads * self.head_dim))

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """o_proj over the heads' outputs ``[T, Hq*D]`` (with its adapter products), summed over ranks."""
        return reduce_across_ranks(self, self.add_lora(self.o_proj(attended), attended, "o"))

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(hidden, cos, sin)
        out = _paged_attention()(q, k, v, kv_cache, self.layer_idx, meta, self.scaling)
        return self.output(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(_AdapterProducts, nn.Module):
    tensor_parallel = None  # a TensorParallelGroup once sharded: this module holds some columns only

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def fuse_projections(self) -> None:
        """One [gate; up] matmul instead of two (weights become views, as in the attention)."""
        if getattr(self, "gate_up_proj", None) is None:
            self.gate_up_proj = _fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "gate_up_proj", None) is not None:
            gate, up = self.add_lora(self.gate_up_proj(x), x, "gate_up").chunk(2, dim=-1)
        elif self.lora_active():
            gate, up = self.add_lora(torch.cat([self.gate_proj(x), self.up_proj(x)], -1), x, "gate_up").chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: the fused gate/up projection and one SiLU-and-multiply kernel."""
        from tandem.shared.model.triton_ops import silu_and_mul

        return self.down(silu_and_mul(self.add_lora(self.gate_up_proj(x), x, "gate_up")))

    def down(self, activated: torch.Tensor) -> torch.Tensor:
        return reduce_across_ranks(self, self.add_lora(self.down_proj(activated), activated, "down"))


def _fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """A Linear whose output rows are the given Linears' rows end to end; each given Linear's weight
    (and bias) is rebound to a view of the fused tensor, so loading into it fills the fused one."""
    weights = [lin.weight for lin in linears]
    fused = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=linears[0].bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused.weight[start : start + rows], requires_grad=False)
        if fused.bias is not None:
            lin.bias = nn.Parameter(fused.bias[start : start + rows], requires_grad=False)
        start += rows
    return fused


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Causal LM over a flattened varlen batch; serves LlamaForCausalLM, Qwen2 and Qwen3 checkpoints."""

    # How the decoder layers' linears hold their weights: "none" (nn.Linear in the model dtype) or
    # "fp8" (fp8.Fp8Linear, set by fp8.quantize_model; the embeddings and LM head are never quantized).
    quantization: str = "none"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up projections in every layer (serving: fewer, larger matmuls)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def attach_lora(self, slots) -> None:  # noqa: ANN001 - shared.lora.slots.AdapterSlots
        """Add the adapter products of ``slots``' running batch to every projection from now on."""
        for index, layer in enumerate(self.model.layers):
            for module in (layer.self_attn, layer.mlp):
                module.lora, module.layer_idx = slots, index

    def tie_weights(self) -> None:
        """Share lm_head with the input embedding when the config says so (call again after loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids/positions [T] -> final-normed hidden states [T, hidden]."""
        if self._can_fuse(input_ids):
            return self._forward_fused(input_ids, positions, kv_cache, meta)
        cos, sin = self.model.rotary_emb(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def _can_fuse(self, input_ids: torch.Tensor) -> bool:
        from tandem.shared.model.triton_ops import can_fuse

        layers = self.model.layers
        return (can_fuse(input_ids) and getattr(layers[0].mlp, "gate_up_proj", None) is not None
                and all(layer.self_attn.can_fuse() for layer in layers))

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The CUDA forward with fused kernels (see triton_ops): ten launches per layer, the residual
        stream carried beside the normed activations as in vLLM."""
        from tandem.shared.model.triton_ops import add_rms_norm

        x, residual = self.model.embed_tokens(input_ids), None
        rotary = self.model.rotary_emb
        for layer in self.model.layers:
            h, residual = add_rms_norm(x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
            h = layer.self_attn.forward_fused(h, positions, rotary, kv_cache, meta)
            norm = layer.post_attention_layernorm
            h, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
            x = layer.mlp.forward_fused(h)
        out, _ = add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows [N, hidden] (already normed by forward) -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
