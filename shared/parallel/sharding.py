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
import re
from collections.abc import Callable

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


# A decoder layer's linears by how they split: by output rows (no communication) or by input
# columns (partial sums, all-reduced).
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.(?P<linear>[a-z_]+\.[a-z_]+)\.(?P<kind>weight|bias)")


def _span(linear: str, whole: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """The rows (column-parallel) or columns (row-parallel) of ``linear`` that ``rank`` keeps."""
    part, d = shard_config(whole, size), whole.head_dim
    if linear in ("self_attn.q_proj", "self_attn.o_proj"):
        return rank * part.num_heads * d, (rank + 1) * part.num_heads * d
    if linear in ("self_attn.k_proj", "self_attn.v_proj"):
        first = (rank // kv_replicas(whole, size)) * part.num_kv_heads
        return first * d, (first + part.num_kv_heads) * d
    return rank * part.intermediate_size, (rank + 1) * part.intermediate_size


def rank_part(name: str, tensor: torch.Tensor, whole: ModelConfig, rank: int, size: int) -> torch.Tensor | None:
    """Rank ``rank``'s share of the whole model's tensor ``name`` (a state-dict name), a view where it
    can be: rows of a column-parallel linear, columns of a row-parallel one (whose bias rank 0 keeps
    whole and the others as zeros: it is added once to the sum), None for an untied LM head off rank
    0, the tensor itself for everything else. The one cut rule of :func:`shard_model` and of a
    weight reload (``runner.TensorParallelRunner.load_weights``)."""
    if name == "lm_head.weight" and rank != 0 and not whole.tie_word_embeddings:
        return None
    match = _LAYER_LINEAR.fullmatch(name)
    if match is None or size == 1:
        return tensor
    linear, kind = match["linear"], match["kind"]
    if linear in COLUMN_PARALLEL:
        start, stop = _span(linear, whole, rank, size)
        return tensor[start:stop]
    if linear in ROW_PARALLEL:
        if kind == "bias":
            return tensor if rank == 0 else torch.zeros_like(tensor)
        start, stop = _span(linear, whole, rank, size)
        return tensor[:, start:stop]
    return tensor


def shard_model(model: LlamaForCausalLM, group: TensorParallelGroup) -> LlamaForCausalLM:
    """Keep ``group.rank``'s share of ``model`` in place; ``model.config`` becomes the shard's shape
    and ``model.whole_config`` keeps the model's own (the layout KV blocks travel in)."""
    whole = model.config
    if getattr(model, "whole_config", None) is not None:
        raise TensorParallelError("this model is already sharded")
    if getattr(model.model.layers[0].self_attn, "qkv_proj", None) is not None or model.quantization != "none":
        raise TensorParallelError("shard a model before its projections are fused or quantized")
    part = shard_config(whole, group.size)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for linear_name in COLUMN_PARALLEL + ROW_PARALLEL:
                linear = layer.get_submodule(linear_name)
                prefix = f"model.layers.{index}.{linear_name}"
                for kind in ("weight", "bias"):
                    tensor = getattr(linear, kind)
                    if tensor is not None:  # cloned: the whole matrix's storage goes
                        shard = rank_part(f"{prefix}.{kind}", tensor.detach(), whole, group.rank, group.size)
                        setattr(linear, kind, nn.Parameter(shard.clone(), requires_grad=False))
                linear.out_features, linear.in_features = linear.weight.shape
            attn = layer.self_attn
            attn.num_heads, attn.num_kv_heads = part.num_heads, part.num_kv_heads
            attn.tensor_parallel = layer.mlp.tensor_parallel = group
    if not group.is_first and not whole.tie_word_embeddings:
        model.lm_head = None  # logits are rank 0's: the others never compute them
    model.config, model.whole_config = part, whole
    model.tensor_parallel = group
    if model.model.embed_tokens.weight.is_cuda:
        torch.cuda.empty_cache()  # the whole matrices' blocks back, before the KV pool is sized
    return model


def sharder(group: TensorParallelGroup | None) -> Callable[[LlamaForCausalLM], LlamaForCausalLM] | None:
    """What ``load_model(shard=...)`` takes for ``group``: None when there is nothing to split."""
    if group is None or group.size <= 1:
        return None
    return lambda model: shard_model(model, group)
