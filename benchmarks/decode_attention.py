"""The split-K decode attention kernel alone: its time per layer and its K/V read rate, over tiles.

    python benchmarks/decode_attention.py [--cases 256x1088 32x1088 1x576] [--graph-bound 2048]

For each case ``BxC`` (B sequences, every one with C cached tokens, blocks scattered over a pool laid
out as the engine's: every layer of a block side by side, so a layer's K/V are strided as in
serving) it times ``triton_decode_attention`` for one layer (device time: calls replayed from a
CUDA graph, as decode runs), first with the engine's own tile choice, then over ``--block-n`` x
``--warps`` x ``--stages`` x ``--partitions``, with the grid sized by ``--graph-bound`` (what a
CUDA graph captured for the longest context sizes it to) and by
C itself. Each line gives microseconds per call and GB/s of K/V read, against the HBM read rate
measured in the same run; the last line per case names the fastest tile. CUDA only (the kernel's
correctness is ``tests/gpu/test_fast_decode.py``'s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from tandem.shared.infra.device_timing import graph_microseconds
from tandem.shared.kvcache.triton_decode import choose_partition, triton_decode_attention

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 32, 8, 32, 128, 16  # the 8B preset's attention


def hbm_read_gbps() -> float:
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    return x.numel() * 2 / (graph_microseconds(lambda: x.sum(dtype=torch.float32), 10, replays=3) * 1e-6) / 1e9


def make_case(batch: int, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(seed)
    kv = torch.empty((num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    kv.normal_(generator=None)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # scattered, as a busy pool's blocks are
    tables = order.view(batch, blocks_per_seq).to(torch.int32).cuda()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return q, kv, tables, lens


def sweep_case(args: argparse.Namespace, batch: int, context: int, gbps: float, sms: int) -> None:
    q, kv, tables, lens = make_case(batch, context, 0)
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2  # K and V of one layer, bf16
    scale = HEAD_DIM ** -0.5

    def run(bound: int, partition: int | None = None, **tile) -> float:
        return graph_microseconds(
            lambda: triton_decode_attention(q, kv, 0, tables, lens, bound, scale, partition, **tile), args.iters,
            replays=3)

    def emit(label: dict, us: float) -> dict:
        rate = kv_bytes / (us * 1e-6) / 1e9
        record = {"figure": "decode_attention", "batch": batch, "context": context, **label, "us": round(us, 1),
                  "GBps": round(rate, 1), "of_hbm": round(rate / gbps, 3)}
        print(json.dumps(record), flush=True)
        return record

    reference = triton_decode_attention(q, kv, 0, tables, lens, args.graph_bound, scale).float()
    default_us = run(args.graph_bound)
    emit({"tile": "engine default", "bound": args.graph_bound,
          "partition": choose_partition(batch, KV_HEADS, args.graph_bound, sms)}, default_us)
    results = []
    for bound in sorted({args.graph_bound, context}):
        for block_n, warps, stages, partition in itertools.product(args.block_n, args.warps, args.stages,
                                                                   args.partitions):
            part = partition or choose_partition(batch, KV_HEADS, bound, sms)
            if block_n > part:
                continue
            tile = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            try:
                out = triton_decode_attention(q, kv, 0, tables, lens, bound, scale, part, **tile).float()
            except Exception as exc:  # a tile the compiler refuses (shared memory): say so, go on
                print(json.dumps({"figure": "decode_attention", "batch": batch, "bound": bound, **tile,
                                  "partition": part, "refused": str(exc).splitlines()[0][:160]}), flush=True)
                continue
            err = (out - reference).abs().max().item()
            results.append(emit({"bound": bound, "partition": part, **tile, "max_abs_diff": round(err, 5)},
                                run(bound, part, **tile)))
    best = min(results, key=lambda r: r["us"])
    print(json.dumps({"figure": "decode_attention_best", "batch": batch, "context": context,
                      "default_us": round(default_us, 1), "best": best,
                      "speedup": round(default_us / best["us"], 3)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["256x1088", "32x1088", "1x576"])
    parser.add_argument("--graph-bound", type=int, default=2048, help="the grid's context bound under a CUDA graph")
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--partitions", type=int, nargs="+", default=[0, 256, 512, 1024],
                        help="keys per split; 0: the engine's choose_partition")
    parser.add_argument("--iters", type=int, default=20, help="calls per captured graph")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py times a CUDA kernel: run it on a GPU")
    gbps = hbm_read_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(json.dumps({"figure": "hbm", "hbm_read_GBps": round(gbps, 1), "sms": sms}), flush=True)
    for case in args.cases:
        batch, context = (int(v) for v in case.split("x"))
        sweep_case(args, batch, context, gbps, sms)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
