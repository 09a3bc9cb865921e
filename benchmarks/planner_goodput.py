"""Goodput with the planner on versus a fixed 1 prefill + 1 decode, under one step load, same run.

    python benchmarks/planner_goodput.py [--low-rate 1 --high-rate 4 --low-s 10 --high-s 30 \\
        --short-len 64 --long-len 1024 --output-len 16 --ttft-slo-ms 2000 --tpot-slo-ms 200]

For each configuration it starts ``tandem up --kvstore 0`` (``--planner --max-prefill N --max-decode 1``,
then ``--no-planner``), sends the same open-loop schedule (Poisson arrivals: low rate of short
prompts, then a high rate of long prompts, then low again; exact output lengths), and reports
DistServe's goodput (requests per second meeting both the TTFT and the TPOT SLO) over the whole
schedule and per phase, with TTFT percentiles and the planner's decisions. Run alone on the machine:
the figures are ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from tandem.cli.bench_data import meets, percentile, summarize
from tandem.cli.bench_serve import one, router_model
from tandem.client import connect
from tandem.client.access import bus_options
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import ScalingDecision


def schedule(args: argparse.Namespace, vocab: int) -> list[tuple[float, str, list[int]]]:
    """(send time from start, phase, prompt) for the whole step load."""
    rng = random.Random(args.seed)
    phases = [("low", args.low_s, args.low_rate, args.short_len), ("high", args.high_s, args.high_rate, args.long_len),
              ("low-again", args.low_s, args.low_rate, args.short_len)]
    plan, t0 = [], 0.0
    for name, length_s, rate, prompt_len in phases:
        t = t0 + rng.expovariate(rate)
        while t < t0 + length_s:
            plan.append((t, name, [rng.randrange(vocab) for _ in range(prompt_len)]))
            t += rng.expovariate(rate)
        t0 += length_s
    return plan


def start_up(flags: list[str], data_dir: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, TANDEM_DATA_DIR=str(data_dir), TANDEM_LOG_LEVEL="INFO", PYTHONUNBUFFERED="1")
    log = open(data_dir / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "up", "--kvstore", "0", *flags], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    state = data_dir / "run" / "up.json"
    deadline = time.monotonic() + 300
    while not state.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"tandem up failed:\n{(data_dir / 'up.log').read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, json.loads(state.read_text())["nats_url"]


async def drive(url: str, args: argparse.Namespace, data_dir: Path) -> tuple[list, list[ScalingDecision], float]:
    decisions: list[ScalingDecision] = []
    nc = await nats.connect(url, **bus_options("operator", "planner-goodput", url, data_dir=data_dir))

    async def on_decision(msg) -> None:
        decisions.append(decode(msg.data, ScalingDecision))

    await nc.subscribe(subjects.PLANNER_DECISIONS, cb=on_decision)
    async with connect(url, request_timeout_s=300, data_dir=str(data_dir)) as client:
        _model, vocab = await router_model(client.nc)
        for _ in range(2):  # warm-up
            await one(client, [1] * args.short_len, args.output_len, 300)
        plan = schedule(args, vocab)
        start = time.perf_counter()

        async def at(t: float, phase: str, prompt: list[int]):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return phase, await one(client, prompt, args.output_len, 300)

        results = await asyncio.gather(*(at(*p) for p in plan))
        duration = time.perf_counter() - start
    await nc.close()
    return results, decisions, duration


def report(name: str, results: list, decisions: list[ScalingDecision], duration: float, slos: dict) -> dict:
    whole = summarize([r for _, r in results], duration, slos)
    print(f"\n== {name}: {whole['completed']} ok, {whole['failed']} failed in {duration:.1f}s; "
          f"goodput {whole['request_goodput']:.2f} req/s ({whole['good_requests']}/{len(results)} met the SLOs); "
          f"throughput {whole['request_throughput']:.2f} req/s")
    phases = {}
    for phase in dict.fromkeys(p for p, _ in results):
        rs = [r for p, r in results if p == phase]
        ttfts = [r.ttft * 1e3 for r in rs if r.ok]
        good = sum(meets(r, slos) for r in rs)
        phases[phase] = {"requests": len(rs), "good": good, "ttft_p50_ms": percentile(ttfts, 50),
                         "ttft_p99_ms": percentile(ttfts, 99)}
        print(f"   {phase:>9}: {len(rs):4d} requests, {good:4d} met SLOs ({good / max(1, len(rs)):.0%}), "
              f"TTFT p50 {phases[phase]['ttft_p50_ms']:8.0f} ms, p99 {phases[phase]['ttft_p99_ms']:8.0f} ms")
    for d in decisions:
        print(f"   decision: prefill {d.prefill_current}->{d.prefill_wanted}, decode {d.decode_current}->"
              f"{d.decode_wanted}: {d.reason}")
    return {"summary": whole, "phases": phases, "decisions": [d.reason for d in decisions]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--low-rate", type=float, default=1.0)
    p.add_argument("--high-rate", type=float, default=4.0)
    p.add_argument("--low-s", type=float, default=10.0)
    p.add_argument("--high-s", type=float, default=30.0)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=200.0)
    p.add_argument("--max-prefill", type=int, default=2)
    p.add_argument("--planner-interval-s", type=float, default=1.0)
    p.add_argument("--planner-window-s", type=float, default=5.0)
    p.add_argument("--planner-cooldown-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out")
    args = p.parse_args()
    slos = {"ttft": args.ttft_slo_ms / 1e3, "tpot": args.tpot_slo_ms / 1e3}
    planner = ["--planner", "--min-prefill", "1", "--max-prefill", str(args.max_prefill), "--max-decode", "1",
               "--ttft-target-ms", str(args.ttft_slo_ms / 2), "--tpot-target-ms", str(args.tpot_slo_ms),
               "--planner-interval-s", str(args.planner_interval_s), "--planner-window-s", str(args.planner_window_s),
               "--planner-cooldown-s", str(args.planner_cooldown_s)]
    configs = [("planner on", planner), ("fixed 1 prefill + 1 decode", ["--no-planner"])]
    out = {}
    for name, flags in configs:
        with tempfile.TemporaryDirectory(prefix="tandem-goodput-") as tmp:
            proc, url = start_up(flags, Path(tmp))
            try:
                results, decisions, duration = asyncio.run(drive(url, args, Path(tmp)))
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(60)
        out[name] = report(name, results, decisions, duration, slos)
    on, fixed = (out[name]["summary"]["request_goodput"] for name, _ in configs)
    print(f"\ngoodput, planner on / fixed 1P+1D: {on:.2f} / {fixed:.2f} req/s = "
          f"{on / fixed if fixed else float('inf'):.2f}x "
          f"(SLOs TTFT <= {args.ttft_slo_ms:.0f} ms, TPOT <= {args.tpot_slo_ms:.0f} ms)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
