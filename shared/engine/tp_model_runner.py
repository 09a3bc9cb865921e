"""The model runner of a tensor-parallel worker: rank 0 leads, the other ranks follow.

Rank 0 runs the whole engine (scheduler, block manager, sampling) over a
:class:`TensorParallelRunner`. Each of its operations on the model or the KV cache first sends a
command over the control group; ranks 1.. wait in :func:`follow` and perform the same operation
on their shard, so every rank enters the same collectives in the same order. A step's inputs
(token ids, positions, attention metadata) go as one int64 tensor over the device group: on CUDA
the ids of an overlapped step exist only on rank 0's device, and a broadcast moves them without
a host round trip.

KV blocks leave and enter in the model's whole layout (every KV head once): an export gathers
each rank's heads to rank 0 (a head several ranks keep is taken from the first of them), an import
scatters the heads to their ranks. A worker of any size therefore
hands off to a worker of any other size, and to a KV-store, in the format single-device workers use.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence as Seq

import torch

from tandem.shared.engine.model_runner import ModelRunner
from tandem.shared.kvcache.attention import AttentionMetadata
from tandem.shared.kvcache.cache import gather_blocks, scatter_blocks
from tandem.shared.kvcache.swap_space import SwapSpace
from tandem.shared.parallel.group import TensorParallelGroup
from tandem.shared.parallel.sharding import kv_replicas, rank_part

log = logging.getLogger("tandem.parallel")

HEAD_DIM_OF_BLOCKS = 4  # [n, L, 2, bs, Hkv, D]: the KV heads of a block of exported KV

# The int fields of a step's header, in order (the tensors' lengths and the metadata's scalars).
_HEADER = ("num_tokens", "num_seqs", "max_blocks", "max_query_len", "max_context_len", "num_decode_seqs")


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[tuple, torch.Tensor]:
    """A step's inputs as (header ints, one int64 tensor on their device)."""
    tables = meta.block_tables
    header = (input_ids.shape[0], tables.shape[0], tables.shape[1], meta.max_query_len, meta.max_context_len,
              meta.num_decode_seqs)
    flat = torch.cat([input_ids.long(), positions.long(), meta.slot_mapping.long(), meta.query_start_loc.long(),
                      meta.context_lens.long(), tables.long().flatten()])
    return header, flat


def unpack_step(header: tuple, flat: torch.Tensor, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    fields = dict(zip(_HEADER, header))
    t, b, m = fields["num_tokens"], fields["num_seqs"], fields["max_blocks"]
    ids, positions, slots, starts, context, tables = flat.split([t, t, t, b + 1, b, b * m])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts.int(), context_lens=context.int(),
                             block_tables=tables.view(b, m).int(), max_query_len=fields["max_query_len"],
                             max_context_len=fields["max_context_len"], block_size=block_size,
                             num_decode_seqs=fields["num_decode_seqs"])
    return ids, positions, meta


def step_length(header: tuple) -> int:
    fields = dict(zip(_HEADER, header))
    t, b, m = fields["num_tokens"], fields["num_seqs"], fields["max_blocks"]
    return 3 * t + (b + 1) + b + b * m


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every operation that touches the model or the cache is done by all ranks."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device | str,
                 dtype: torch.dtype, group: TensorParallelGroup, **kwargs) -> None:
        self.group = group
        self.replicas = kv_replicas(model.whole_config, group.size)
        swap_space: SwapSpace | None = kwargs.get("swap_space")
        # The followers capture the same graphs as this rank, at the same time (cuda_graphs.py).
        group.send_command(("build", {"num_blocks": num_blocks, "block_size": block_size,
                                      "max_model_len": kwargs.get("max_model_len", 4096),
                                      "cuda_graph_max_batch": kwargs.get("cuda_graph_max_batch", 0),
                                      "swap_blocks": 0 if swap_space is None else swap_space.num_blocks,
                                      "quantization": kwargs.get("quantization", "none")}))
        super().__init__(model, num_blocks, block_size, device, dtype, **kwargs)

    @property
    def kv_layout(self) -> tuple[int, ...]:
        layers, two, block_size, heads, head_dim = self.kv_cache.shape[1:]
        return (layers, two, block_size, heads * self.group.size // self.replicas, head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                adapter_rows=()) -> torch.Tensor:  # noqa: ANN001 - no adapters here: the engine refuses them
        header, flat = pack_step(input_ids, positions, meta)
        self.group.send_command(("forward", header))
        self.group.broadcast(flat)
        return super().forward(input_ids, positions, meta)

    @torch.inference_mode()
    def export_kv(self, block_table: Seq[int], num_tokens: int) -> torch.Tensor:
        block_ids = list(block_table[: -(-num_tokens // self.block_size)])
        self.group.send_command(("export", block_ids))
        heads = self.group.gather_heads(gather_blocks(self.kv_cache, block_ids), HEAD_DIM_OF_BLOCKS)
        return heads if self.replicas == 1 else heads[:, :, :, :, :: self.replicas].contiguous()

    @torch.inference_mode()
    def import_kv(self, block_table: Seq[int], kv: torch.Tensor) -> None:
        block_ids = list(block_table[: kv.shape[0]])
        local_shape = (len(block_ids), *self.kv_cache.shape[1:])
        self.group.send_command(("import", block_ids, local_shape))
        if self.replicas > 1:  # each head once per rank keeping it
            kv = kv.repeat_interleave(self.replicas, dim=HEAD_DIM_OF_BLOCKS)
        local = self.group.scatter_heads(kv, local_shape, self.kv_cache.dtype, HEAD_DIM_OF_BLOCKS)
        scatter_blocks(self.kv_cache, block_ids, local)

    @torch.inference_mode()
    def copy_blocks(self, pairs: Seq[tuple[int, int]]) -> None:
        if pairs:
            self.group.send_command(("copy", list(pairs)))
            super().copy_blocks(pairs)

    @torch.inference_mode()
    def swap_out(self, pairs: Seq[tuple[int, int]]) -> None:
        self.group.send_command(("swap_out", list(pairs)))
        super().swap_out(pairs)

    @torch.inference_mode()
    def swap_in(self, pairs: Seq[tuple[int, int]]) -> None:
        self.group.send_command(("swap_in", list(pairs)))
        super().swap_in(pairs)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """New whole-model weights into every rank's share, in place: every rank's share of each tensor
        is checked against the served shape first (a mismatch refuses before any rank changes), then broadcast whole,
        one at a time, and every rank keeps its part by the same cut as at load
        (:func:`sharding.rank_part`)."""
        whole, size = self.model.whole_config, self.group.size
        served = self.model.state_dict()
        for name, tensor in state_dict.items():  # every rank's share has rank 0's shape (the lm head: rank 0's only)
            if name not in served:
                continue
            for rank in range(size):
                part = rank_part(name, tensor, whole, rank, size)
                if part is not None and tuple(part.shape) != tuple(served[name].shape):
                    raise ValueError(f"{name}: rank {rank}'s share of {tuple(tensor.shape)} would be "
                                     f"{tuple(part.shape)}, the served shares are {tuple(served[name].shape)}")
        entries = [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
                   for name, tensor in state_dict.items()]
        self.group.send_command(("load", entries))
        for name, tensor in state_dict.items():  # one at a time: never a model's worth of whole tensors on the device
            part = rank_part(name, self.group.broadcast(tensor.to(self.device).contiguous()), whole, 0, size)
            if part is not None:
                super().load_weights({name: part})


@torch.inference_mode()
def follow(model: torch.nn.Module, group: TensorParallelGroup, device: torch.device, dtype: torch.dtype) -> None:
    """Ranks 1..: build this rank's runner when rank 0 builds its own, then do what rank 0 does,
    until it says stop."""
    runner: ModelRunner | None = None
    while True:
        op, *args = group.next_command()
        if op == "stop":
            return
        if op == "build":
            spec = args[0]
            if runner is not None:  # rank 0 built a new engine: the old pool and graphs go first
                runner = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            cfg = model.config
            swap = None
            if spec["swap_blocks"]:
                swap = SwapSpace(spec["swap_blocks"], (cfg.num_layers, 2, spec["block_size"], cfg.num_kv_heads,
                                                       cfg.head_dim), dtype, pin_memory=device.type == "cuda")
            runner = ModelRunner(model, spec["num_blocks"], spec["block_size"], device, dtype,
                                 cuda_graph_max_batch=spec["cuda_graph_max_batch"],
                                 max_model_len=spec["max_model_len"], swap_space=swap,
                                 quantization=spec["quantization"])
            log.info("rank %d of %d: %d KV blocks of %d KV heads", group.rank, group.size, spec["num_blocks"],
                     cfg.num_kv_heads)
        elif op == "forward":
            header = args[0]
            flat = group.broadcast(torch.empty(step_length(header), dtype=torch.long, device=device))
            runner.forward(*unpack_step(header, flat, runner.block_size))
        elif op == "replay":
            runner.graphs.replay_following(args[0])
        elif op == "export":
            group.gather_heads(gather_blocks(runner.kv_cache, args[0]), HEAD_DIM_OF_BLOCKS)
        elif op == "import":
            block_ids, local_shape = args
            scatter_blocks(runner.kv_cache, block_ids,
                           group.scatter_heads(None, local_shape, runner.kv_cache.dtype, HEAD_DIM_OF_BLOCKS))
        elif op == "copy":
            runner.copy_blocks(args[0])
        elif op == "swap_out":
            runner.swap_out(args[0])
        elif op == "swap_in":
            runner.swap_in(args[0])
        elif op == "load":
            for name, shape, dtype in args[0]:
                whole_tensor = group.broadcast(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
                part = rank_part(name, whole_tensor, model.whole_config, group.rank, group.size)
                if part is not None:
                    runner.load_weights({name: part})
        elif op == "ping":  # the command channel measured (benchmarks/tensor_parallel.py): reply when asked
            if args[0]:
                group.min_over_ranks(0)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op!r}")
