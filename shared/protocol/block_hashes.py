"""Chained block hashes: how every process names a block of KV by the tokens it covers.

A block's hash covers its own tokens and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes. Routers, prefill and decode workers and KV-stores all name blocks this way
(KV events, KV-store lookups), so the hash must be the same in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one block: blake2b (8 bytes) over the parent hash and int32 token bytes.

    Stable across processes and machines (unlike ``hash()``), so prefill and decode workers agree.
    The parent is its 8 little-endian bytes, or 8 zero bytes for the first block.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(bytes(8) if parent_hash is None else parent_hash.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(digest.digest(), "little")


def prefix_hashes(token_ids: Sequence[int], block_size: int, root: int | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, as a block manager assigns them: what
    routers, prefill workers and KV-stores use to name a prompt's blocks. ``root``: the first block's
    parent (a LoRA adapter's, ``adapters.adapter_hash_root``; None for the base model)."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
