"""The paged KV-cache tensor: allocation, sizing, and whole-block export/import.

Layout: one tensor ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(index 0 of dim 2 is K, 1 is V). Block-major so that one block's K/V for *all* layers is one
contiguous chunk: handing a prompt's KV from a prefill worker to a decode worker is one
``index_select`` on the sender and one ``index_copy_`` on the receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.shared.kvtransfer.devcopy import host_values_to

if TYPE_CHECKING:
    from tandem.shared.infra.config import EngineSettings


class CacheShape(Protocol):
    """What the KV pool needs of a model's shape (a ModelConfig has it): the cache sits below the
    model layer, so it names the fields rather than importing the model's config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

ACTIVATION_HEADROOM = 1 << 30  # GPU bytes left free for activations and the allocator's slack


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


def size_kv_pool(settings: EngineSettings, cfg: CacheShape, device: torch.device, dtype: torch.dtype,
                 reserved_bytes: int = 0) -> int:
    """Blocks for the KV pool (``settings`` is the engine section; ``cfg`` the shape this process holds,
    one rank's share under tensor parallelism): as configured, else from a memory budget.

    On CUDA ``gpu_memory_utilization`` is this worker's share of the device's total memory, weights
    included (as in vLLM), so workers sharing a GPU each take their own share and never race for
    "free" memory; on CPU the budget is ``kv_cache_mib``. ``reserved_bytes``: device memory allocated
    after the pool that the share must leave (LoRA adapter slots)."""
    if settings.num_blocks:
        return settings.num_blocks
    per_block = kv_cache_bytes_per_block(
        cfg.num_layers, settings.block_size, cfg.num_kv_heads, cfg.head_dim, dtype
    )
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        share = int(total * settings.gpu_memory_utilization) - torch.cuda.memory_allocated(device) - reserved_bytes
        budget = min(share, free - ACTIVATION_HEADROOM)
    else:
        budget = settings.kv_cache_mib * 1024 * 1024
    if budget < per_block:
        raise RuntimeError(
            f"no memory left for a KV cache on {device} (budget {budget / 2**30:.2f} GiB, one block "
            f"{per_block / 2**20:.2f} MiB): raise --gpu-memory-utilization or set --num-blocks"
        )
    return budget // per_block


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
