"""Physical KV-cache block bookkeeping: ref counts, a free list and chained block hashes.

Modelled on vLLM v1's ``block_pool.py`` and nano-vllm's ``block_manager.py``. A sequence owns a
*block table*: a plain ``list[int]`` of physical block ids, block ``i`` holding the K/V of token
positions ``[i * block_size, (i + 1) * block_size)``. The manager hands out blocks on demand as the
sequence grows and takes them back when it finishes or is preempted.

Invariants (checked by the tests):
- A block is on the free list if and only if its ``ref_count`` is 0; every block is either free or
  referenced by at least one block table (so ``num_free_blocks + #referenced == num_blocks``).
- Only full blocks carry a ``block_hash``; a block's hash is the chained hash of its tokens and the
  hash of the block before it, so it covers every token of the sequence up to the block's end.
- ``hash_to_block`` maps a hash to a block currently holding exactly those tokens. A freed block keeps
  its hash (its contents are still valid until it is reused); when it is taken from the free list
  again its hash and its ``hash_to_block`` entry are dropped. Prefix caching (a later issue) will look
  blocks up here; nothing reads it yet.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised by ``BlockManager.grow`` when the free list cannot cover the request."""


@dataclass
class Block:
    """One physical KV-cache block."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set only once the block is full
    token_ids: tuple[int, ...] | None = None  # the tokens the hash covers (for hash-collision checks)


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one block: blake2b (8 bytes) over the parent hash and int32 token bytes.

    Stable across processes and machines (unlike ``hash()``), so prefill and decode workers agree.
    The parent is its 8 little-endian bytes, or 8 zero bytes for the first block.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(bytes(8) if parent_hash is None else parent_hash.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(digest.digest(), "little")


class BlockManager:
    """Allocates physical blocks to block tables, with ref counts and a FIFO free list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Allocate from the left, return to the right: a freed block is reused as late as possible,
        # which keeps its (hashed) contents around longest for prefix caching.
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def blocks_needed(self, block_table: Sequence[int], num_tokens: int) -> int:
        """Extra blocks the table needs to hold ``num_tokens`` tokens (0 if it already can)."""
        blocks_for_tokens = -(-num_tokens // self.block_size)
        return max(0, blocks_for_tokens - len(block_table))

    def can_grow(self, block_table: Sequence[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self.free_block_ids)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append block ids to ``block_table`` in place so it holds ``num_tokens`` tokens.

        All or nothing: raises ``NoFreeBlocksError`` without allocating if the free list is too short.
        """
        needed = self.blocks_needed(block_table, num_tokens)
        if needed > len(self.free_block_ids):
            raise NoFreeBlocksError(
                f"need {needed} blocks for {num_tokens} tokens, only {len(self.free_block_ids)} free"
            )
        for _ in range(needed):
            block_table.append(self._take_free_block())

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block of the table and clear the table in place.

        Blocks go back in reverse order so a table's tail blocks (the least shareable prefix) sit
        nearer the front of the free list and are reused before its head blocks.
        """
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed while not referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        block_table.clear()

    def share(self, block_id: int) -> None:
        """Add a reference to a block that is already in use (e.g. a forked or prefix-shared table)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} is free; only referenced blocks can be shared")
        block.ref_count += 1

    def hash_full_blocks(
        self, block_table: Sequence[int], token_ids: Sequence[int], block_hashes: list[int]
    ) -> None:
        """Hash every block that became full since the last call; extend ``block_hashes`` in place.

        ``token_ids`` are the sequence's tokens whose K/V are (or are being) written to the cache;
        ``block_hashes[i]`` is the chained hash of block ``i``, so only blocks past
        ``len(block_hashes)`` are hashed: the work per step is proportional to the new blocks.
        """
        num_full = min(len(token_ids) // self.block_size, len(block_table))
        parent = block_hashes[-1] if block_hashes else None
        for index in range(len(block_hashes), num_full):
            start = index * self.block_size
            tokens = tuple(token_ids[start : start + self.block_size])
            parent = hash_block(parent, tokens)
            block = self.blocks[block_table[index]]
            block.block_hash = parent
            block.token_ids = tokens
            self.hash_to_block[parent] = block.block_id
            block_hashes.append(parent)

    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} on the free list with ref_count {block.ref_count}"
        if block.block_hash is not None:
            # Its contents are about to be overwritten: forget the cached prefix it held.
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id
