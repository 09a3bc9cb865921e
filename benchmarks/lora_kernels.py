"""What the multi-LoRA kernels add to a decode step: each projection group's base matmul against its
low-rank products, per group and per layer, at the 8B preset's shapes.

    python benchmarks/lora_kernels.py [--batches 1 32 256] [--rank 16] [--adapters 8] [--stack-slots 8]
                                      [--programs-per-sm 4] [--quick]

For each group (the fused q/k/v, o, the fused gate/up, down) and batch size B it times, on the device
(calls replayed from a CUDA graph, as decode runs; weights and adapter stacks cycled through enough
copies to pass the L2 cache, as a forward over distinct layers does):

* ``base``: ``F.linear`` of the group's bf16 weight (cuBLAS), what the step pays without adapters;
* ``bgmv_rows`` / ``bgmv_grouped``: ``triton_bgmv.add_bgmv`` with each ``method`` (a program per row;
  a program per slot and block of rows), and ``bgmv_auto``, the one ``"auto"`` picks at this B;
* ``gathered``: ``ops.add_gathered``, the torch reference that copies each row's A and B;
* ``sgmv``: ``triton_bgmv.add_sgmv`` over the same rows sorted by adapter (one run each), what a
  prefill chunk or a host-sorted batch would pay.

The B rows use ``--adapters`` distinct adapters (every one at B >= adapters, shuffled) out of a stack
of ``--stack-slots`` resident ones, rank ``--rank``. Each line is JSON: microseconds per call of
each path; a summary per group gives ``(base + lora) / base`` for each LoRA path, and one per batch
the four groups' sums (a layer's projections: the figure the decode step's overhead follows). The
group lines also give the distinct adapters' bytes (A and B) and the rate at which each BGMV path
moved them, to set against the HBM's.

On CUDA the shapes are the 8B preset's. Without CUDA (or with ``--quick``) it runs a tiny
configuration on the CPU: the Triton kernels under ``TRITON_INTERPRET=1`` (set here before Triton
is imported; when this process imported Triton already, only the torch paths run), wall-clock
times, so the script itself is tested; those figures measure nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first ``import triton``

from tandem.shared.infra.device_timing import graph_microseconds  # noqa: E402
from tandem.shared.lora import ops, triton_bgmv  # noqa: E402
from tandem.shared.lora.groups import LoraGroup, lora_groups  # noqa: E402
from tandem.shared.model.meta import PRESETS  # noqa: E402

COPY_BYTES = 512 << 20  # weights (and stacks) cycled through per timing, several times the L2
QUICK_GROUPS = {"qkv": (64, (64, 32, 32)), "o": (64, (64,)), "gate_up": (64, (96, 96)), "down": (96, (64,))}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def progress(message: str) -> None:
    print(f"[lora_kernels] {message}", file=sys.stderr, flush=True)


def groups_for(quick: bool) -> dict[str, LoraGroup]:
    if not quick:
        return lora_groups(PRESETS["llama3-8b"])
    return {name: LoraGroup(name, tuple(f"t{i}" for i in range(len(sizes))), in_features, sizes)
            for name, (in_features, sizes) in QUICK_GROUPS.items()}


def batch_slots(batch: int, adapters: int, stack_slots: int, generator: torch.Generator) -> list[int]:
    """Each row's slot: ``adapters`` distinct ones spread over the stack, every one used once the batch
    is large enough, in a shuffled order (decode rows arrive in no adapter order)."""
    used = torch.randperm(stack_slots, generator=generator)[:adapters].tolist()
    rows = [used[i % adapters] for i in range(batch)]
    order = torch.randperm(batch, generator=generator).tolist()
    return [rows[i] for i in order]


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Microseconds per call: device time from a CUDA graph on CUDA, wall time on the CPU."""
    if device.type == "cuda":
        return lambda fn: graph_microseconds(fn, repeats)

    def wall(fn: Callable[[], object]) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6

    return wall


def cycled(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of the next copy each time (the graph captures as many as there are copies)."""
    state = {"i": 0}

    def call() -> None:
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    return call


def time_group(group: LoraGroup, batch: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
               generator: torch.Generator) -> dict[str, float]:
    n, rank, k, out_features = len(group.out_sizes), args.rank, group.in_features, group.out_features
    copy_bytes = COPY_BYTES if device.type == "cuda" else 0
    weight_bytes = out_features * k * 2
    stack_bytes = args.stack_slots * (n * rank * k + out_features * rank) * 2
    weight_copies = max(2, -(-copy_bytes // weight_bytes))
    stack_copies = max(2, -(-copy_bytes // stack_bytes))
    weights = [torch.randn(out_features, k, device=device, dtype=dtype) * 0.02 for _ in range(weight_copies)]
    stacks = [(torch.randn(args.stack_slots, n * rank, k, device=device, dtype=dtype) * k ** -0.5,
               torch.randn(args.stack_slots, out_features, rank, device=device, dtype=dtype) * rank ** -0.5)
              for _ in range(stack_copies)]
    x = torch.randn(batch, k, device=device, dtype=dtype)
    out = torch.zeros(batch, out_features, device=device, dtype=dtype)
    slots_per_row = batch_slots(batch, min(args.adapters, args.stack_slots), args.stack_slots, generator)
    token_slots = torch.tensor(slots_per_row, dtype=torch.long, device=device)
    runs: list[list[int]] = []  # [slot, start, end] over the rows sorted by slot
    for row, slot in enumerate(sorted(slots_per_row)):
        if runs and runs[-1][0] == slot:
            runs[-1][2] = row + 1
        else:
            runs.append([slot, row, row + 1])
    seg_starts = torch.tensor([start for _, start, _ in runs] + [batch], dtype=torch.int32, device=device)
    seg_slots = torch.tensor([slot for slot, _, _ in runs], dtype=torch.long, device=device)
    longest = max(end - start for _, start, end in runs)
    measure = timer(device, args.repeats if device.type == "cpu" else max(weight_copies, stack_copies, 32))

    paths: dict[str, list[Callable[[], object]]] = {"base": [lambda w=w: F.linear(x, w) for w in weights]}
    if triton_bgmv.supports(x):
        for method in ("rows", "grouped"):
            paths[f"bgmv_{method}"] = [lambda a=a, b=b, m=method: triton_bgmv.add_bgmv(out, x, a, b, group, rank,
                                                                                      token_slots, method=m)
                                       for a, b in stacks]
        paths["sgmv"] = [lambda a=a, b=b: triton_bgmv.add_sgmv(out, x, a, b, group, rank, seg_starts, seg_slots,
                                                               max_segment_rows=longest) for a, b in stacks]
    paths["gathered"] = [lambda a=a, b=b: ops.add_gathered(out, x, a, b, group, rank, token_slots) for a, b in stacks]
    figures = {name: measure(cycled(calls)) for name, calls in paths.items()}
    if "bgmv_rows" in figures:
        auto = "grouped" if batch >= triton_bgmv.GROUPED_FROM_ROWS else "rows"
        figures["bgmv_auto"] = figures[f"bgmv_{auto}"]
    del weights, stacks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


def table(title: str, rows: dict[str, dict[str, float]]) -> None:
    paths = list(next(iter(rows.values())))
    lora = [p for p in paths if p != "base"]
    header = f"{title:<10}" + "".join(f"{p:>14}" for p in paths) + "".join(f"{'x ' + p:>16}" for p in lora)
    print(header)
    for name, figures in rows.items():
        base = figures["base"]
        cells = "".join(f"{figures[p]:>14.1f}" for p in paths)
        ratios = "".join(f"{(base + figures[p]) / base:>16.3f}" for p in lora)
        print(f"{name:<10}{cells}{ratios}")
    print(flush=True)


def main(argv: list[str] | None = None) -> dict[int, dict[str, dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (1 32 256)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8, help="distinct adapters in a batch")
    parser.add_argument("--stack-slots", type=int, default=8, help="adapters resident in the stack (grid of 'grouped')")
    parser.add_argument("--groups", nargs="+", default=None, help="a subset of qkv o gate_up down")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per path on the CPU")
    parser.add_argument("--programs-per-sm", type=float, default=None,
                        help="override triton_bgmv.PROGRAMS_PER_SM (how far shrinks split 'in'; low: no split, "
                             "no zeroed buffer for the atomic adds)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the CPU's configuration) on any device")
    args = parser.parse_args(argv)
    if args.programs_per_sm is not None:
        triton_bgmv.PROGRAMS_PER_SM = args.programs_per_sm
    quick = args.quick or not ON_CUDA
    device = torch.device("cuda" if ON_CUDA else "cpu")
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    batches = args.batches or ([1, 4] if quick else [1, 32, 256])
    groups = groups_for(quick)
    if args.groups:
        groups = {name: groups[name] for name in args.groups}
    if not triton_bgmv.supports(torch.zeros(1, device=device)):
        progress("the Triton kernels cannot run here (no Triton, or Triton imported before TRITON_INTERPRET=1): "
                 "timing the torch paths only")
    emit({"figure": "config", "device": torch.cuda.get_device_name() if ON_CUDA else "cpu", "quick": quick,
          "rank": args.rank, "adapters": args.adapters, "stack_slots": args.stack_slots,
          "grouped_from_rows": triton_bgmv.GROUPED_FROM_ROWS,
          "programs_per_sm": triton_bgmv.PROGRAMS_PER_SM})
    generator = torch.Generator().manual_seed(0)
    results: dict[int, dict[str, dict[str, float]]] = {}
    for batch in batches:
        per_group: dict[str, dict[str, float]] = {}
        for name, group in groups.items():
            progress(f"batch {batch}, {name}")
            figures = time_group(group, batch, args, device, dtype, generator)
            per_group[name] = figures
            base = figures["base"]
            # The distinct adapters' A and B, what a kernel that reads each once per call must move.
            adapter_bytes = (min(args.adapters, args.stack_slots, batch) * 2
                             * args.rank * (len(group.out_sizes) * group.in_features + group.out_features))
            emit({"figure": "group", "batch": batch, "group": name, "in": group.in_features,
                  "out": group.out_features, "adapter_MB": round(adapter_bytes / 1e6, 3),
                  **{f"{p}_us": round(v, 2) for p, v in figures.items()},
                  **{f"{p}_adapter_GB_s": round(adapter_bytes / (v * 1e3), 1) for p, v in figures.items()
                     if p.startswith("bgmv")},
                  **{f"{p}_ratio": round((base + v) / base, 3) for p, v in figures.items() if p != "base"}})
        layer = {path: sum(figures[path] for figures in per_group.values()) for path in next(iter(per_group.values()))}
        emit({"figure": "layer", "batch": batch, **{f"{p}_us": round(v, 2) for p, v in layer.items()},
              **{f"{p}_ratio": round((layer["base"] + v) / layer["base"], 3) for p, v in layer.items() if p != "base"}})
        table(f"B={batch} us", {**per_group, "layer": layer})
        results[batch] = {**per_group, "layer": layer}
    return results


if __name__ == "__main__":
    main()
