"""Megatron-style sharding of a loaded Llama model across a tensor-parallel worker's ranks.

Rank ``r`` of ``k`` keeps query heads ``[r*Hq/k, (r+1)*Hq/k)`` and the KV heads they read (GQA
groups stay whole, so each rank's KV cache holds its own heads only; with fewer KV heads than
ranks, as vLLM does, each KV head is kept by ``k/Hkv`` ranks, one per rank), and MLP columns
``[r*I/k, (r+1)*I/k)``. q/k/v and gate/up are split by output rows (column-parallel: no
communication), o_proj and down_proj by input columns (row-parallel): their outputs are partial
sums, added over the ranks by one all-reduce after the attention and one after the MLP
(``llama.reduce_across_ranks``). The embedding and the norms are whole on every rank; the LM head
is needed on rank 0 only, where sampling happens, and is dropped elsewhere.

Called on a model still in its float weights and before the runner fuses projections or
quantizes them: both then work on the shards as on a whole model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tandem.shared.model.config import ModelConfig
from tandem.shared.model.llama import LlamaForCausalLM
from tandem.shared.parallel.group import TensorParallelError, TensorParallelGroup


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raise :class:`TensorParallelError` in one line when ``config`` cannot be split ``size`` ways."""
    kv = config.num_kv_heads
    for name in ("num_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % size:
            raise TensorParallelError(f"--tensor-parallel-size {size} does not divide the model's {name} ({value}): "
                                      f"choose a size that divides {config.num_heads} heads and "
                                      f"{config.intermediate_size} MLP columns")
    if kv % size and size % kv:
        raise TensorParallelError(f"--tensor-parallel-size {size} and the model's {kv} KV heads: one must divide "
                                  f"the other")


def kv_replicas(config: ModelConfig, size: int) -> int:
    """How many ranks keep each KV head: 1 when the heads split, ``size / Hkv`` when there are fewer."""
    return max(1, size // config.num_kv_heads)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's part of the model has (its KV cache is sized from it)."""
    check_divisible(config, size)
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=max(1, config.num_kv_heads // size),
                               intermediate_size=config.intermediate_size // size)


def _keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def _keep_columns(linear: nn.Linear, start: int, stop: int, keep_bias: bool) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        # The bias is added once to the sum: by rank 0, as zero elsewhere.
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = stop - start


def shard_model(model: LlamaForCausalLM, group: TensorParallelGroup) -> LlamaForCausalLM:
    """Keep ``group.rank``'s share of ``model`` in place; ``model.config`` becomes the shard's shape
    and ``model.whole_config`` keeps the model's own (the layout KV blocks travel in)."""
    whole = model.config
    if getattr(model, "whole_config", None) is not None:
        raise TensorParallelError("this model is already sharded")
    if getattr(model.model.layers[0].self_attn, "qkv_proj", None) is not None or model.quantization != "none":
        raise TensorParallelError("shard a model before its projections are fused or quantized")
    part = shard_config(whole, group.size)
    r, d = group.rank, whole.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q0, q1 = r * part.num_heads * d, (r + 1) * part.num_heads * d
            first_kv = (r // kv_replicas(whole, group.size)) * part.num_kv_heads
            kv0, kv1 = first_kv * d, (first_kv + part.num_kv_heads) * d
            _keep_rows(attn.q_proj, q0, q1)
            _keep_rows(attn.k_proj, kv0, kv1)
            _keep_rows(attn.v_proj, kv0, kv1)
            _keep_columns(attn.o_proj, q0, q1, keep_bias=group.is_first)
            attn.num_heads, attn.num_kv_heads = part.num_heads, part.num_kv_heads
            i0, i1 = r * part.intermediate_size, (r + 1) * part.intermediate_size
            _keep_rows(mlp.gate_proj, i0, i1)
            _keep_rows(mlp.up_proj, i0, i1)
            _keep_columns(mlp.down_proj, i0, i1, keep_bias=group.is_first)
            attn.tensor_parallel = mlp.tensor_parallel = group
    if not group.is_first and not whole.tie_word_embeddings:
        model.lm_head = None  # logits are rank 0's: the others never compute them
    model.config, model.whole_config = part, whole
    model.tensor_parallel = group
    if model.model.embed_tokens.weight.is_cuda:
        torch.cuda.empty_cache()  # the whole matrices' blocks back, before the KV pool is sized
    return model
