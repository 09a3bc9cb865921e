"""``tandem bench``: the full bus path against the same engine in-process, in one run.

For each concurrency level it sends the same requests (random prompts of ``--input-len`` tokens,
exactly ``--output-len`` greedy output tokens) through ``tandem up``'s system (client -> NATS ->
router -> prefill -> KV frames -> decode -> NATS -> client, every service its own process) and
straight into an in-process :class:`LLMEngine` with the same configuration, keeping
``concurrency`` requests in flight in both. The in-process engine runs twice: with every core
(torch's default) and with the threads one worker gets under ``tandem up``, which shares the cores
out between its workers. It prints output tokens/s, TTFT and TPOT p50/p99 and the bus/in-process
throughput ratios. ``--json-out`` saves the figures.

    tandem bench --concurrency 1 8 32 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from tandem.shared.infra.config import Settings


@dataclass
class Result:
    path: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(path: str, concurrency: int, wall: float, ttfts: list[float], tpots: list[float], tokens: int) -> Result:
    return Result(path, concurrency, len(ttfts), tokens, wall, percentile(ttfts, 50), percentile(ttfts, 99),
                  percentile(tpots, 50), percentile(tpots, 99))


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


def build_engine(settings: Settings):
    """The engine a decode worker with these settings would run, built in this process."""
    from tandem.services.common.worker import engine_config, resolve_device
    from tandem.shared.engine.engine import LLMEngine
    from tandem.shared.model.loader import load_model, resolve_dtype

    device = resolve_device(settings.engine.device)
    dtype = resolve_dtype(settings.engine.dtype, device)
    loaded = load_model(settings.model, device=device, dtype=dtype, data_dir=settings.data_dir)
    return LLMEngine(loaded.model, loaded.tokenizer, engine_config(settings, loaded, device, dtype), device, dtype)


def run_in_process(engine, prompts: list[list[int]], concurrency: int, output_len: int) -> Result:
    """No bus: keep ``concurrency`` requests in the engine, step until all finish."""
    from tandem.shared.engine.sequence import EngineRequest
    from tandem.shared.protocol.serving import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    waiting = [(f"r{i}", p) for i, p in enumerate(prompts)]
    in_flight: set[str] = set()
    added: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    while waiting or in_flight:
        while waiting and len(in_flight) < concurrency:
            rid, prompt = waiting.pop(0)
            added[rid], times[rid] = time.perf_counter(), []
            in_flight.add(rid)
            engine.add_request(EngineRequest(rid, list(prompt), params))
        for out in engine.step():
            times[out.request_id].extend([time.perf_counter()] * len(out.new_token_ids))
            if out.finished:
                in_flight.discard(out.request_id)
    wall = time.perf_counter() - start
    ttfts = [t[0] - added[rid] for rid, t in times.items()]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return summarize("in-process", concurrency, wall, ttfts, tpots, sum(len(t) for t in times.values()))


async def run_bus(url: str, prompts: list[list[int]], concurrency: int, output_len: int,
                  creds: str | None = None) -> Result:
    from tandem.client import connect

    sem = asyncio.Semaphore(concurrency)
    async with connect(url, request_timeout_s=120, creds=creds) as client:
        async def one(prompt):
            async with sem:
                return await client.complete(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)

        await one(prompts[0])  # warm-up: first-use costs stay out of the figures
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return summarize("bus (router+prefill+decode)", concurrency, wall, [r.ttft_s for r in results],
                     [r.tpot_s for r in results if r.tpot_s is not None], sum(len(r.token_ids) for r in results))


def print_table(levels: list[list[Result]]) -> None:
    """One block per concurrency level: the in-process baselines, the bus path, and its ratios."""
    head = (f"{'conc':>5} {'path':>28} {'reqs':>5} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9}")
    print(head)
    print("-" * len(head))
    for results in levels:
        bus = results[-1]
        for r in results:
            print(f"{r.concurrency:>5} {r.path:>28} {r.requests:>5} {r.tokens_per_s:>9.1f} {r.ttft_p50 * 1e3:>7.1f}ms "
                  f"{r.ttft_p99 * 1e3:>7.1f}ms {r.tpot_p50 * 1e3:>7.1f}ms {r.tpot_p99 * 1e3:>7.1f}ms")
        for r in results[:-1]:
            print(f"{'':>5} {'bus / ' + r.path:>28} {'':>5} {bus.tokens_per_s / r.tokens_per_s:>9.2f}x")


def run_bench(args: argparse.Namespace, settings: Settings, overrides: dict[str, Any]) -> int:
    """Bus path against two in-process baselines: the engine with every core this process has
    (torch's default), and with the threads each worker gets under ``tandem up`` (on a small
    machine the bus path splits the cores between a prefill and a decode worker)."""
    import torch

    from tandem.cli.supervisor import Supervisor
    from tandem.shared.infra.process import run_async, setup_logging

    setup_logging("WARNING")
    # On a GPU the in-process engine and the system's workers hold their KV pools at once: half each.
    settings = settings.updated(gpu_memory_utilization=settings.engine.gpu_memory_utilization / 2)
    sup = Supervisor(settings.updated(log_level="WARNING"), overrides=overrides)
    all_threads, worker_threads = torch.get_num_threads(), sup.worker_threads()
    thread_counts = sorted({all_threads, worker_threads}, reverse=True)
    engine = build_engine(settings)
    run_in_process(engine, make_prompts(2, args.input_len, seed=0), 2, 2)  # warm-up
    levels: list[list[Result]] = []
    try:
        sup.start()
        run_async(sup.wait_ready())
        print(f"bench: model {settings.model}, input {args.input_len}, output {args.output_len} tokens, "
              f"{worker_threads} thread(s) per worker, system on {sup.url}", file=sys.stderr)
        for level in args.concurrency:
            n = args.requests or max(32, 4 * level)
            prompts = make_prompts(n, args.input_len, seed=level)
            results = []
            for threads in thread_counts:
                torch.set_num_threads(threads)
                local = run_in_process(engine, prompts, level, args.output_len)
                local.path = f"in-process {threads} thr"
                results.append(local)
            torch.set_num_threads(all_threads)
            results.append(run_async(run_bus(sup.url, prompts, level, args.output_len, sup.client_creds())))
            levels.append(results)
            print(f"bench: concurrency {level}: " + ", ".join(f"{r.path} {r.tokens_per_s:.1f} tok/s" for r in results),
                  file=sys.stderr, flush=True)
    finally:
        sup.stop()
    print_table(levels)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([[{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results] for results in levels], f,
                      indent=2)
    return 0
