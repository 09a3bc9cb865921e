"""The whole disaggregated system under load: ``tandem up`` on this machine, then ``tandem bench serve``.

    python benchmarks/serving_system.py [--model random:llama3-8b] [--concurrency 1 32 128 256]
                                        [--out-dir DIR]

First runs the in-process engine on the same workload at one batch size (``--in-process-batch``),
for the TPOT comparison. Then starts router, one prefill and one decode worker (on separate GPUs
when two are visible, otherwise sharing one), NATS and a KV-store, waits until ready, then for each
max concurrency sends random 1024-token prompts for 128 output tokens (``ignore_eos``) and prints
one JSON line of what the clients saw: output tokens/s, TTFT and TPOT p50/p99, and TPOT p50 over the
in-process engine's at ``--in-process-batch`` (same run). Also prints the compute ceiling of that
workload on the GPUs present (every prompt token costs 2 x params FLOPs; measured bf16 matmul peak),
which bounds output tokens/s whatever the serving stack. Without CUDA it runs the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from tandem.runstate import find_running


def matmul_tflops() -> float:
    """Dense bf16 8192^3 matmul rate of GPU 0 (the anchors' method)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (time.perf_counter() - start) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--prompts-per-level", type=int, default=0, help="default: max(16, 2 x concurrency)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--in-process-batch", type=int, default=32,
                        help="first, the in-process engine at this batch (same prompts' shape), for TPOT; 0: skip")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    model = args.model or ("random:llama3-8b" if cuda else "tiny")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cuda:
        gpus = torch.cuda.device_count()
        tflops = matmul_tflops()
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
    in_process_tpot = None
    if cuda and args.in_process_batch:
        # The same workload through the engine alone, in its own process (its GPU memory is freed
        # before the system starts): the full system's TPOT is compared with this one.
        script = Path(__file__).with_name("serving_gpu.py")
        out = subprocess.run([sys.executable, str(script), "--model", model, "--parts", "throughput",
                              "--batches", str(args.in_process_batch)], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                record = {**json.loads(line), "figure": "in_process"}
                in_process_tpot = record.get("tpot_p50_ms")
                print(json.dumps(record), flush=True)
    data_dir = out_dir / "data"
    env = {**os.environ, "TANDEM_DATA_DIR": str(data_dir)}
    up_args = [sys.executable, "-m", "tandem", "up", "--model", model, "--no-planner", "--http-port", "0",
               "--prefill", "1", "--decode", "1", "--max-model-len", "2048", "--max-num-seqs", "256",
               "--max-num-batched-tokens", "8192"]
    log = open(out_dir / "up.log", "w")
    up = subprocess.Popen(up_args, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        for line in up.stdout:  # once the ready line is out, the state file names the URLs
            if line.startswith("tandem up: NATS at"):
                url = find_running(data_dir).nats_url
                break
        else:
            raise SystemExit(f"tandem up exited before it was ready; see {out_dir / 'up.log'}")
        print(f"# system up at {url}", flush=True)
        for concurrency in args.concurrency:
            n = args.prompts_per_level or max(16, 2 * concurrency)
            result_file = out_dir / f"bench_c{concurrency}.json"
            subprocess.run([sys.executable, "-m", "tandem", "bench", "serve", "--nats-url", url,
                            "--dataset-name", "random", "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--num-prompts", str(n),
                            "--max-concurrency", str(concurrency), "--num-warmups", "4", "--no-progress",
                            "--json-out", str(result_file)], env=env, check=True, stdout=subprocess.DEVNULL)
            summary = json.loads(result_file.read_text()).get("summary", {})
            keep = {k: summary.get(k) for k in ("completed", "failed", "duration_s", "output_throughput", "ttft_ms",
                                                "tpot_ms")}
            record = {"figure": "system", "concurrency": concurrency, "requests": n, **keep}
            tpot = (summary.get("tpot_ms") or {}).get("median")
            if in_process_tpot and tpot:  # the bar: within 15% of the engine alone, same run
                record["tpot_p50_over_in_process"] = round(tpot / in_process_tpot, 3)
            print(json.dumps(record), flush=True)
    finally:
        up.terminate()
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    main()
