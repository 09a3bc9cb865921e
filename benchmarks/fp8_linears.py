"""The 8B preset's decoder linears at decode batch sizes: bf16 against fp8 weights, each path alone.

    python benchmarks/fp8_linears.py [--rows 1 4 16 32]

For each projection shape (the fused qkv and gate/up, o, down) and row count it times, on the
device (calls replayed from a CUDA graph, cycling through enough copies of the weights to pass the
L2 cache, as a forward over distinct layers does): ``F.linear`` over bf16 weights (cuBLAS), the
fp8 ``torch._scaled_mm`` path (activation quantization kernel plus cuBLASLt's fp8 GEMM, rows padded
to 16), and, up to 16 rows, the weight-only few-row Triton kernel (``shared/model/fp8_few_rows.py``)
with the tile it tunes for the shape; and the same kernel over the bf16 weights (no scale to
speak of: ones), with the fastest of its tiles, to see whether cuBLAS leaves bandwidth on the table
at batch 1 too. Each line: microseconds per call and the weight bytes read
per second, against the HBM read rate measured in the same run; a summary line per row count
gives the four projections' sum per layer for each path and the fp8 paths over bf16. CUDA with
compute capability 8.9 or later only (correctness: ``tests/gpu/test_fp8_gpu.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

import torch
import torch.nn.functional as F

from tandem.shared.infra.device_timing import graph_microseconds
from tandem.shared.model import fp8_few_rows
from tandem.shared.model.fp8 import Fp8Linear, quantize_weight, scaled_mm_plan

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # [N, K]
COPY_BYTES = 512 << 20  # weights cycled through per timing, ten times the L2


def hbm_read_gbps() -> float:
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    micros = graph_microseconds(lambda: x.sum(dtype=torch.float32), 5)
    return x.numel() * 2 / (micros * 1e-6) / 1e9


def time_path(layers: list, x: torch.Tensor) -> float:
    """Device microseconds per call, averaged over one pass through ``layers``."""

    def calls() -> None:
        for layer in layers:
            layer(x)

    return graph_microseconds(calls, 2) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="# %(message)s")  # the tiles each shape's tuning chose
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_linears.py needs a CUDA GPU of compute capability 8.9 or later")
    plan, reason = scaled_mm_plan(torch.device("cuda"), torch.bfloat16)
    if plan is None:
        raise SystemExit(f"torch._scaled_mm is not available here: {reason}")
    gbps = hbm_read_gbps()
    print(json.dumps({"figure": "hbm_read", "GB_s": round(gbps)}), flush=True)
    totals: dict[int, dict[str, float]] = {}
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-COPY_BYTES // (n * k * 2)))
        weights = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        paths = {"bf16": [lambda x, w=w: F.linear(x, w) for w in weights]}
        scaled, few = [], []
        for w in weights:
            codes, scale = quantize_weight(w)
            for plan_here, into in ((dataclasses.replace(plan, few_rows=False), scaled), (plan, few)):
                layer = Fp8Linear(codes, scale)
                layer.plan = plan_here
                into.append(layer)
        paths["fp8_scaled_mm"], paths["fp8_few_rows"] = scaled, few
        fp8_few_rows.tune(n, k, torch.bfloat16, torch.device("cuda"))
        ones = torch.ones(n, device="cuda")
        bf16_tiles = {tile: [lambda x, w=w, t=tile, s=ones: fp8_few_rows.multiply(x, w, s, tile=t) for w in weights]
                      for tile in fp8_few_rows.CANDIDATES if tile.fits(n, k, fp8_few_rows.MAX_ROWS) or tile.fits(n, k)}
        for rows in args.rows:
            x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16)
            if rows <= fp8_few_rows.MAX_ROWS and bf16_tiles:
                timed = {tile: time_path(layers, x) for tile, layers in bf16_tiles.items() if tile.fits(n, k, rows)}
                best = min(timed, key=timed.get)
                paths["bf16_triton"] = bf16_tiles[best]
                print(json.dumps({"figure": "bf16_triton_tile", "shape": name, "rows": rows,
                                  **dataclasses.asdict(best)}), flush=True)
            for path, layers in paths.items():
                if path in ("fp8_few_rows", "bf16_triton") and rows > fp8_few_rows.MAX_ROWS:
                    continue
                micros = time_path(layers, x)
                weight_bytes = n * k * (2 if path.startswith("bf16") else 1)
                rate = weight_bytes / (micros * 1e-6) / 1e9
                totals.setdefault(rows, {}).setdefault(path, 0.0)
                totals[rows][path] += micros
                print(json.dumps({"figure": "linear", "shape": name, "n": n, "k": k, "rows": rows, "path": path,
                                  "us": round(micros, 2), "weight_GB_s": round(rate), "of_hbm": round(rate / gbps, 3)}),
                      flush=True)
        paths.clear()
        bf16_tiles.clear()
        del scaled, few, weights
        torch.cuda.empty_cache()
    for rows, by_path in totals.items():
        bf16 = by_path["bf16"]
        times = {f"{p}_us": round(v, 1) for p, v in by_path.items()}
        speedups = {f"{p}_over_bf16": round(bf16 / v, 3) for p, v in by_path.items() if p != "bf16"}
        print(json.dumps({"figure": "layer_linears", "rows": rows, **times, **speedups}), flush=True)


if __name__ == "__main__":
    main()
