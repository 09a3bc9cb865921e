"""What the OpenAI-compatible HTTP frontend costs: one workload through the NATS client and through HTTP, one run.

    python benchmarks/frontend_overhead.py                          # starts `tandem up --http-port 0` itself
    python benchmarks/frontend_overhead.py --nats-url nats://HOST:4222 --base-url http://HOST:8000
    python benchmarks/frontend_overhead.py --concurrency 1 32 128 --input-len 512 --output-len 128 --json-out f.json

Against the system at ``--nats-url`` and ``--base-url`` (its NATS server and its frontend), else the
running ``tandem up`` (its state file) when it serves HTTP, else a ``tandem up --http-port 0`` this
script starts as a child and stops at the end. At each concurrency it sends random token-id prompts
of ``--input-len`` tokens for exactly ``--output-len`` greedy tokens (``ignore_eos``) with that many
requests in flight, through ``tandem.client`` (NATS) and as OpenAI streaming completions (HTTP), in
two rounds of half the requests each, ordered NATS, HTTP, HTTP, NATS so that drift within a level
weighs on both alike; measured as ``tandem bench serve`` measures (its pieces:
:mod:`tandem.cli.bench_serve`). Every round gets prompts of the same shape but different tokens, so none
finds another's blocks in the prefix cache. Prints, per concurrency, TTFT p50 over NATS and over HTTP and their
difference in ms, and output tokens/s over each and their ratio HTTP/NATS; ``--json-out`` saves
both paths' full summaries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.cli.bench_data import make_requests, summarize
from tandem.cli.bench_serve import BenchError, Progress, drive, http_backend, nats_backend, one, strict_json
from tandem.cli.flags import Parser, show_defaults
from tandem.client import TandemError
from tandem.client.access import bus_options
from tandem.client.runstate import data_dir_in_use, find_running

PROG = "frontend_overhead"


class OverheadError(Exception):
    """The run cannot go on: one line for the user."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--nats-url", help="the system's NATS server (with --base-url)")
    p.add_argument("--base-url", help="the system's HTTP API, http://HOST:PORT (with --nats-url)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="bearer token for the HTTP API (default: $TANDEM_API_KEY, else none)")
    p.add_argument("--data-dir", help="where to look for a running tandem up, and where a started one keeps its "
                                      "state (default: $TANDEM_DATA_DIR, else tandem's default)")
    p.add_argument("--model", help="the model a started tandem up serves (default: tandem up's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="requests in flight, one level each")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests per level and path (default: 4x concurrency, at least 16)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens, exactly")
    p.add_argument("--num-warmups", type=int, default=4, help="requests per path sent first and not counted")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a started tandem up may take")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json-out", help="write both paths' summaries per level here (default: not written)")
    show_defaults(p)
    args = p.parse_args(argv)
    if bool(args.nats_url) != bool(args.base_url):
        p.error("give both --nats-url and --base-url (one system), or neither")
    for ok, problem in ((min(args.concurrency) >= 1, "--concurrency must be >= 1"),
                        (args.input_len >= 1, "--input-len must be >= 1"),
                        (args.output_len >= 1, "--output-len must be >= 1"),
                        (args.num_prompts >= 0, "--num-prompts must be >= 0"),
                        (args.num_warmups >= 0, "--num-warmups must be >= 0"),
                        (args.timeout > 0, "--timeout must be > 0"),
                        (args.startup_timeout > 0, "--startup-timeout must be > 0")):
        if not ok:
            p.error(problem)
    return args


@contextmanager
def system(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(NATS URL, HTTP base URL) of the system to measure; a ``tandem up`` started here is stopped after."""
    if args.nats_url:
        yield args.nats_url, args.base_url
        return
    data_dir = Path(args.data_dir) if args.data_dir else data_dir_in_use()
    state = find_running(data_dir)
    if state is not None:
        if not state.http_url:
            raise OverheadError(f"the tandem up running on {data_dir} (pid {state.pid}) serves no HTTP API; "
                                "pass --nats-url and --base-url, or stop it")
        print(f"{PROG}: measuring the running tandem up (pid {state.pid}): {state.nats_url}, {state.http_url}",
              file=sys.stderr, flush=True)
        yield state.nats_url, state.http_url
        return
    cmd = [sys.executable, "-m", "tandem", "up", "--http-port", "0", "--data-dir", str(data_dir)]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.NamedTemporaryFile("w+", prefix="frontend-overhead-up-", suffix=".log", delete=False)
    print(f"{PROG}: starting {' '.join(cmd[1:])} (log: {log.name})", file=sys.stderr, flush=True)
    up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + args.startup_timeout
        while (state := find_running(data_dir)) is None or state.pid != up.pid:
            if up.poll() is not None:
                log.seek(0)
                tail = " | ".join(log.read().strip().splitlines()[-3:])
                raise OverheadError(f"tandem up exited ({up.returncode}) before it was ready: {tail}")
            if time.monotonic() > deadline:
                raise OverheadError(f"tandem up was not ready after {args.startup_timeout:g}s; see {log.name}")
            time.sleep(0.3)
        if not state.http_url:
            raise OverheadError("the started tandem up serves no HTTP API (its state file has no http_url)")
        yield state.nats_url, state.http_url
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # tandem up stops its children on SIGINT
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        log.close()


async def measure(args: argparse.Namespace, nats_url: str, base_url: str) -> list[dict]:
    """Every level through both paths: one dict per concurrency with both summaries and the comparison."""
    levels = []
    data_dir = args.data_dir or None  # the keys of a tandem up started or found there
    operator = bus_options("operator", PROG, nats_url, data_dir=data_dir)
    async with nats_backend(nats_url, timeout_s=args.timeout, auth={"data_dir": data_dir},
                            watch_options=operator) as bus, \
            http_backend(base_url, timeout_s=args.timeout, api_key=args.api_key, nats_url=nats_url,
                         nats_options=operator) as http:
        (model, vocab), _ = await asyncio.gather(bus.describe(), http.describe())
        print(f"{PROG}: model {model} (vocab {vocab}), input {args.input_len}, output {args.output_len} tokens; "
              f"NATS {nats_url}, HTTP {http.url}", file=sys.stderr, flush=True)
        for backend in (bus, http):  # first-use costs (connections, the engines' first shapes) stay out
            for w in make_requests("random", args.num_warmups, args.input_len, args.output_len, vocab, seed=99):
                await one(backend, w.prompt, w.output_len, args.timeout)
        for level in args.concurrency:
            n = args.num_prompts or max(16, 4 * level)
            row: dict = {"concurrency": level, "requests": n}
            # Two rounds of n/2 requests in the order NATS, HTTP, HTTP, NATS: whatever drifts during a
            # level (caches warming, the other path's leftovers draining) weighs on both paths alike.
            results = {"nats": [], "http": []}
            durations = {"nats": 0.0, "http": 0.0}
            halves = (n // 2, n - n // 2)
            for round_index, order in enumerate(((bus, http), (http, bus))):
                for backend in order:
                    # Same shape, other tokens: neither path nor round finds another's prompts cached.
                    seed = 4 * level + 2 * round_index + (backend is http)
                    requests = make_requests("random", halves[round_index], args.input_len, args.output_len, vocab,
                                             seed=seed)
                    progress = Progress(len(requests), not args.no_progress,
                                        label=f"c={level} {backend.kind:<4} {round_index + 1}/2 ")
                    got, duration = await drive(backend, requests, max_concurrency=level, timeout_s=args.timeout,
                                                progress=progress)
                    results[backend.kind] += got
                    durations[backend.kind] += duration
            for kind in ("nats", "http"):
                summary = summarize(results[kind], durations[kind], {})
                if summary["failed"]:
                    print(f"{PROG}: {kind} at concurrency {level}: {summary['failed']} of {n} failed; "
                          f"first failure: {summary['first_failure']}", file=sys.stderr, flush=True)
                row[kind] = summary
            nats, web = row["nats"], row["http"]
            row["ttft_p50_diff_ms"] = web["ttft_ms"]["median"] - nats["ttft_ms"]["median"]
            row["throughput_ratio"] = (web["output_throughput"] / nats["output_throughput"]
                                       if nats["output_throughput"] else math.nan)
            print(f"{PROG}: concurrency {level}: TTFT p50 {nats['ttft_ms']['median']:.1f} / "
                  f"{web['ttft_ms']['median']:.1f} ms, {nats['output_throughput']:.1f} / "
                  f"{web['output_throughput']:.1f} tok/s (NATS / HTTP)", file=sys.stderr, flush=True)
            levels.append(row)
    return levels


def print_table(levels: list[dict]) -> None:
    head = (f"{'conc':>5} {'reqs':>5} | {'TTFT p50 NATS':>13} {'HTTP':>9} {'HTTP-NATS':>10} | "
            f"{'tok/s NATS':>10} {'HTTP':>9} {'HTTP/NATS':>9}")
    print(head)
    print("-" * len(head))
    for row in levels:
        nats, web = row["nats"], row["http"]
        print(f"{row['concurrency']:>5} {row['requests']:>5} | {nats['ttft_ms']['median']:>10.1f} ms "
              f"{web['ttft_ms']['median']:>6.1f} ms {row['ttft_p50_diff_ms']:>+7.1f} ms | "
              f"{nats['output_throughput']:>10.1f} {web['output_throughput']:>9.1f} {row['throughput_ratio']:>8.3f}x",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with system(args) as (nats_url, base_url):
            levels = asyncio.run(measure(args, nats_url, base_url))
    except OverheadError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except (BenchError, TandemError) as exc:  # no router, an unreachable server: one line
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    print_table(levels)
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        Path(args.json_out).write_text(json.dumps(strict_json({"config": config, "levels": levels}), indent=2))
    complete = all(row[kind]["completed"] for row in levels for kind in ("nats", "http"))
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
