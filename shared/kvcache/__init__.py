"""Paged KV cache: the block-major cache tensor, block bookkeeping and paged attention.

- ``cache``: ``allocate_kv_cache`` and whole-block export/import (``gather_blocks``/``scatter_blocks``)
  over the layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
- ``block_manager``: ``BlockManager`` (ref-counted blocks, free list, chained block hashes).
- ``attention``: ``AttentionMetadata`` and ``paged_attention`` (Triton on CUDA, gather + SDPA else).
"""

from .attention import (
    AttentionMetadata,
    build_attention_metadata,
    gather_paged_attention,
    paged_attention,
    write_kv_cache,
)
from .block_manager import Block, BlockManager, NoFreeBlocksError, hash_block
from .cache import (
    allocate_kv_cache,
    gather_blocks,
    kv_cache_bytes_per_block,
    num_blocks_for_memory,
    scatter_blocks,
)
from .triton_attention import HAS_TRITON

__all__ = [
    "HAS_TRITON",
    "AttentionMetadata",
    "Block",
    "BlockManager",
    "NoFreeBlocksError",
    "allocate_kv_cache",
    "build_attention_metadata",
    "gather_blocks",
    "gather_paged_attention",
    "hash_block",
    "kv_cache_bytes_per_block",
    "num_blocks_for_memory",
    "paged_attention",
    "scatter_blocks",
    "write_kv_cache",
]
