"""The whole disaggregated system under load: ``tandem up`` on this machine, then ``tandem bench serve``.

    python benchmarks/serving_system.py [--model random:llama3-8b] [--concurrency 1 32 128 256]
                                        [--placements auto disaggregated] [--out-dir DIR]

First runs the in-process engine on the same workload (``benchmarks/serving_gpu.py``, its own
process): ``--in-process-batch`` requests submitted at once (the issue-19 baseline: TPOT with every
prefill done before the decode steps) and, with ``--in-process-closed``, the same closed loop as
``tandem bench serve`` at each concurrency (like for like: other requests' prefills land in a
request's decode steps there too). Then, for each placement, starts ``tandem up`` (NATS, a KV-store,
router, workers): ``auto`` lets ``up`` choose from the devices (on one GPU: no prefill worker, the
decode worker prefills itself), ``disaggregated`` asks for ``--prefill 1`` (on one GPU both
processes share it). It prints ``up``'s placement line, waits until ready, then for each max
concurrency sends random 1024-token prompts for 128 output tokens (``ignore_eos``) and prints one
JSON line of what the clients saw: output tokens/s, TTFT and TPOT p50/p99, and their ratios to the
in-process figures of the same run, and the router's decisions' reasons, counted. Also prints the
compute ceiling of that workload on the GPUs present (every prompt token costs 2 x params FLOPs;
measured bf16 matmul peak), which bounds output tokens/s whatever the serving stack. Without CUDA it
runs the tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from serving_gpu import matmul_tflops  # this folder's script: the same peak the serving rows use
from up_child import tandem_up


def in_process(model: str, batch: int, closed: list[int]) -> dict[str, dict]:
    """The engine alone on the same workload, in its own process (its GPU memory is freed before
    the system starts): {"batch": the all-at-once record, "closed<C>": the closed loop's at C}."""
    script = Path(__file__).with_name("serving_gpu.py")
    parts = ",".join(p for p, on in (("throughput", batch), ("closed", closed)) if on)
    cmd = [sys.executable, str(script), "--model", model, "--parts", parts, "--batches", str(batch or 32),
           "--max-num-seqs", "256"]
    if closed:
        cmd += ["--closed", *map(str, closed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    records: dict[str, dict] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            key = "batch" if record["figure"] == "throughput" else f"closed{record['concurrency']}"
            records[key] = {**record, "figure": f"in_process_{record['figure']}"}
            print(json.dumps(records[key]), flush=True)
    return records


async def count_reasons(url: str, data_dir: Path, seconds: float, into: Counter) -> None:
    """Count the router's decisions by reason (numbers blanked, so one kind of reason is one line)."""
    import nats

    from tandem.client.access import bus_options
    from tandem.shared.protocol import subjects
    from tandem.shared.protocol.codec import decode
    from tandem.shared.protocol.fleet import RoutingDecision

    # The operator's identity from up's state file: it may read the router's decisions.
    nc = await nats.connect(url, **bus_options("operator", "serving-system-bench", url, data_dir=data_dir))

    async def on_decision(msg) -> None:
        reason = decode(msg.data, RoutingDecision).reason
        into[re.sub(r"\d+", "N", reason)] += 1

    await nc.subscribe(subjects.ROUTER_DECISIONS, cb=on_decision)
    await asyncio.sleep(seconds)
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--prompts-per-level", type=int, default=0, help="default: max(16, 2 x concurrency)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--placements", nargs="+", default=["auto"], choices=["auto", "disaggregated"],
                        help="tandem up's placement, one system run each: auto (up decides from the devices) or "
                             "disaggregated (--prefill 1)")
    parser.add_argument("--kvstore", type=int, default=1,
                        help="KV-stores tandem up runs (0: none, so no worker offers its blocks to one)")
    parser.add_argument("--in-process-batch", type=int, default=32,
                        help="first, the in-process engine at this batch (same prompts' shape), for TPOT; 0: skip")
    parser.add_argument("--in-process-closed", action=argparse.BooleanOptionalAction, default=True,
                        help="also the in-process engine under the same closed loop at each concurrency (CUDA)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    model = args.model or ("random:llama3-8b" if cuda else "tiny")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cuda:
        gpus = torch.cuda.device_count()
        tflops = matmul_tflops(torch.device("cuda"))
        from tandem.shared.model.meta import load_model_meta
        from tandem.shared.train.layout import count_parameters

        cfg = load_model_meta(model).config
        # Every parameter costs 2 FLOPs per token but an untied input embedding (a lookup, not a matmul).
        params = count_parameters(cfg) - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
        flops_per_request = 2 * params * (args.input_len + args.output_len)
        ceiling = gpus * tflops * 1e12 / flops_per_request * args.output_len
        print(json.dumps({"figure": "compute_ceiling", "gpus": gpus, "bf16_matmul_tflops": round(tflops),
                          "output_tok_s_at_100pct_mfu": round(ceiling)}), flush=True)
        torch.cuda.empty_cache()
    baseline: dict[str, dict] = {}
    closed = args.concurrency if cuda and args.in_process_closed else []
    if cuda and (args.in_process_batch or closed):
        baseline = in_process(model, args.in_process_batch, closed)
    for placement in args.placements:
        run_system(args, model, placement, out_dir / placement, baseline)


def run_system(args: argparse.Namespace, model: str, placement: str, out_dir: Path,
               baseline: dict[str, dict]) -> None:
    """One ``tandem up`` with ``placement``, every concurrency level against it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = out_dir / "data"
    env = {**os.environ, "TANDEM_DATA_DIR": str(data_dir), "PYTHONSAFEPATH": "1"}  # bench serve's (see up_child)
    up_args = ["--model", model, "--no-planner", "--http-port", "0", "--decode", "1", "--kvstore", str(args.kvstore),
               "--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]
    if placement == "disaggregated":
        up_args += ["--prefill", "1"]
    said: list[str] = []

    def on_line(line: str) -> None:
        if line.startswith("tandem up: placement:"):
            print(json.dumps({"figure": "placement", "placement": placement,
                              "up_says": line.removeprefix("tandem up: ").strip()}), flush=True)
        said.append(line)

    with tandem_up(up_args, data_dir, out_dir / "up.log", on_line) as url:
        print(f"# system up at {url} ({placement}): {said[-1].strip()}", flush=True)
        batch = baseline.get("batch", {})
        for concurrency in args.concurrency:
            n = args.prompts_per_level or max(16, 2 * concurrency)
            result_file = out_dir / f"bench_c{concurrency}.json"
            reasons: Counter = Counter()
            bench = subprocess.Popen([sys.executable, "-m", "tandem", "bench", "serve", "--nats-url", url,
                                      "--dataset-name", "random", "--input-len", str(args.input_len),
                                      "--output-len", str(args.output_len), "--num-prompts", str(n),
                                      "--max-concurrency", str(concurrency), "--num-warmups", "4", "--no-progress",
                                      "--json-out", str(result_file)], env=env, stdout=subprocess.DEVNULL)
            asyncio.run(watch_reasons(url, data_dir, bench, reasons))
            if bench.returncode:
                raise SystemExit(f"tandem bench serve exited with code {bench.returncode}")
            summary = json.loads(result_file.read_text()).get("summary", {})
            keep = {k: summary.get(k) for k in ("completed", "failed", "duration_s", "output_throughput", "ttft_ms",
                                                "tpot_ms")}
            record = {"figure": "system", "placement": placement, "kvstores": args.kvstore, "concurrency": concurrency,
                      "requests": n, **keep}
            tpot = (summary.get("tpot_ms") or {}).get("median")
            rate = summary.get("output_throughput")
            if batch.get("tpot_p50_ms") and tpot:  # issue 19's ratio: against every prefill done up front
                record["tpot_p50_over_in_process_batch"] = round(tpot / batch["tpot_p50_ms"], 3)
            if batch.get("output_tok_s") and rate:
                record["throughput_over_in_process_batch"] = round(rate / batch["output_tok_s"], 3)
            same = baseline.get(f"closed{concurrency}", {})
            if same.get("tpot_p50_ms") and tpot:  # like for like: the same closed loop, in process
                record["tpot_p50_over_in_process_closed"] = round(tpot / same["tpot_p50_ms"], 3)
            if same.get("output_tok_s") and rate:
                record["throughput_over_in_process_closed"] = round(rate / same["output_tok_s"], 3)
            record["router_reasons"] = dict(reasons)
            print(json.dumps(record), flush=True)


async def watch_reasons(url: str, data_dir: Path, bench: subprocess.Popen, into: Counter) -> None:
    """Count the router's decisions by reason while ``bench`` runs."""
    listener = asyncio.create_task(count_reasons(url, data_dir, 1e9, into))
    while bench.poll() is None:
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)  # the last decisions are in flight
    listener.cancel()
    try:
        await listener
    except asyncio.CancelledError:
        pass


if __name__ == "__main__":
    main()
