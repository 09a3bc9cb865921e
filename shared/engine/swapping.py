"""Preemption by swapping: a victim's KV blocks go to host memory and come back when it resumes.

Swap-out (:meth:`Swapper.swap_out`) sorts the blocks holding a victim's computed tokens three ways:

- *shared* (``ref_count > 1``: a prefix-cache claim, a forked sample, a beam): it stays on the device
  and the swapped sequence keeps its reference, so the other holders see it unchanged, a writer
  among them still copies it first (copy on write), and it is never copied out, nor twice;
- *cached* (held alone, full, with a prefix-cache hash): given back to the pool, where it stays
  cached, findable by hash (these are the blocks a KV-store is offered), until evicted; swap-in
  claims it again by hash;
- *private* (held alone, no hash: the partly filled last block, or every block with caching off):
  copied to a host block of the :class:`~tandem.shared.kvcache.swap_space.SwapSpace`.

Blocks past the computed tokens hold nothing yet and go back to the pool.

Swap-in (:meth:`Swapper.swap_in`) rebuilds the block table in order: shared blocks as they were,
cached ones claimed, each host block copied into a fresh device block and freed. If a cached block
was evicted meanwhile the sequence cannot come back this way (:meth:`Swapper.reclaimable` says
None): the scheduler recomputes it instead, after :meth:`Swapper.drop` gave its host copies and
its shared references back.

The copies are the engine's: swap-out and swap-in return ``(device block, host block)`` pairs,
which the scheduler hands on in its batch; this module only does the bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.engine.sequence import Sequence
from tandem.shared.kvcache.block_manager import BlockManager
from tandem.shared.kvcache.swap_space import SwapSpace


@dataclass
class SwappedTable:
    """Where each computed block of a swapped-out sequence is, by its index in the block table."""

    num_blocks: int  # blocks that held computed tokens
    shared: dict[int, int]  # index -> device block the sequence still references
    cached: list[int]  # indices given back to the prefix cache, claimed again by hash
    host: dict[int, int]  # index -> host block holding its copy


class Swapper:
    """Moves block tables between the block manager and a swap space (bookkeeping only)."""

    def __init__(self, block_manager: BlockManager, swap_space: SwapSpace) -> None:
        self.block_manager = block_manager
        self.swap_space = swap_space
        self.tables: dict[Sequence, SwappedTable] = {}  # every swapped-out sequence's

    def private_blocks(self, seq: Sequence) -> list[int]:
        """Indices of the running ``seq``'s blocks that a swap-out copies to the host."""
        blocks = self.block_manager.blocks
        return [index for index, block_id in enumerate(seq.block_table[: self._num_computed_blocks(seq)])
                if blocks[block_id].ref_count == 1 and blocks[block_id].block_hash is None]

    def can_swap_out(self, seq: Sequence) -> bool:
        """Whether the swap space has room for ``seq``'s private blocks."""
        return self.swap_space.can_allocate(len(self.private_blocks(seq)))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Take the running ``seq``'s blocks off the device (see the module docstring) and clear its
        table; returns the ``(device block, host block)`` copies to make before anything writes the
        freed device blocks. ``ValueError`` (changing nothing) if the swap space lacks room."""
        blocks = self.block_manager.blocks
        num_blocks = self._num_computed_blocks(seq)
        private = self.private_blocks(seq)
        host_ids = self.swap_space.allocate(len(private), holder=seq)
        shared = {i: block_id for i, block_id in enumerate(seq.block_table[:num_blocks])
                  if blocks[block_id].ref_count > 1}
        cached = [i for i in range(num_blocks) if i not in shared and blocks[seq.block_table[i]].block_hash is not None]
        pairs = [(seq.block_table[i], host_id) for i, host_id in zip(private, host_ids)]
        # Everything but the shared blocks goes back, in table order (``free`` returns tails first).
        self.block_manager.free([block_id for i, block_id in enumerate(seq.block_table) if i not in shared])
        seq.block_table.clear()
        self.tables[seq] = SwappedTable(num_blocks, shared, cached, dict(zip(private, host_ids)))
        return pairs

    def reclaimable(self, seq: Sequence) -> list[int] | None:
        """The device blocks that hold the swapped ``seq``'s cached blocks now, in the order of
        ``SwappedTable.cached``; None when one was evicted (it must be recomputed instead)."""
        table = self.tables[seq]
        if not table.cached:
            return []
        bs = self.block_manager.block_size
        found = self.block_manager.find_cached_prefix(seq.token_ids[: (table.cached[-1] + 1) * bs], seq.hash_root)
        if len(found) <= table.cached[-1]:
            return None
        return [found[i] for i in table.cached]

    def can_swap_in(self, seq: Sequence, reclaimed: list[int]) -> bool:
        """Whether the pool can take the swapped ``seq`` back with room for all its known tokens
        (for a decoding sequence: its computed ones plus the one it computes next), ``reclaimed``
        being :meth:`reclaimable`'s answer."""
        bm, table = self.block_manager, self.tables[seq]
        growth = max(0, -(-seq.num_tokens // bm.block_size) - table.num_blocks)
        revived = sum(1 for block_id in reclaimed if bm.blocks[block_id].ref_count == 0)
        # Its next write lands in a block it still shares: that write needs a private copy first.
        write_index = seq.num_computed_tokens // bm.block_size
        copy = write_index in table.shared and bm.blocks[table.shared[write_index]].ref_count > 1
        return len(table.host) + growth + copy + revived <= bm.num_free_blocks

    def swap_in(self, seq: Sequence, reclaimed: list[int]) -> list[tuple[int, int]]:
        """Give the swapped ``seq`` its block table back (``can_swap_in`` must hold); returns the
        ``(device block, host block)`` copies to make before anything reads those device blocks.
        Its host blocks are free again once the copies are queued."""
        bm, table = self.block_manager, self.tables.pop(seq)
        claimed: list[int] = []
        bm.claim(claimed, reclaimed)  # before taking fresh blocks: those may come from the cached ones' free list
        fresh: list[int] = []
        bm.grow(fresh, len(table.host) * bm.block_size)
        at_index = {**table.shared, **dict(zip(table.cached, claimed)), **dict(zip(sorted(table.host), fresh))}
        seq.block_table[:] = [at_index[i] for i in range(table.num_blocks)]
        pairs = [(at_index[i], host_id) for i, host_id in table.host.items()]
        self.swap_space.free(list(table.host.values()))
        return pairs

    def drop(self, seq: Sequence) -> None:
        """Forget the swapped ``seq``'s blocks: host copies and shared references go back."""
        table = self.tables.pop(seq)
        self.swap_space.free(list(table.host.values()))
        self.block_manager.free(list(table.shared.values()))

    def _num_computed_blocks(self, seq: Sequence) -> int:
        return min(len(seq.block_table), -(-seq.num_computed_tokens // self.block_manager.block_size))
