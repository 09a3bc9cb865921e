"""Decode speed of one engine spread over k devices (``--tensor-parallel-size k``) against one device.

    python benchmarks/tensor_parallel.py [--model random:llama3-8b] [--sizes 1 2] [--batches 1 32]

For each size k and batch B, in one run: B random 512-token prompts, 128 new tokens each, through
an engine whose model is split over k ranks (rank 0 in this process, ranks 1.. as follower
processes; ``shared/parallel``), and prints one JSON line with the decode phase's inter-token
latency and tokens/s, the ratio to k = 1 in the same run, and on CUDA the batch-1 roofline of k
GPUs: every rank reads its share of the weights per token, so k devices' HBM rates add up
(measured on GPU 0, times k). A greedy check rides along: the first ``--check-tokens`` tokens of
the first prompt on k ranks against one rank (rounding in the all-reduce may move a near tie).

First it times the command channel alone (``--command-rounds``): rank 0 streams that many
commands to the followers of the largest size and waits for them to be done, once through shared
memory (what workers use) and once over gloo (what they used before), on the tiny model.

On CUDA every size runs with decode CUDA graphs (captured on every rank in step) and without
(``enforce_eager``), each against one rank in the same mode. On CPU it runs ``random:llama-test``
over gloo processes so the script is tested; the CPU's ratios say nothing about GPUs (the ranks
share the same two cores, and a gloo all-reduce costs about 1.5 ms there).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from serving_gpu import greedy_tokens, hbm_read_gbps, make_engine, random_prompts, run_requests

from tandem.shared.engine.tp_ranks import RankJob, dismiss, lead
from tandem.shared.model.loader import load_model
from tandem.shared.parallel.sharding import sharder


def load(model: str, size: int, device: torch.device, threads: int, shared_memory_commands: bool = True):
    """The model on ``size`` ranks: (rank 0's loaded model, the followers or None, the group or None)."""
    if size == 1:
        return load_model(model, device=device), None, None
    job = RankJob(model=model, data_dir=None, dtype="auto", quantization="none", torch_threads=threads,
                  engine={"num_blocks": 1})
    group, followers = lead(job, size, device, shared_memory_commands)
    loaded = load_model(model, device=device, shard=sharder(group))
    group.min_over_ranks(1 << 40)  # the followers size their pools too; the engine sets its own below
    return loaded, followers, group


def release(loaded, engine, followers, group) -> None:
    if group is not None:
        dismiss(group, followers)
    del engine, loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def command_costs(size: int, device: torch.device, threads: int, rounds: int) -> None:
    """One JSON line: microseconds per command through shared memory and over gloo, same run."""
    record = {"figure": "tp_commands", "size": size, "device": device.type, "rounds": rounds}
    for channel, shared in (("shared_memory", True), ("gloo", False)):
        loaded, followers, group = load("tiny", size, device, threads, shared)
        started = time.perf_counter()
        for i in range(rounds):
            group.send_command(("ping", i == rounds - 1))  # a decode step's command is about this size
        group.min_over_ranks(0)  # the last one's reply: every follower has taken every command
        record[f"{channel}_us"] = round((time.perf_counter() - started) / rounds * 1e6, 1)
        release(loaded, None, followers, group)
    record["gloo_over_shared_memory"] = round(record["gloo_us"] / record["shared_memory_us"], 1)
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, random:llama-test on CPU")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--kv-gib", type=float, default=8.0)
    parser.add_argument("--command-rounds", type=int, default=2000, help="commands timed per channel (0: none)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("random:llama3-8b" if device.type == "cuda" else "random:llama-test")
    threads = 0 if device.type == "cuda" else max(1, torch.get_num_threads() // max(args.sizes))
    if device.type == "cpu":
        torch.set_num_threads(threads)
    gbps = hbm_read_gbps(device) if device.type == "cuda" else None
    kv_gib = args.kv_gib if device.type == "cuda" else 0.25
    if args.command_rounds and max(args.sizes) > 1:
        command_costs(max(args.sizes), device, threads, args.command_rounds)
    baseline: dict[tuple[int, bool], float] = {}  # (batch, eager) -> one rank's decode tok/s
    reference: list[int] | None = None
    weight_bytes = 0
    for size in args.sizes:
        loaded, followers, group = load(model, size, device, threads)
        if size == 1:
            weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        vocab = loaded.config.vocab_size
        engine = None
        for eager in ((False, True) if device.type == "cuda" else (True,)):
            if engine is not None:
                del engine
                gc.collect()
            engine = make_engine(loaded, device, max(args.batches), 2048, eager, kv_gib)
            check = greedy_tokens(engine, random_prompts(1, 512, vocab, 1)[0], args.check_tokens)
            if size == 1:
                reference = check
            for batch in args.batches:
                run_requests(engine, random_prompts(batch, 512, vocab, 3), 4, device)  # warm-up
                result = run_requests(engine, random_prompts(batch, 512, vocab, 10 + batch), args.new_tokens, device)
                record = {"figure": "tensor_parallel", "size": size, "batch": batch, "cuda_graphs": not eager,
                          "device": device.type, "itl_ms": result["itl_ms"], "decode_tok_s": result["decode_tok_s"],
                          "greedy_same_as_one_rank": check == reference}
                if size == 1:
                    baseline[(batch, eager)] = result["decode_tok_s"]
                if (batch, eager) in baseline and result["decode_tok_s"]:
                    record["over_one_rank"] = round(result["decode_tok_s"] / baseline[(batch, eager)], 3)
                if gbps and batch == 1 and result["decode_tok_s"]:
                    roofline = size * gbps * 1e9 / weight_bytes
                    record.update(roofline_tok_s=round(roofline, 1),
                                  of_roofline=round(result["decode_tok_s"] / roofline, 3))
                print(json.dumps(record), flush=True)
        release(loaded, engine, followers, group)


if __name__ == "__main__":
    main()
