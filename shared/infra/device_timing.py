"""Device time of a small CUDA operation, free of the host's launch cost.

A Triton or small cuBLAS launch from Python costs more host time than the kernel takes on the
device, so timing it call by call measures Python. Here ``calls`` calls are captured in one CUDA
graph (as the engine runs decode) and the graph replayed: the events around the replays measure
the device alone. Used by the fp8 tile tuner at start-up and by the kernel benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_microseconds(fn: Callable[[], object], calls: int, replays: int = 1) -> float:
    """Device microseconds per call of ``fn``, which launches CUDA work on the current stream:
    one warm-up call (compiles), ``calls`` calls captured, one replay to warm the graph, then
    ``replays`` timed replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (calls * replays)
