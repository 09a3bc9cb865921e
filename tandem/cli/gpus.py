"""Which GPU each worker of ``tandem up`` gets, how much of it, and how many prefill workers pay.

Placement (:func:`plan_placement`), from the devices ``up`` sees. On one GPU a separate prefill
process only time-slices the device with decode, with a second copy of the weights and a KV hand-off
on top: ``up`` starts no prefill worker there, and the decode workers prefill themselves, chunked
into their decode steps, with the whole memory share. ``benchmarks/serving_system.py --placements
auto disaggregated`` compares the two on one GPU: at high concurrency this placement gives more output
throughput and a shorter TTFT for a longer TPOT (prefill is no longer starved by the time-slicing); at
low concurrency a shorter TPOT at equal throughput, for a longer TTFT (a burst's prompts wait for
their chunks in the decode steps). An explicit
``--prefill N`` is honoured (the hand-off path, or this comparison, is what the user asked for), and
the router is told to use those workers although they share the device
(``--router-prefill-on-shared-device``); the planner may then add prefill workers, otherwise not.
With two GPUs or more, one prefill worker by default on a GPU of its own, where disaggregation pays:
the router (services/router/policy.py) hands it every prompt with more than
``--local-prefill-max-tokens`` uncached tokens, unless it shares the decode worker's device. On CPU
the workers get disjoint thread pools (``Supervisor.worker_threads``), not one device: one prefill
worker by default, as before.

One GPU (or none): every worker sees it; decode workers share three quarters of
``gpu_memory_utilization`` and prefill workers a quarter (decode holds the long-lived KV cache),
split over the maximum count of each kind when the planner may add workers, so a worker started
later still finds its share free.

Tensor-parallel workers (``--prefill-tensor-parallel-size``, ``--decode-tensor-parallel-size``, both
defaulting to ``--tensor-parallel-size``): a worker of k ranks gets k GPUs, the k least occupied
(counting ranks), and the counts above are of ranks, not workers. A layout wider than the visible
GPUs is refused in one line; on CPU the ranks are gloo processes sharing the cores.

Several GPUs: each worker gets one through ``CUDA_VISIBLE_DEVICES``: the first decode worker GPU 0,
the first prefill worker GPU 1, and every later one the GPU with the fewest workers (decode
preferring low indices, prefill starting from GPU 1). A worker alone on its GPU takes the whole
``gpu_memory_utilization``; where more workers than GPUs may run (counting the planner's maximum),
each takes ``gpu_memory_utilization / ceil(workers / GPUs)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


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


def pick_gpus(num_gpus: int, occupancy: list[int], service: str, count: int = 1) -> list[int]:
    """The ``count`` GPU indices (a tensor-parallel worker's ranks, in order) for a new ``service``
    worker, given how many ranks each GPU holds now: the least occupied, preferred ones first."""
    start = 1 % num_gpus if service == "prefill" else 0
    order = [(start + i) % num_gpus for i in range(num_gpus)]
    return sorted(sorted(order, key=lambda g: occupancy[g])[:count])  # a stable sort keeps the preferred of equals


def memory_share(utilization: float, service: str, num_gpus: int, prefill: int, decode: int) -> float:
    """One worker's (or one rank's) ``gpu_memory_utilization``: ``prefill``/``decode`` are the most
    ranks of each kind that may run at once (workers times their tensor-parallel size)."""
    if num_gpus >= 2:
        return utilization / max(1, math.ceil((prefill + decode) / num_gpus))
    if service == "prefill":
        return utilization * (0.25 if decode else 1.0) / max(1, prefill)
    return utilization * (0.75 if prefill else 1.0) / max(1, decode)


@dataclass(frozen=True)
class Placement:
    """How many workers of each kind ``tandem up`` starts on the devices it sees, and why."""

    prefill: int
    decode: int
    prefill_on_shared_device: bool  # the router's setting: use prefill workers sharing decode's device
    planner_max_prefill: int | None  # the planner's ceiling (None: as given, else Supervisor.limits')
    line: str  # "placement: ...", printed by up
    prefill_ranks: int = 1  # GPUs (tensor-parallel ranks) per prefill worker
    decode_ranks: int = 1


def _workers(count: int, kind: str, ranks: int = 1) -> str:
    return f"{count} {kind} worker{'' if count == 1 else 's'}" + (f" of {ranks} GPUs each" if ranks > 1 else "")


def _prefill_themselves(decode: int) -> str:
    return "the decode worker prefills itself" if decode == 1 else "the decode workers prefill themselves"


class PlacementError(ValueError):
    """A layout the devices cannot hold; the message is one line naming the flag."""


def plan_placement(num_gpus: int, prefill: int | None, decode: int, max_prefill: int | None = None,
                   prefill_ranks: int = 1, decode_ranks: int = 1) -> Placement:
    """The placement for ``num_gpus`` visible CUDA devices (0: CPU). ``prefill`` and ``max_prefill``
    (the planner's ceiling) as given, None where not given; ``decode`` as given; ``*_ranks``: each
    worker's tensor-parallel size (its GPUs)."""
    for kind, ranks in (("prefill", prefill_ranks), ("decode", decode_ranks)):
        if num_gpus and ranks > num_gpus:
            raise PlacementError(f"--{kind}-tensor-parallel-size {ranks}: a {kind} worker would span {ranks} GPUs, "
                                 f"and {num_gpus} {'is' if num_gpus == 1 else 'are'} visible")
    if num_gpus == 1:
        if not prefill and not max_prefill:
            return Placement(0, decode, False, 0,
                             f"placement: 1 GPU: {_prefill_themselves(decode)}, chunked into the decode steps (a "
                             "separate prefill process would share the device)", prefill_ranks, decode_ranks)
        count = prefill or 0
        asked = f"--prefill {prefill}" if prefill else f"--max-prefill {max_prefill}"
        return Placement(count, decode, True, max_prefill,
                         f"placement: 1 GPU shared by {_workers(count, 'prefill')} and {_workers(decode, 'decode')}, "
                         f"prefill remote as asked ({asked}): the processes time-slice the device (without it, "
                         "decode prefills itself)")
    count = 1 if prefill is None else prefill
    ranks = count * prefill_ranks + decode * decode_ranks
    if num_gpus == 0:
        where = "CPU, each worker its own share of the cores"
    elif ranks <= num_gpus:
        where = f"{num_gpus} GPUs, each worker its own"
    else:
        where = f"{num_gpus} GPUs for {ranks} ranks, some sharing one"
    if not count:
        how = _prefill_themselves(decode)
    else:
        how = "prompts with more than --local-prefill-max-tokens uncached tokens prefill remotely"
        if num_gpus and ranks > num_gpus:
            how += ", but not on a prefill worker sharing the decode worker's GPU"
    return Placement(count, decode, False, max_prefill,
                     f"placement: {where}: {_workers(count, 'prefill', prefill_ranks)} and "
                     f"{_workers(decode, 'decode', decode_ranks)}; {how}", prefill_ranks, decode_ranks)
