"""Host memory for the KV blocks of swapped-out sequences: one tensor and its block bookkeeping.

Layout: ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, the device cache's
(``cache.py``), so a block moves between the two as one contiguous copy. On CUDA the tensor is
pinned: copies from and to it can be queued on the device's stream without the host waiting
(``ModelRunner.swap_out`` / ``swap_in``); on CPU it is ordinary memory.

Only bookkeeping lives here: which host blocks are free and which sequence (its *holder*) each
other one holds a block of. What a sequence's blocks are and when they move is the scheduler's
(``engine/swapping.py``).

Invariants: a block is either on the free list or has exactly one holder
(``num_free_blocks + len(holders) == num_blocks``); ``allocate`` takes from the front of the free
list, ``free`` appends to the back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from tandem.shared.kvcache.cache import kv_cache_bytes_per_block

GIB = 1 << 30


def num_swap_blocks(swap_space_gib: float, bytes_per_block: int) -> int:
    """Whole blocks of ``bytes_per_block`` bytes (``cache.kv_cache_bytes_per_block``) that fit in
    ``swap_space_gib`` GiB."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    return max(0, int(swap_space_gib * GIB) // bytes_per_block)


class SwapSpace:
    """``num_blocks`` host blocks of one block layout, handed out to holders and taken back."""

    def __init__(self, num_blocks: int, block_shape: Sequence[int], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        """``block_shape``: one block's ``(num_layers, 2, block_size, num_kv_heads, head_dim)``;
        ``pin_memory``: page-locked (needs CUDA), for asynchronous copies to and from a GPU."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        # Empty, not zeros: a host block is read only after a swap-out wrote it.
        self.kv = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.holders: dict[int, object] = {}  # host block -> the sequence it holds a block of

    @classmethod
    def for_cache(cls, swap_space_gib: float, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device | str) -> SwapSpace | None:
        """A swap space of ``swap_space_gib`` GiB for a KV cache of this layout on ``device`` (pinned
        when that is CUDA); None when not one block fits (no swapping)."""
        per_block = kv_cache_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = num_swap_blocks(swap_space_gib, per_block)
        if num_blocks == 0:
            return None
        return cls(num_blocks, (num_layers, 2, block_size, num_kv_heads, head_dim), dtype,
                   pin_memory=torch.device(device).type == "cuda")

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding a swapped-out block, 0..1."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def allocate(self, num_blocks: int, holder: object) -> list[int]:
        """``num_blocks`` free host blocks, now held by ``holder``; all or nothing (``ValueError``
        when fewer are free)."""
        if not self.can_allocate(num_blocks):
            raise ValueError(f"need {num_blocks} host blocks, only {len(self.free_block_ids)} free")
        block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.holders[block_id] = holder
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Give host blocks back (their contents are forgotten)."""
        for block_id in block_ids:
            if block_id not in self.holders:
                raise ValueError(f"host block {block_id} freed while not held")
            del self.holders[block_id]
            self.free_block_ids.append(block_id)

    def blocks_of(self, holder: object) -> list[int]:
        """The host blocks ``holder`` holds (a linear scan: for checks and tests)."""
        return [block_id for block_id, held_by in self.holders.items() if held_by is holder]
