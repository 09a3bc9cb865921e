"""Overload refused early: a burst past the router's admission queue, and how fast the refusals come.

    python benchmarks/overload.py                       # starts its own tandem up (tiny model) with small bounds
    python benchmarks/overload.py --burst 96 --max-num-seqs 8 --queue 16
    python benchmarks/overload.py --nats-url nats://HOST:4222 --burst 2048   # a running system, its own bounds

Without ``--nats-url`` it starts ``tandem up`` in a fresh data dir with ``--max-num-seqs`` sequences
per worker and a router queue of ``--queue`` requests (``--router-max-queued-requests``), and stops
it at the end; with one, it loads that system as it is configured (``--data-dir``: where the keys
of the ``tandem up`` serving it are). It sends ``--burst`` requests at once (random token-id
prompts of ``--input-len`` tokens, exactly ``--max-tokens`` greedy tokens each) and prints how
many were accepted (and completed), how many were refused with ``overloaded`` and anything else,
the time from sending to ``overloaded`` (p50, max) and how long the accepted ones waited in the
router's queue (p50, max; the router's own figure, ``GenerateAccepted.queue_wait_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.cli.flags import Parser, show_defaults
from tandem.client import OverloadedError, TandemError, connect
from tandem.client.runstate import find_running

PROG = "overload"


class OverloadBenchError(Exception):
    """The run cannot go on: one line for the user."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--nats-url", help="a running system's NATS server (default: start a tandem up here)")
    p.add_argument("--data-dir", help="with --nats-url: the data dir of the tandem up serving it (its keys)")
    p.add_argument("--model", help="the model a started tandem up serves (default: tandem up's)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="a started tandem up: sequences per worker")
    p.add_argument("--queue", type=int, default=8, help="a started tandem up: requests the router's queue holds")
    p.add_argument("--burst", type=int, default=48, help="requests sent at once")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens, exactly")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a started tandem up may take")
    show_defaults(p)
    args = p.parse_args(argv)
    for ok, problem in ((args.burst >= 1, "--burst must be >= 1"), (args.input_len >= 1, "--input-len must be >= 1"),
                        (args.max_tokens >= 1, "--max-tokens must be >= 1"),
                        (args.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
                        (args.queue >= 0, "--queue must be >= 0"),
                        (args.timeout > 0, "--timeout must be > 0")):
        if not ok:
            p.error(problem)
    return args


@contextmanager
def system(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """(NATS URL, data dir holding its keys) of the system to load; one started here is stopped after."""
    if args.nats_url:
        yield args.nats_url, args.data_dir
        return
    data_dir = tempfile.mkdtemp(prefix="tandem-overload-")
    cmd = [sys.executable, "-m", "tandem", "up", "--http-port", "0", "--data-dir", data_dir,
           "--max-num-seqs", str(args.max_num_seqs), "--router-max-queued-requests", str(args.queue)]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.NamedTemporaryFile("w+", prefix="overload-up-", suffix=".log", delete=False)
    print(f"{PROG}: starting {' '.join(cmd[1:])} (log: {log.name})", file=sys.stderr, flush=True)
    up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + args.startup_timeout
        while (state := find_running(Path(data_dir))) is None or state.pid != up.pid:
            if up.poll() is not None:
                log.seek(0)
                tail = " | ".join(log.read().strip().splitlines()[-3:])
                raise OverloadBenchError(f"tandem up exited ({up.returncode}) before it was ready: {tail}")
            if time.monotonic() > deadline:
                raise OverloadBenchError(f"tandem up was not ready after {args.startup_timeout:g}s; see {log.name}")
            time.sleep(0.3)
        yield state.nats_url, data_dir
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # tandem up stops its children on SIGINT
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        log.close()
        shutil.rmtree(data_dir, ignore_errors=True)


async def one(client, prompt: list[int], args: argparse.Namespace) -> tuple[str, float, float, str]:
    """(outcome, seconds from sending to it, seconds queued at the router, error): outcome ok,
    overloaded or failed."""
    start = time.perf_counter()
    stream = client.stream(prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                           timeout_s=args.timeout)
    try:
        tokens = sum([len(chunk.token_ids) async for chunk in stream])
    except OverloadedError:
        return "overloaded", time.perf_counter() - start, 0.0, ""
    except TandemError as exc:
        return "failed", time.perf_counter() - start, 0.0, str(exc)
    if tokens != args.max_tokens:
        return "failed", time.perf_counter() - start, 0.0, f"{tokens} of {args.max_tokens} tokens"
    return "ok", time.perf_counter() - start, stream.accepted.queue_wait_s, ""


def p50_max_ms(values: list[float]) -> str:
    return f"p50 {statistics.median(values) * 1e3:.1f} ms, max {max(values) * 1e3:.1f} ms" if values else "none"


async def measure(args: argparse.Namespace, url: str, data_dir: str | None) -> dict:
    async with connect(url, data_dir=data_dir, request_timeout_s=args.timeout) as client:
        await client.complete([1, 2, 3], max_tokens=2)  # the router has seen every worker's heartbeat
        await asyncio.sleep(1.0)  # and one since the warm-up ended (it would count as in flight)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 250) for _ in range(args.input_len)] for _ in range(args.burst)]
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p, args) for p in prompts))
        duration = time.perf_counter() - start
    by = {kind: [r for r in results if r[0] == kind] for kind in ("ok", "overloaded", "failed")}
    return {"results": by, "duration_s": duration}


def report(args: argparse.Namespace, measured: dict) -> None:
    by = measured["results"]
    print(f"burst of {args.burst} requests at once ({args.input_len} prompt tokens, {args.max_tokens} output tokens "
          f"each), done in {measured['duration_s']:.2f} s")
    print(f"  accepted and completed:  {len(by['ok'])}")
    print(f"  refused with overloaded: {len(by['overloaded'])}")
    first = f" (first: {by['failed'][0][3]})" if by["failed"] else ""
    print(f"  failed otherwise:        {len(by['failed'])}{first}")
    print(f"  time to overloaded:      {p50_max_ms([r[1] for r in by['overloaded']])}")
    print(f"  router queue wait:       {p50_max_ms([r[2] for r in by['ok']])} "
          f"({sum(r[2] > 0 for r in by['ok'])} of the accepted waited)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with system(args) as (url, data_dir):
            measured = asyncio.run(measure(args, url, data_dir))
    except (OverloadBenchError, TandemError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    report(args, measured)
    return 0 if not measured["results"]["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
