"""Adapters resident on the device: fixed stacks of slots the forward reads, written in place.

The stacks are allocated once (``max_loras`` slots of rank ``max_rank``) and never reallocated, so a
captured CUDA graph keeps reading the same storage: a new adapter in a slot needs no recapture, only
the rows' slot indices change. Which adapter sits in which slot, and which to evict, is
``AdapterCache``'s business (``cache.py``).
"""

from __future__ import annotations

import torch

from tandem.shared.lora.groups import LoraGroup, lora_groups
from tandem.shared.lora.ops import LoraBatch, add_gathered, add_segmented
from tandem.shared.lora.peft_format import AdapterError, LoraWeights
from tandem.shared.model.config import ModelConfig


def slot_bytes(config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device memory of the stacks: what the KV pool leaves aside for them."""
    per_slot = sum(len(g.targets) * max_rank * g.in_features + g.out_features * max_rank
                   for g in lora_groups(config).values())
    return config.num_layers * max_loras * per_slot * torch.empty(0, dtype=dtype).element_size()


class AdapterSlots:
    """Per group, ``a [layers, slots, n*R, in]`` and ``b [layers, slots, out, R]`` on the device."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        if max_loras < 1 or max_rank < 1:
            raise AdapterError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_rank}) must be at least 1")
        self.groups = lora_groups(config)
        self.num_layers = config.num_layers
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.a = {name: torch.zeros(config.num_layers, max_loras, len(g.targets) * max_rank, g.in_features,
                                    device=self.device, dtype=dtype) for name, g in self.groups.items()}
        self.b = {name: torch.zeros(config.num_layers, max_loras, g.out_features, max_rank, device=self.device,
                                    dtype=dtype) for name, g in self.groups.items()}
        self.ranks = [0] * max_loras  # each slot's adapter rank (0: empty)
        # Groups each slot's adapter has targets in: the segmented path skips the others.
        self.slot_groups: list[frozenset[str]] = [frozenset()] * max_loras
        self.batch: LoraBatch | None = None  # the rows of the forward now running (None: no adapter rows)

    @torch.inference_mode()
    def write(self, slot: int, weights: LoraWeights) -> None:
        """Put ``weights`` in ``slot`` (queued on the current stream; the scaling is folded into B)."""
        config = weights.config
        if config.rank > self.max_rank:
            raise AdapterError(f"adapter rank {config.rank} is above the limit {self.max_rank}; raise --max-lora-rank")
        r, scaling = config.rank, config.scaling
        used = set()
        for name, group in self.groups.items():
            a, b = self.a[name][:, slot], self.b[name][:, slot]
            a.zero_()
            b.zero_()
            for j, (target, offset, size) in enumerate(zip(group.targets, group.out_offsets(), group.out_sizes)):
                if target not in config.targets:
                    continue
                used.add(name)
                for layer in range(self.num_layers):
                    rows = slice(j * self.max_rank, j * self.max_rank + r)
                    a[layer, rows].copy_(weights.a[(layer, target)], non_blocking=True)
                    b[layer, offset : offset + size, :r].copy_(weights.b[(layer, target)].float() * scaling,
                                                               non_blocking=True)
        self.ranks[slot] = r
        self.slot_groups[slot] = frozenset(used)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> None:
        """Add the running batch's adapter products for ``group`` of ``layer`` to ``out`` in place."""
        batch = self.batch
        if batch is None or batch.empty:
            return
        a, b, spec = self.a[group][layer], self.b[group][layer], self.groups[group]
        if batch.runs is None:
            _gathered(out, x, a, b, spec, self.max_rank, batch.token_slots)
            return
        if not any(group in self.slot_groups[run[0]] for run in batch.runs):
            return
        if x.is_cuda:
            from tandem.shared.lora import triton_bgmv

            if triton_bgmv.supports(x):  # one launch for every run, however many
                triton_bgmv.add_sgmv(out, x, a, b, spec, self.max_rank, *batch.segments(),
                                     max_segment_rows=batch.longest_run())
                return
        add_segmented(out, x, a, b, spec, self.max_rank, [r for r in batch.runs if group in self.slot_groups[r[0]]],
                      self.ranks)


def _gathered(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup, rank: int,
              token_slots: torch.Tensor) -> None:
    if x.is_cuda:
        from tandem.shared.lora import triton_bgmv

        if triton_bgmv.supports(x):
            triton_bgmv.add_bgmv(out, x, a, b, group, rank, token_slots)
            return
    add_gathered(out, x, a, b, group, rank, token_slots)
