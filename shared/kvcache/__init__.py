"""Paged KV cache: the block-major cache tensor, block bookkeeping and paged attention.

- ``cache``: ``allocate_kv_cache`` and whole-block export/import (``gather_blocks``/``scatter_blocks``)
  over the layout ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
- ``block_manager``: ``BlockManager`` (ref-counted blocks, free list, chained block hashes).
- ``attention``: ``AttentionMetadata`` and ``paged_attention`` (Triton on CUDA, gather + SDPA else).
"""
