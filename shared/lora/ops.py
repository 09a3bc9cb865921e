"""The low-rank products a mixed batch adds to a projection's output, in plain torch.

A group's adapters sit in stacks: ``a [slots, n*R, in]`` (each target's A in its own R rows) and
``b [slots, out, R]`` (each target's B in its own output rows, the scaling folded in); ranks below R
are zero-padded, which adds exact zeros. Each token row names its slot (-1: no adapter).

Two ways, by what the host knows: ``add_segmented`` when the rows' slots are known on the host (runs
of rows with one adapter: a real matmul per run, the way prefill chunks arrive), ``add_gathered``
when only the device knows them (inside a captured CUDA graph: per-row gathered products, what
Punica's BGMV computes; the Triton kernels in ``triton_bgmv`` do it without materializing the gathered
weights, and this is their reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.shared.lora.groups import LoraGroup


@dataclass
class LoraBatch:
    """Which adapter slot each token row of one forward uses."""

    # [T] int64 on the device, -1 where the row has no adapter (inside graphs: a static input buffer)
    token_slots: torch.Tensor | None
    # (slot, first row, end row) runs with an adapter, when the host knows them; None inside graphs.
    runs: list[tuple[int, int, int]] | None = None
    device: torch.device | None = None
    # The runs as device tensors for the segmented kernel, made on first use.
    _segments: tuple[torch.Tensor, torch.Tensor] | None = None

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts [n+1], slots [n])`` int64 on the device: run i is rows starts[i] .. starts[i+1]
        (gaps between runs are runs of slot -1)."""
        if self._segments is None:
            starts, slots, end = [], [], 0
            for slot, start, stop in self.runs:
                if start > end:
                    starts.append(end)
                    slots.append(-1)
                starts.append(start)
                slots.append(slot)
                end = stop
            starts.append(end)
            flat = torch.tensor(starts + slots, dtype=torch.long).to(self.device)
            self._segments = (flat[: len(starts)], flat[len(starts):])
        return self._segments

    @classmethod
    def from_runs(cls, adapter_rows: Sequence[tuple[int, int]], device: torch.device) -> LoraBatch:
        """From ``(slot, row count)`` per sequence in batch order (slot -1: no adapter); neighbours of
        one adapter merge into one run."""
        runs: list[tuple[int, int, int]] = []
        start = 0
        for slot, count in adapter_rows:
            if slot >= 0 and count:
                if runs and runs[-1][0] == slot and runs[-1][2] == start:
                    runs[-1] = (slot, runs[-1][1], start + count)
                else:
                    runs.append((slot, start, start + count))
            start += count
        return cls(None, runs, device)

    def longest_run(self) -> int:
        return max((end - start for _, start, end in self.runs), default=0)

    @property
    def empty(self) -> bool:
        return self.runs is not None and not self.runs


def add_segmented(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup,
                  rank: int, runs: Sequence[tuple[int, int, int]], ranks: Sequence[int] | None = None) -> None:
    """``out[rows] += x[rows] @ A[slot]^T @ B[slot]^T`` for each run, target by target, in place.
    ``ranks``: each slot's own rank (only those columns are multiplied); None: the full ``rank``."""
    offsets = group.out_offsets()
    for slot, start, end in runs:
        r = rank if ranks is None else ranks[slot]
        if r == 0:
            continue
        rows = x[start:end]
        for j, (offset, size) in enumerate(zip(offsets, group.out_sizes)):
            shrunk = rows @ a[slot, j * rank : j * rank + r].t()
            out[start:end, offset : offset + size] += shrunk @ b[slot, offset : offset + size, :r].t()


def add_gathered(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup,
                 rank: int, token_slots: torch.Tensor) -> None:
    """The same sums with each row's slot read on the device (no host sync, graph-capturable):
    rows' A and B are gathered, so this costs a copy of them per row; the reference for the kernels."""
    valid = (token_slots >= 0).to(x.dtype).unsqueeze(1)
    index = token_slots.clamp(min=0)
    shrunk = torch.bmm(a.index_select(0, index), x.unsqueeze(2)).squeeze(2) * valid  # [T, n*R]
    for j, (offset, size) in enumerate(zip(group.out_offsets(), group.out_sizes)):
        rows_b = b[:, offset : offset + size].index_select(0, index)  # [T, size, R]
        target_shrunk = shrunk[:, j * rank : (j + 1) * rank].unsqueeze(2)
        out[:, offset : offset + size] += torch.bmm(rows_b, target_shrunk).squeeze(2)
