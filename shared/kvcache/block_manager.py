"""Physical KV-cache block bookkeeping: ref counts, an LRU free list, chained block hashes and the
prefix cache built on them.

Modelled on vLLM v1's ``block_pool.py`` (automatic prefix caching) and nano-vllm's
``block_manager.py``. A sequence owns a *block table*: a plain ``list[int]`` of physical block ids,
block ``i`` holding the K/V of token positions ``[i * block_size, (i + 1) * block_size)``. The
manager hands out blocks on demand as the sequence grows and takes them back when it finishes or is
preempted. A full block keeps its chained hash after it is freed: it stays *cached* (free, but
findable by ``find_cached_prefix`` and reusable through ``claim``) until the free list hands it out
for new contents, least recently freed first.

Invariants (checked by the tests):
- A block is on the free list if and only if its ``ref_count`` is 0; every block is either free or
  referenced by at least one block table (so ``num_free_blocks + #referenced == num_blocks``).
- The free list is ordered by release: ``grow`` takes from the front, ``free`` appends to the back,
  ``claim`` takes a cached block out of the middle in O(1) (an insertion-ordered dict).
- ``block.block_hash is not None`` if and only if ``hash_to_block[block.block_hash] == block_id``:
  one block per hash. Such a block is full, ``token_ids`` are its ``block_size`` tokens and
  ``parent_hash`` the hash of the block before it in the chain (None for the first), so its hash
  covers every token of the sequence up to its end. A block that fills with a hash some other block
  already holds stays unregistered (no hash) and is an ordinary block.
- A hashed block is never written: its K/V stay valid for its whole chain until it is evicted
  (taken from the free list for new contents, which drops its hash). Writes go only to blocks a
  single sequence holds, at positions past its computed tokens (the scheduler's side of this).
- ``num_cached_blocks`` counts the free blocks with a hash.
- Forked tables (parallel samples, beams: ``fork``) share every block, the partly filled last one
  too. A block is written only while one table holds it: a table about to write into a block whose
  ``ref_count`` exceeds 1 first takes a private copy (``copy_on_write``); the other holders keep
  the original. So shared blocks are read-only, like cached ones.
- Every change of the set of hashes in ``hash_to_block`` is reported once by ``drain_events``, as the
  net change since the previous drain (``stored`` and ``removed`` are disjoint), so the pending events
  never exceed ``2 * num_blocks`` hashes even if nobody drains them.
- With ``enable_caching=False`` nothing is registered (no hashes on blocks, no events, no hits);
  allocation order is the same either way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.shared.protocol.block_hashes import hash_block


class NoFreeBlocksError(RuntimeError):
    """Raised by ``BlockManager.grow`` when the free list cannot cover the request."""


@dataclass
class Block:
    """One physical KV-cache block."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set only while the block is registered in hash_to_block
    token_ids: tuple[int, ...] | None = None  # the tokens the hash covers (checked on reuse)
    parent_hash: int | None = None  # hash of the previous block of the chain (checked on reuse)


class BlockManager:
    """Allocates physical blocks to block tables, with ref counts, an LRU free list and a prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Keys only (values unused): O(1) popleft, append and removal from the middle.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_cow_copies = 0  # blocks copied because a forked table wrote into a shared one
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of those, tokens found in the cache
        self._num_cached_free = 0
        self._stored: dict[int, None] = {}  # net changes since the last drain, in order
        self._removed: dict[int, None] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable (hashed) prefix."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (cached free blocks count as free)."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def blocks_needed(self, block_table: Sequence[int], num_tokens: int) -> int:
        """Extra blocks the table needs to hold ``num_tokens`` tokens (0 if it already can)."""
        blocks_for_tokens = -(-num_tokens // self.block_size)
        return max(0, blocks_for_tokens - len(block_table))

    def can_grow(self, block_table: Sequence[int], num_tokens: int, claim: Sequence[int] = ()) -> bool:
        """Whether the table, after claiming the cached blocks ``claim``, can grow to ``num_tokens``.

        Claimed blocks that are free leave the free list, so they count against it too.
        """
        revived = sum(1 for block_id in claim if self.blocks[block_id].ref_count == 0)
        needed = max(0, -(-num_tokens // self.block_size) - len(block_table) - len(claim))
        return needed + revived <= len(self.free_block_ids)

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
        nearer the front of the free list and are evicted before its head blocks.
        """
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed while not referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is not None:
                    self._num_cached_free += 1
        block_table.clear()

    def share(self, block_id: int) -> None:
        """Add a reference to a block that is already in use (e.g. a forked or prefix-shared table)."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} is free; only referenced blocks can be shared")
        block.ref_count += 1

    def fork(self, block_table: Sequence[int]) -> list[int]:
        """A new table sharing every block of ``block_table`` (ref +1 each): a forked sample or beam
        reads the same K/V until it writes (see ``copy_on_write``)."""
        for block_id in block_table:
            self.share(block_id)
        return list(block_table)

    def needs_copy(self, block_table: Sequence[int], position: int) -> bool:
        """Whether writing token ``position`` into the table first needs a private copy of its block."""
        index = position // self.block_size
        return index < len(block_table) and self.blocks[block_table[index]].ref_count > 1

    def blocks_to_write(self, block_table: Sequence[int], position: int, num_tokens: int) -> int:
        """Free blocks a write of tokens ``position .. num_tokens - 1`` takes: new blocks plus a copy
        of a shared block it starts in."""
        return self.blocks_needed(block_table, num_tokens) + self.needs_copy(block_table, position)

    def can_write(self, block_table: Sequence[int], position: int, num_tokens: int) -> bool:
        return self.blocks_to_write(block_table, position, num_tokens) <= len(self.free_block_ids)

    def copy_on_write(self, block_table: list[int], position: int) -> tuple[int, int] | None:
        """Make the block that token ``position`` goes to private before it is written: when other
        tables share it, put a fresh block in its place (ref -1 on the original, which they keep)
        and return ``(original, copy)`` for the caller to copy the K/V; None when it is already
        private (or not allocated yet). ``NoFreeBlocksError`` if no block is free."""
        if not self.needs_copy(block_table, position):
            return None
        index = position // self.block_size
        if not self.free_block_ids:
            raise NoFreeBlocksError(f"no free block to copy shared block {block_table[index]} into")
        original = block_table[index]
        self.blocks[original].ref_count -= 1  # > 0: the others still hold it
        block_table[index] = self._take_free_block()
        self.num_cow_copies += 1
        return original, block_table[index]

    def find_cached_prefix(self, token_ids: Sequence[int], root: int | None = None) -> list[int]:
        """Block ids of the longest cached chain of full blocks starting at ``token_ids[0]``, under
        the chain root ``root`` (a LoRA adapter's; None: the base model's).

        Pure lookup: nothing is claimed. A block matches only if its hash, its parent's hash and its
        tokens all equal ours, so a hash collision can never hand out another prefix's K/V.
        """
        found: list[int] = []
        if not self.enable_caching:
            return found
        parent: int | None = root
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            tokens = tuple(token_ids[start : start + self.block_size])
            block_hash = hash_block(parent, tokens)
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:
                break
            found.append(block_id)
            parent = block_hash
        return found

    def claim(self, block_table: list[int], block_ids: Sequence[int]) -> None:
        """Append cached blocks (from ``find_cached_prefix``) to the table: ref +1 each, a free one
        leaves the free list (it is no longer evictable) but keeps its hash."""
        for block_id in block_ids:
            if self.blocks[block_id].block_hash is None:
                raise ValueError(f"block {block_id} holds no cached prefix; only cached blocks can be claimed")
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
                self._num_cached_free -= 1
            block.ref_count += 1
            block_table.append(block_id)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (in tokens, like vLLM's prefix cache queries/hits)."""
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def hash_full_blocks(
        self, block_table: Sequence[int], token_ids: Sequence[int], block_hashes: list[int], root: int | None = None
    ) -> None:
        """Hash every block that became full since the last call; extend ``block_hashes`` in place.

        ``token_ids`` are the sequence's tokens whose K/V are in the cache; ``block_hashes[i]`` is the
        chained hash of block ``i``, so only blocks past ``len(block_hashes)`` are hashed: the work per
        step is proportional to the new blocks. Each newly full block is registered (cacheable)
        unless another block already holds its hash.
        """
        num_full = min(len(token_ids) // self.block_size, len(block_table))
        parent = block_hashes[-1] if block_hashes else root
        for index in range(len(block_hashes), num_full):
            start = index * self.block_size
            tokens = tuple(token_ids[start : start + self.block_size])
            block_hash = hash_block(parent, tokens)
            block = self.blocks[block_table[index]]
            if self.enable_caching and block_hash not in self.hash_to_block:
                assert block.block_hash is None, f"block {block.block_id} hashed twice"
                block.block_hash, block.token_ids, block.parent_hash = block_hash, tokens, parent
                self.hash_to_block[block_hash] = block.block_id
                self._note(block_hash, stored=True)
            block_hashes.append(block_hash)
            parent = block_hash

    def drain_events(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)``: hashes that became findable / stopped being findable since the last
        call, net (a hash stored and evicted in between appears in neither)."""
        stored, removed = list(self._stored), list(self._removed)
        self._stored.clear()
        self._removed.clear()
        return stored, removed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights); False, doing nothing, while any
        block is in use, because a running sequence's hashed blocks cannot be un-shared."""
        if len(self.free_block_ids) != self.num_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None:
                self._evict(block)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} on the free list with ref_count {block.ref_count}"
        if block.block_hash is not None:
            self._evict(block)  # its contents are about to be overwritten
        block.ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        """Drop a free block's cached prefix."""
        assert block.block_hash is not None and block.ref_count == 0
        del self.hash_to_block[block.block_hash]
        self._note(block.block_hash, stored=False)
        self._num_cached_free -= 1
        block.block_hash = block.token_ids = block.parent_hash = None

    def _note(self, block_hash: int, stored: bool) -> None:
        # A store cancels a pending removal of the same hash and vice versa: only net changes count.
        undo, record = (self._removed, self._stored) if stored else (self._stored, self._removed)
        if block_hash in undo:
            del undo[block_hash]
        else:
            record[block_hash] = None
