"""Which GPU each worker of ``tandem up`` gets, and how much of it.

One GPU (or none): every worker sees it; decode workers share three quarters of
``gpu_memory_utilization`` and prefill workers a quarter (decode holds the long-lived KV cache),
split over the maximum count of each kind when the planner may add workers, so a worker started
later still finds its share free.

Several GPUs: each worker gets one through ``CUDA_VISIBLE_DEVICES``: the first decode worker GPU 0,
the first prefill worker GPU 1, and every later one the GPU with the fewest workers (decode
preferring low indices, prefill starting from GPU 1). A worker alone on its GPU takes the whole
``gpu_memory_utilization``; where more workers than GPUs may run (counting the planner's maximum),
each takes ``gpu_memory_utilization / ceil(workers / GPUs)``.
"""

from __future__ import annotations

import math
import os


def visible_gpus(device: str) -> list[str]:
    """CUDA device ids this process may hand out (empty on CPU, or when a device is pinned by
    ``--device cuda:N``, which then applies to every worker as given)."""
    if device not in ("auto", "cuda"):
        return []
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return []
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def pick_gpu(num_gpus: int, occupancy: list[int], service: str) -> int:
    """The GPU index for a new ``service`` worker given how many workers each GPU has now."""
    start = 1 % num_gpus if service == "prefill" else 0
    order = [(start + i) % num_gpus for i in range(num_gpus)]
    return min(order, key=lambda g: occupancy[g])  # min keeps the first of equals: the preferred one


def memory_share(utilization: float, service: str, num_gpus: int, prefill: int, decode: int) -> float:
    """One worker's ``gpu_memory_utilization``: ``prefill``/``decode`` are the most workers of each
    kind that may run at once."""
    if num_gpus >= 2:
        return utilization / max(1, math.ceil((prefill + decode) / num_gpus))
    if service == "prefill":
        return utilization * (0.25 if decode else 1.0) / max(1, prefill)
    return utilization * (0.75 if prefill else 1.0) / max(1, decode)
