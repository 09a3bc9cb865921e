"""The paged prefill attention kernel alone: its time per layer and the rate it computes at, over tiles.

    python benchmarks/prefill_attention.py [--cases 8x1024 1x8192 8x512+1536] [--baseline OLD.py]

For each case ``BxQ`` or ``BxQ+C`` (B sequences of Q query tokens each, after C tokens already
cached; blocks scattered over a pool laid out as the engine's, every layer of a block side by side)
it times ``triton_paged_attention`` for one layer (device time: calls replayed from a CUDA graph),
first with the engine's own tile (``prefill_tile``), then over ``--block-m`` x ``--block-n`` x
``--warps`` x ``--stages`` x ``--pack`` (1: a GQA group's query heads share a tile and its K/V
loads). Each line gives microseconds per call and TFLOP/s of causal attention (4 FLOPs per query
head, head dimension and visible key), against the dense bf16 matmul rate
measured in the same run. Two references: flash attention's varlen kernel as PyTorch ships it, over
the same K/V gathered contiguous (fresh prompts only: it takes no block table of 16-token blocks),
and ``--baseline``, an earlier version of ``shared/kvcache/triton_attention.py`` saved to a file
(``git show REV:shared/kvcache/triton_attention.py > OLD.py``) with its own tile. The last line per
case names the fastest tile. CUDA only (the kernel's correctness is
``tests/unit/kvcache/test_paged_attention.py``'s GPU tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math

import torch
from serving_gpu import matmul_tflops

from tandem.shared.infra.device_timing import graph_microseconds
from tandem.shared.kvcache.attention import build_attention_metadata
from tandem.shared.kvcache.triton_attention import prefill_tile, triton_paged_attention

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 32, 8, 32, 128, 16  # the 8B preset's attention


def parse_case(case: str) -> tuple[int, int, int]:
    """``BxQ`` or ``BxQ+C`` -> (sequences, query tokens, cached tokens)."""
    head, _, cached = case.partition("+")
    batch, query = (int(v) for v in head.split("x"))
    return batch, query, int(cached or 0)


def make_case(batch: int, query: int, cached: int, seed: int):  # noqa: ANN201 - a tuple of tensors and metadata
    context = cached + query
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(seed)
    kv = torch.empty((num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    kv.normal_()
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_seq)
    tables = order.tolist()
    meta = build_attention_metadata([query] * batch, [context] * batch, tables, BLOCK, "cuda")
    q = torch.randn(batch * query, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return q, kv, meta, order.cuda()


def causal_flops(batch: int, query: int, cached: int) -> int:
    visible = query * cached + query * (query + 1) // 2  # query row i sees cached + i + 1 keys
    return 4 * Q_HEADS * HEAD_DIM * visible * batch


def flash_varlen(q: torch.Tensor, kv: torch.Tensor, order: torch.Tensor, batch: int, query: int, scale: float):  # noqa: ANN201
    """A callable running PyTorch's flash varlen forward over layer 0's K/V gathered contiguous, or
    None where this PyTorch has no such kernel."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return None
    slots = order.view(-1)
    k = kv[slots, 0, 0].reshape(batch * query, KV_HEADS, HEAD_DIM).contiguous()
    v = kv[slots, 0, 1].reshape(batch * query, KV_HEADS, HEAD_DIM).contiguous()
    starts = torch.arange(0, (batch + 1) * query, query, dtype=torch.int32, device="cuda")

    def run() -> torch.Tensor:
        return op(q, k, v, starts, starts, query, query, 0.0, True, False, scale=scale)[0]

    try:
        run()
    except Exception as exc:  # noqa: BLE001 - an older build without this signature: say so, go on
        print(json.dumps({"figure": "prefill_attention", "kernel": "flash_varlen",
                          "refused": str(exc).splitlines()[0][:160]}), flush=True)
        return None
    return run


def load_baseline(path: str):  # noqa: ANN201 - the module's triton_paged_attention
    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.triton_paged_attention


def sweep_case(args: argparse.Namespace, case: str, peak: float) -> None:
    batch, query, cached = parse_case(case)
    q, kv, meta, order = make_case(batch, query, cached, 0)
    scale = HEAD_DIM ** -0.5
    flops = causal_flops(batch, query, cached)

    def emit(label: dict, us: float, diff: float | None = None) -> dict:
        tflops = flops / (us * 1e-6) / 1e12
        record = {"figure": "prefill_attention", "case": case, **label, "us": round(us, 1),
                  "tflops": round(tflops, 1), "of_matmul_peak": round(tflops / peak, 3)}
        if diff is not None:
            record["max_abs_diff"] = round(diff, 5)
        print(json.dumps(record), flush=True)
        return record

    def time_us(fn) -> float:  # noqa: ANN001
        return graph_microseconds(fn, args.iters, replays=3)

    reference = triton_paged_attention(q, kv, 0, meta, scale).float()
    default = emit({"kernel": "triton", "tile": prefill_tile(query, HEAD_DIM, False)},
                   time_us(lambda: triton_paged_attention(q, kv, 0, meta, scale)))
    if cached == 0 and query % BLOCK == 0 and (flash := flash_varlen(q, kv, order, batch, query, scale)) is not None:
        emit({"kernel": "flash_varlen"}, time_us(flash), (flash().float() - reference).abs().max().item())
    if args.baseline:
        baseline = load_baseline(args.baseline)
        emit({"kernel": "baseline"}, time_us(lambda: baseline(q, kv, 0, meta, scale)),
             (baseline(q, kv, 0, meta, scale).float() - reference).abs().max().item())
    results = [default]
    for block_m, block_n, warps, stages, pack in itertools.product(args.block_m, args.block_n, args.warps,
                                                                   args.stages, args.pack):
        tile = {"block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                "pack_heads": bool(pack)}
        try:
            out = triton_paged_attention(q, kv, 0, meta, scale, **tile).float()
        except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses (shared memory): say so, go on
            print(json.dumps({"figure": "prefill_attention", "case": case, **tile,
                              "refused": str(exc).splitlines()[0][:160]}), flush=True)
            continue
        diff = (out - reference).abs().max().item()
        results.append(emit({"kernel": "triton", "tile": tile}, time_us(
            lambda tile=tile: triton_paged_attention(q, kv, 0, meta, scale, **tile)), diff))
    best = min(results, key=lambda r: r["us"])
    print(json.dumps({"figure": "prefill_attention_best", "case": case, "default_us": default["us"],
                      "best": best, "speedup": round(default["us"] / best["us"], 3)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["8x1024", "1x8192", "8x512+1536"])
    parser.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--pack", type=int, nargs="+", default=[0, 1], help="1: pack a GQA group's heads in a tile")
    parser.add_argument("--baseline", default=None, help="an earlier triton_attention.py to time beside this one")
    parser.add_argument("--iters", type=int, default=10, help="calls per captured graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention.py times a CUDA kernel: run it on a GPU")
    peak = matmul_tflops(torch.device("cuda"))
    print(json.dumps({"figure": "matmul_peak", "tflops": round(peak, 1),
                      "device": torch.cuda.get_device_name()}), flush=True)
    for case in args.cases:
        sweep_case(args, case, peak)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
