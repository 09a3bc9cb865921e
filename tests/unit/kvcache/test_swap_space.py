"""The host swap space's bookkeeping: sizing from GiB and block bytes, allocation all or nothing,
holders, free order; and the layout it shares with the device cache."""

from __future__ import annotations

import pytest
import torch

from tandem.shared.kvcache.cache import allocate_kv_cache, kv_cache_bytes_per_block
from tandem.shared.kvcache.swap_space import GIB, SwapSpace, num_swap_blocks


def test_sized_in_whole_blocks() -> None:
    per_block = kv_cache_bytes_per_block(4, 16, 4, 32, torch.float32)
    assert per_block == 65536
    assert num_swap_blocks(1.0, per_block) == GIB // per_block == 16384
    assert num_swap_blocks(0.0, per_block) == 0 and num_swap_blocks(per_block * 1.5 / GIB, per_block) == 1
    with pytest.raises(ValueError):
        num_swap_blocks(1.0, 0)
    assert SwapSpace.for_cache(0.0, 4, 16, 4, 32, torch.float32, "cpu") is None
    assert SwapSpace.for_cache(per_block / 2 / GIB, 4, 16, 4, 32, torch.float32, "cpu") is None, "not one block"
    space = SwapSpace.for_cache(3 * per_block / GIB, 4, 16, 4, 32, torch.bfloat16, "cpu")
    assert space.num_blocks == 6, "bfloat16 blocks are half the size"
    cache = allocate_kv_cache(2, 4, 16, 4, 32, torch.bfloat16, "cpu")
    assert space.kv.shape[1:] == cache.shape[1:] and space.kv.dtype == cache.dtype and not space.kv.is_pinned()


def test_allocate_free_and_holders() -> None:
    space = SwapSpace(4, (2, 3), torch.float32)
    a, b = object(), object()
    assert space.allocate(3, a) == [0, 1, 2] and space.num_free_blocks == 1 and space.usage == 0.75
    assert not space.can_allocate(2)
    with pytest.raises(ValueError):
        space.allocate(2, b)
    assert space.num_free_blocks == 1, "all or nothing"
    assert space.allocate(1, b) == [3] and space.blocks_of(a) == [0, 1, 2] and space.blocks_of(b) == [3]
    space.free([1, 0])
    assert space.blocks_of(a) == [2] and space.allocate(2, b) == [1, 0], "freed blocks go to the back, in order"
    with pytest.raises(ValueError, match="host block 1 freed while not held"):
        space.free([1, 1])  # the first one goes back, the second is not held any more
    space.free([2, 3, 0])
    assert space.num_free_blocks == 4 and not space.holders and space.usage == 0.0
    with pytest.raises(ValueError):
        SwapSpace(0, (1,), torch.float32)
