"""The restart gap: requests sent while the only decode worker is killed and restarted.

    python benchmarks/restart_gap.py [--requests 60] [--rate 6] [--kill-after-s 2] [--max-tokens 8]

Starts ``tandem up`` with one decode worker and no prefill worker (so nothing else can take a
request), sends ``--requests`` short greedy completions at ``--rate`` a second, kills the decode
worker with SIGKILL ``--kill-after-s`` seconds in, and lets ``tandem up`` restart it. Prints one
JSON line: how many requests failed (and the first error), how many waited in the router's
admission queue for the restart and for how long (p50, max of ``GenerateAccepted.queue_wait_s``),
how many migrated, how many came out token-exact against the same requests sent undisturbed, the
time from the kill to the restarted worker's first heartbeat, and the longest wait as a fraction of
that time. Before the router waited for a restart, the requests of that gap failed at once with
``NoWorkersError``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from up_child import tandem_up

from tandem.client import Client, connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import Heartbeat


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    queue_wait_s: float = 0.0
    migrations: int = 0
    sent_at: float = 0.0


def workload(count: int, max_tokens: int, vocab_size: int) -> list[dict]:
    """Greedy requests on random prompts (the same on every run)."""
    rng = random.Random(7)
    return [{"prompt": [rng.randrange(1, vocab_size) for _ in range(24)], "max_tokens": max_tokens,
             "temperature": 0.0, "ignore_eos": True} for _ in range(count)]


async def send(client: Client, request: dict, outcome: Outcome) -> None:
    outcome.sent_at = time.monotonic()
    stream = client.generate(**request)
    try:
        async for chunk in stream:
            outcome.token_ids += chunk.token_ids
    except Exception as exc:  # a failed request is the figure
        outcome.error = f"{type(exc).__name__}: {exc}"
    if stream.accepted is not None:
        outcome.queue_wait_s = stream.accepted.queue_wait_s
    outcome.migrations = stream.migrations


class DecodeBeats:
    """The decode worker's pid and when a new process of it first beat."""

    def __init__(self) -> None:
        self.pid = 0
        self.incarnation = ""
        self.new_at: float | None = None

    async def on_beat(self, msg) -> None:
        beat = decode(msg.data, Heartbeat)
        if beat.service != "decode":
            return
        if self.incarnation and beat.incarnation != self.incarnation and self.new_at is None:
            self.new_at = time.monotonic()
        self.pid, self.incarnation = beat.pid, self.incarnation or beat.incarnation


async def run(url: str, data_dir: Path, args: argparse.Namespace, vocab_size: int) -> dict:
    requests = workload(args.requests, args.max_tokens, vocab_size)
    async with connect(url, data_dir=str(data_dir), request_timeout_s=args.timeout_s) as client:
        beats = DecodeBeats()
        await client.nc.subscribe(subjects.HEARTBEAT_ALL, cb=beats.on_beat)
        reference = [Outcome() for _ in requests]
        for request, outcome in zip(requests, reference):  # one by one: nothing shares their batch
            await send(client, request, outcome)
        if any(o.error for o in reference):
            raise SystemExit(f"the undisturbed run failed: {next(o.error for o in reference if o.error)}")
        outcomes = [Outcome() for _ in requests]
        tasks = []
        start = time.monotonic()
        killed_at = None
        for i, (request, outcome) in enumerate(zip(requests, outcomes)):
            due = start + i / args.rate
            if killed_at is None and due - start >= args.kill_after_s:
                killed_at = time.monotonic()
                os.kill(beats.pid, signal.SIGKILL)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(send(client, request, outcome)))
        await asyncio.gather(*tasks)
    after_kill = [o for o in outcomes if killed_at is not None and o.sent_at >= killed_at]
    waited = [o.queue_wait_s for o in outcomes if o.queue_wait_s > 0]
    failed = [o for o in outcomes if o.error]
    restart_s = beats.new_at - killed_at if beats.new_at and killed_at else None
    return {
        "figure": "restart_gap", "requests": len(outcomes), "rate_per_s": args.rate,
        "sent_after_kill": len(after_kill), "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "waited_for_restart": len(waited),
        "queue_wait_s": {"p50": round(statistics.median(waited), 3) if waited else None,
                         "max": round(max(waited), 3) if waited else None},
        "migrated": sum(o.migrations > 0 for o in outcomes),
        "token_exact": f"{sum(o.error is None and o.token_ids == r.token_ids for o, r in zip(outcomes, reference))}"
                       f"/{len(outcomes)}",
        "restart_s": round(restart_s, 2) if restart_s else None,
        # The longest wait against the worker's own return, both in this run: 1 would be a request
        # sent at the kill placed the moment the restarted worker beat.
        "queue_wait_max_over_restart": round(max(waited) / restart_s, 3) if waited and restart_s else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=6.0, help="requests sent per second")
    parser.add_argument("--kill-after-s", type=float, default=2.0, help="when the decode worker is killed")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="each request's client timeout")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--up-arg", action="append", default=[], help="an extra `tandem up` argument (repeatable)")
    args = parser.parse_args()
    from tandem.shared.model.meta import load_model_meta

    vocab_size = load_model_meta(args.model).config.vocab_size
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = out_dir / "restart-gap-data"
    up_args = ["--model", args.model, "--no-planner", "--http-port", "0", "--prefill", "0", "--decode", "1",
               "--kvstore", "0", *args.up_arg]
    with tandem_up(up_args, data_dir, out_dir / "restart-gap-up.log") as url:
        print(f"# system up at {url}", flush=True)
        print(json.dumps(asyncio.run(run(url, data_dir, args, vocab_size))), flush=True)


if __name__ == "__main__":
    main()
