"""The paged KV-cache tensor: allocation, sizing, and whole-block export/import.

Layout: one tensor ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(index 0 of dim 2 is K, 1 is V). Block-major so that one block's K/V for *all* layers is one
contiguous chunk: handing a prompt's KV from a prefill worker to a decode worker is one
``index_select`` on the sender and one ``index_copy_`` on the receiver.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.shared.infra.devcopy import host_values_to


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Zero-filled cache (zeros, not empty: masked-out slots are then finite, never NaN)."""
    return torch.zeros(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block occupies (K and V, every layer)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_memory(
    bytes_budget: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """How many whole blocks fit in ``bytes_budget`` bytes."""
    per_block = kv_cache_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    return max(0, int(bytes_budget) // per_block)


def _block_index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.long)
    return host_values_to(torch.device(device), list(block_ids), torch.long)  # never waits for the engine


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Copy the given blocks out: ``[n, num_layers, 2, block_size, H, D]``, contiguous, same device.

    The caller moves the result to CPU (``.cpu()``) for export; one ``index_select`` gathers all.
    """
    return kv_cache.index_select(0, _block_index(block_ids, kv_cache.device))


def scatter_blocks(
    kv_cache: torch.Tensor, block_ids: Sequence[int] | torch.Tensor, blocks: torch.Tensor
) -> None:
    """Write ``blocks`` (as produced by ``gather_blocks``, any device/dtype) into the given blocks."""
    index = _block_index(block_ids, kv_cache.device)
    if blocks.shape[0] != index.numel() or blocks.shape[1:] != kv_cache.shape[1:]:
        raise ValueError(
            f"blocks of shape {tuple(blocks.shape)} do not fit {index.numel()} blocks of "
            f"cache shape {tuple(kv_cache.shape[1:])}"
        )
    kv_cache.index_copy_(0, index, blocks.to(device=kv_cache.device, dtype=kv_cache.dtype))


def kv_namespace(model: str, dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int,
                 block_size: int) -> str:
    """Name of a KV layout: two blocks with the same chained hash are interchangeable only when
    model, dtype and layout agree, so caches, stores and the router key blocks by this too.
    ``model`` names the weights as well (``<name>@<weights id or version>``)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{model}/{dtype_name}/L{num_layers}xH{num_kv_heads}xD{head_dim}/bs{block_size}"
