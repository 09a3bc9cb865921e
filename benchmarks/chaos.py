"""Chaos: kill -9 of a decode worker with N streams in flight, and what the clients saw.

    python benchmarks/chaos.py [--model random:llama3-8b] [--concurrency 32] [--max-tokens 256]
                               [--input-len 256] [--out-dir DIR]

Starts ``tandem up`` (one prefill and two decode workers; ``--model`` defaults to
``random:llama3-8b`` on CUDA, the tiny model on CPU), runs the same N streams twice: undisturbed
first (the reference), then again, killing (SIGKILL, by the pid in its heartbeats) the decode
worker holding the most streams once every stream is under way. The clients migrate the killed
worker's requests (``tandem/migration.py``). Prints one JSON line: streams completed token-exact /
total, requests failed and migrated, time from the kill to each migrated stream's next token (p50,
max), and for the migrated requests their stall (the gap in their stream at the migration, p50 and
max) and TPOT p99 (whole request, and after the resume), beside the other requests' TPOT p99.
Half the streams are greedy, half seeded sampling (temperature 0.8, top-p 0.95), all
``ignore_eos``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tandem.client import Client, RequestStream, connect
from tandem.runstate import find_running
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import Heartbeat


@dataclass
class Record:
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each token
    error: str | None = None
    migrations: int = 0
    stream: RequestStream | None = None


def workload(count: int, input_len: int, max_tokens: int, vocab_size: int) -> list[dict]:
    """Prompts of random token ids (the same on every run), greedy and seeded sampling in turn."""
    requests = []
    for i in range(count):
        rng = random.Random(i)
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
        requests.append({"prompt": [rng.randrange(vocab_size) for _ in range(input_len)], "max_tokens": max_tokens,
                         "ignore_eos": True, **sampling})
    return requests


async def consume(client: Client, request: dict, record: Record) -> None:
    record.stream = client.generate(**request)
    try:
        async for chunk in record.stream:
            record.token_ids += chunk.token_ids
            record.times += [time.monotonic()] * len(chunk.token_ids)
    except Exception as exc:  # recorded: a failed request is one of the figures
        record.error = f"{type(exc).__name__}: {exc}"
    record.migrations = record.stream.migrations


async def decode_worker_pids(client: Client, wait_s: float = 1.5) -> dict[str, int]:
    """Each decode worker's pid, from its heartbeats (``tandem up`` runs them as its children)."""
    pids: dict[str, int] = {}

    async def on_beat(msg) -> None:
        beat = decode(msg.data, Heartbeat)
        if beat.service == "decode":
            pids[beat.instance_id] = beat.pid

    sub = await client.nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
    await asyncio.sleep(wait_s)
    await sub.unsubscribe()
    return pids


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def tpot(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


async def run(url: str, data_dir: Path, args: argparse.Namespace, vocab_size: int) -> dict:
    requests = workload(args.concurrency, args.input_len, args.max_tokens, vocab_size)
    async with connect(url, data_dir=str(data_dir), request_timeout_s=120) as client:
        await client.complete(requests[0]["prompt"], max_tokens=4, temperature=0.0)  # warm-up
        reference = [Record() for _ in requests]
        await asyncio.gather(*(consume(client, r, rec) for r, rec in zip(requests, reference)))
        failed = [r.error for r in reference if r.error]
        if failed:
            raise SystemExit(f"the undisturbed run failed: {failed[0]}")
        pids = await decode_worker_pids(client)
        records = [Record() for _ in requests]
        tasks = [asyncio.create_task(consume(client, r, rec)) for r, rec in zip(requests, records)]
        started = len(records) if args.kill_after_tokens <= 0 else 0
        deadline = time.monotonic() + 600
        while started < len(records) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            started = sum(len(r.token_ids) >= args.kill_after_tokens or r.error is not None for r in records)
        holders = Counter(r.stream.accepted.decode_worker for r in records
                          if r.stream is not None and r.stream.accepted is not None)
        victim, held = holders.most_common(1)[0]
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        await asyncio.gather(*tasks)
    migrated = [r for r in records if r.migrations]
    others = [r for r in records if not r.migrations and r.error is None]
    resumes = [t - killed_at for r in migrated for t in [next((t for t in r.times if t > killed_at), None)] if t]
    stalls = []
    after_resume = []
    for r in migrated:
        before = [t for t in r.times if t <= killed_at]
        after = [t for t in r.times if t > killed_at]
        if before and after:
            stalls.append(after[0] - before[-1])
        if tpot(after) is not None:
            after_resume.append(tpot(after))
    exact = sum(r.error is None and r.token_ids == e.token_ids for r, e in zip(records, reference))
    return {
        "figure": "chaos_decode_kill", "model": args.model, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "input_len": args.input_len, "killed": victim, "streams_on_killed": held,
        "token_exact": f"{exact}/{len(records)}", "failed": sum(r.error is not None for r in records),
        "first_error": next((r.error for r in records if r.error), None), "migrated": len(migrated),
        "resume_s": {"p50": round(statistics.median(resumes), 3) if resumes else None,
                     "max": round(max(resumes), 3) if resumes else None},
        "migrated_stall_ms": {"p50": ms(statistics.median(stalls)) if stalls else None,
                              "max": ms(max(stalls)) if stalls else None},
        "migrated_tpot_p99_ms": ms(percentile([t for r in migrated if r.error is None
                                               for t in [tpot(r.times)] if t is not None], 0.99)),
        "migrated_tpot_after_resume_p99_ms": ms(percentile(after_resume, 0.99)),
        "others_tpot_p99_ms": ms(percentile([t for r in others for t in [tpot(r.times)] if t is not None], 0.99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, else tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--kill-after-tokens", type=int, default=32,
                        help="kill once every stream has this many tokens (0: at once)")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--up-arg", action="append", default=[], help="an extra `tandem up` argument (repeatable)")
    args = parser.parse_args()
    import torch  # only to pick the default model

    cuda = torch.cuda.is_available()
    args.model = args.model or ("random:llama3-8b" if cuda else "tiny")
    from tandem.shared.model.meta import load_model_meta

    vocab_size = load_model_meta(args.model).config.vocab_size
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_dir = out_dir / "chaos-data"
    env = {**os.environ, "TANDEM_DATA_DIR": str(data_dir)}
    up_args = [sys.executable, "-m", "tandem", "up", "--model", args.model, "--no-planner", "--http-port", "0",
               "--prefill", "1", "--decode", "2", "--max-num-seqs", str(max(64, args.concurrency)),
               *args.up_arg]
    log_path = out_dir / "chaos-up.log"
    with open(log_path, "w") as log:
        up = subprocess.Popen(up_args, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            for line in up.stdout:  # once the ready line is out, the state file names the URLs
                if line.startswith("tandem up: NATS at"):
                    url = find_running(data_dir).nats_url
                    break
            else:
                raise SystemExit(f"tandem up exited before it was ready; see {log_path}")
            print(f"# system up at {url}", flush=True)
            print(json.dumps(asyncio.run(run(url, data_dir, args, vocab_size))), flush=True)
        finally:
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()


if __name__ == "__main__":
    main()
