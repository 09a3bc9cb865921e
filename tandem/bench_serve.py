"""``tandem bench serve``: load a running tandem and report what clients see, like ``vllm bench serve``.

    tandem up &                                   # or any deployment: --nats-url URL
    tandem bench serve --dataset-name random --input-len 512 --output-len 64 --num-prompts 200 \\
        --request-rate 8 --burstiness 1 --goodput ttft:500 tpot:50 --json-out result.json
    tandem bench serve --dataset-name prefix --prefix-ratio 0.75 --max-concurrency 16

Prompts are token ids valid for the served model (see :mod:`tandem.bench_data`); requests use
``ignore_eos`` and greedy sampling so output lengths are exact. ``--num-warmups`` requests go first
and are not counted. TTFT is measured from just before the request is sent to the arrival of its
first token. The table ends with the services' own TTFT for the same requests: the difference of
the ``tandem:time_to_first_token_seconds`` histograms of every prefill and decode worker, scraped
before and after the measured run (their TTFT starts when the router accepts a request, so the
client's is larger by two bus hops).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time

from tandem.bench_data import RequestResult, arrival_gaps, make_requests, parse_goodput, summarize
from tandem.shared.infra.config import Settings

TTFT_METRIC = "tandem:time_to_first_token_seconds"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=("random", "prefix"), default="random")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (mean; exact per request)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -/+ ratio)")
    p.add_argument("--prefix-ratio", type=float, default=0.5, help="prefix dataset: shared share of each prompt")
    p.add_argument("--num-prefixes", type=int, default=1, help="prefix dataset: distinct shared prefixes")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--num-warmups", type=int, default=2, help="requests sent first and not counted")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json-out", help="write the full result (summary and every request) here")


class Progress:
    """A one-line progress bar on stderr (a line per tenth when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty or self.done == self.total or self.done % max(1, self.total // 10) == 0:
            filled = int(30 * self.done / self.total)
            rate = self.done / max(1e-9, time.perf_counter() - self.start)
            line = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} ({rate:.1f} req/s)"
            sys.stderr.write(("\r" + line) if self.tty else (line + "\n"))
            if self.tty and self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def router_model(nc) -> tuple[str, int]:
    from tandem.discovery import service_infos

    for info in await service_infos(nc, name="tandem-router"):
        meta = info.get("metadata", {})
        if meta.get("vocab_size"):
            return meta.get("model", ""), int(meta["vocab_size"])
    raise RuntimeError("no router answered $SRV.INFO with the model's vocab_size: is tandem running?")


async def server_ttft(nc) -> dict[str, tuple[float, int]]:
    """instance -> (TTFT sum, count) from every engine worker's page."""
    from tandem.discovery import scrape_services

    pages = await scrape_services(nc, ("tandem-prefill", "tandem-decode"))
    return {iid: (page[2][TTFT_METRIC].sum, page[2][TTFT_METRIC].count)
            for iid, page in pages.items() if TTFT_METRIC in page[2]}


async def one(client, prompt: list[int], output_len: int, timeout_s: float) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt), output_len=0, max_tokens=output_len)
    start = time.perf_counter()
    last = None
    try:
        async for chunk in client.generate(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                           timeout_s=timeout_s):
            now = time.perf_counter()
            for _ in chunk.token_ids:
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                result.output_len += 1
    except Exception as exc:  # counted as failed, the run goes on
        result.ok, result.error = False, f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - start
    result.ok = result.ok and result.output_len > 0
    return result


async def run(url: str, args: argparse.Namespace) -> dict:
    """One benchmark run against the system at ``url``; returns the full result."""
    from tandem.client import connect

    slos = parse_goodput(args.goodput)
    async with connect(url, request_timeout_s=args.timeout) as client:
        model, vocab = await router_model(client.nc)
        kw = dict(range_ratio=args.range_ratio, prefix_ratio=args.prefix_ratio, num_prefixes=args.num_prefixes)
        requests = make_requests(args.dataset_name, args.num_prompts, args.input_len, args.output_len, vocab,
                                 seed=args.seed, **kw)
        warmups = make_requests(args.dataset_name, args.num_warmups, args.input_len, args.output_len, vocab,
                                seed=args.seed + 1000, **kw)
        for w in warmups:
            await one(client, w.prompt, w.output_len, args.timeout)
        before = await server_ttft(client.nc)
        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        progress = Progress(len(requests), not args.no_progress)

        async def limited(req) -> RequestResult:
            async with limit:
                result = await one(client, req.prompt, req.output_len, args.timeout)
            progress.step()
            return result

        start = time.perf_counter()
        tasks = []
        for gap, req in zip(gaps, requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await server_ttft(client.nc)
    summary = summarize(results, duration, slos)
    d_sum = sum(s - before.get(i, (0.0, 0))[0] for i, (s, _) in after.items())
    d_count = sum(c - before.get(i, (0.0, 0))[1] for i, (_, c) in after.items())
    summary["server_ttft_mean_ms"] = d_sum / d_count * 1e3 if d_count else math.nan
    summary["server_ttft_count"] = d_count
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
              if k not in ("func",)}
    return {"model": model, "nats_url": url, "config": config, "summary": summary,
            "requests": [vars(r) | {"tpot": r.tpot} for r in results]}


def print_table(result: dict) -> None:
    s = result["summary"]
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}")]
    if "request_goodput" in s:
        rows.append(("Goodput SLOs (ms):", " ".join(f"{k}<={v:g}" for k, v in s["goodput_slos_ms"].items())))
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=60, c="=")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append("{s:{c}^{n}}".format(s=title, n=60, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms):':<44}{s[key][stat]:>16.2f}")
    lines.append("{s:{c}^{n}}".format(s="Services' own TTFT (same requests)", n=60, c="-"))
    lines.append(f"{'Mean TTFT, ' + TTFT_METRIC.split(':')[1] + ' (ms):':<44}{s['server_ttft_mean_ms']:>16.2f}")
    lines.append(f"{'Requests in that histogram:':<44}{s['server_ttft_count']:>16}")
    lines.append("=" * 60)
    print("\n".join(lines), flush=True)


def strict_json(value):
    """NaN and infinity as null: JSON has neither."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def run_bench_serve(args: argparse.Namespace, settings: Settings) -> int:
    from tandem.runstate import find_running_url
    from tandem.services.common.runtime import run_async

    url = settings.bus.nats_url or find_running_url(settings.data_dir)
    if url is None:
        print("tandem bench serve: no running tandem found; start one with `tandem up` or pass --nats-url",
              file=sys.stderr)
        return 2
    try:
        parse_goodput(args.goodput)
        result = run_async(run(url, args))
    except (ValueError, RuntimeError) as exc:
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 1
    print_table(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(strict_json(result), f, indent=2)
    return 0 if result["summary"]["completed"] else 1
