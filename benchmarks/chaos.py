"""Chaos: kill -9 of each part of a running system with N streams in flight, and what the clients saw.

    python benchmarks/chaos.py [--kill decode prefill router nats] [--model random:llama3-8b]
                               [--concurrency 32] [--late 4] [--max-tokens 256] [--input-len 128]

Starts ``tandem up`` (one prefill and two decode workers; ``--model`` defaults to
``random:llama3-8b`` on CUDA, the tiny model on CPU) and runs the same requests first
undisturbed (the reference), then once per ``--kill`` target: N streams, the target killed
(SIGKILL) once every stream is under way, and L more requests sent in the instant after the kill
(their placement meets the death). ``tandem up`` restarts what was killed; the clients migrate what
it held (``tandem/client/migration.py``). The targets: ``decode``, the decode worker holding the most
streams; ``prefill``, the prefill worker, killed at once (before its hand-offs); ``router``, with
both decode workers full (the router lets each hold N + L requests) and N/2 more requests waiting
in its admission queue when it dies; ``nats``, the nats-server itself. Prints one JSON line per
target: streams completed token-exact / total, requests failed and migrated, time from the kill to
each migrated stream's next token (p50, max), the late requests' time from the kill to their first
token (p50, max), and for the migrated requests their stall (the gap in their stream at the
migration) and TPOT p99 (whole request, and after the resume), beside the other requests' TPOT p99.
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
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from up_child import tandem_up

from tandem.client import Client, RequestStream, connect
from tandem.client.discovery import service_infos
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


async def worker_pids(client: Client, service: str, wait_s: float = 1.5) -> dict[str, int]:
    """Each ``service`` worker's pid, from its heartbeats (``tandem up`` runs them as its children)."""
    pids: dict[str, int] = {}

    async def on_beat(msg) -> None:
        beat = decode(msg.data, Heartbeat)
        if beat.service == service:
            pids[beat.instance_id] = beat.pid

    sub = await client.nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
    await asyncio.sleep(wait_s)
    await sub.unsubscribe()
    return pids


def nats_server_pid(data_dir: Path) -> int:
    """The pid of the nats-server ``tandem up`` runs on ``data_dir`` (its ports file is named after it)."""
    (ports,) = (data_dir / "run" / "nats").glob("*.ports")
    return int(ports.stem.rsplit("_", 1)[1])


async def victim(client: Client, target: str, records: list[Record], data_dir: Path) -> tuple[str, int]:
    """The process to kill for ``target``: its name and pid."""
    if target == "nats":
        return "nats-server", nats_server_pid(data_dir)
    if target == "router":
        (info, *_) = await service_infos(client.nc, name="tandem-router")
        return info["metadata"]["instance_id"], int(info["metadata"]["pid"])
    pids = await worker_pids(client, target, wait_s=0.6)
    held = Counter(getattr(r.stream.accepted, f"{target}_worker") for r in records
                   if r.stream is not None and r.stream.accepted is not None)
    held.pop(None, None)
    name = held.most_common(1)[0][0] if held else next(iter(pids))
    return name, pids[name]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def tpot(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def inflight_limit(args: argparse.Namespace) -> int:
    """Requests the router lets one decode worker hold: all the streams and late requests, so one
    worker left after a kill takes every migrated request at once (none waits in the router's
    queue), while the router's kill, with both workers full, has requests queued."""
    return args.concurrency + args.late


async def disturbed(client: Client, requests: list[dict], late: int, target: str, args: argparse.Namespace,
                    data_dir: Path) -> tuple[list[Record], float, str]:
    """The requests once more, ``target`` killed once the first ``len - late`` are under way (or
    queued) and the last ``late`` sent right after: their records, the kill's time and the victim's name."""
    records = [Record() for _ in requests]
    streams = len(requests) - late
    tasks = [asyncio.create_task(consume(client, r, rec)) for r, rec in zip(requests[:streams], records)]
    # The router target's queued ones never get under way before the kill: wait for the rest.
    under_way = 2 * inflight_limit(args) if target == "router" else args.concurrency
    wanted = 0 if target == "prefill" else args.kill_after_tokens  # prefill: before its hand-offs
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        placed = sum(r.stream is not None and r.stream.accepted is not None for r in records[:streams])
        going = sum(len(r.token_ids) >= wanted or r.error is not None for r in records[:streams])
        if (target == "prefill" and placed >= 1) or (target != "prefill" and going >= under_way):
            break
        await asyncio.sleep(0.005)
    name, pid = await victim(client, target, records[:streams], data_dir)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    tasks += [asyncio.create_task(consume(client, r, rec)) for r, rec in zip(requests[streams:], records[streams:])]
    await asyncio.gather(*tasks)
    return records, killed_at, name


def figures(target: str, name: str, records: list[Record], reference: list[Record], killed_at: float, late: int,
            args: argparse.Namespace) -> dict:
    migrated = [r for r in records if r.migrations]
    others = [r for r in records if not r.migrations and r.error is None]
    resumes = [t - killed_at for r in migrated for t in [next((t for t in r.times if t > killed_at), None)] if t]
    late_first = [r.times[0] - killed_at for r in records[len(records) - late:] if r.times]
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
    spread = lambda xs: {"p50": round(statistics.median(xs), 3) if xs else None,  # noqa: E731
                         "max": round(max(xs), 3) if xs else None}
    return {
        "figure": f"chaos_{target}_kill", "model": args.model, "concurrency": args.concurrency, "late": late,
        "max_tokens": args.max_tokens, "input_len": args.input_len, "killed": name,
        "token_exact": f"{exact}/{len(records)}", "failed": sum(r.error is not None for r in records),
        "first_error": next((r.error for r in records if r.error), None), "migrated": len(migrated),
        "migration_reasons": dict(Counter(reason[:60] for r in migrated for reason in r.stream.resume.reasons)),
        "resume_s": spread(resumes), "late_first_token_s": spread(late_first),
        "migrated_stall_ms": {"p50": ms(statistics.median(stalls)) if stalls else None,
                              "max": ms(max(stalls)) if stalls else None},
        "migrated_tpot_p99_ms": ms(percentile([t for r in migrated if r.error is None
                                               for t in [tpot(r.times)] if t is not None], 0.99)),
        "migrated_tpot_after_resume_p99_ms": ms(percentile(after_resume, 0.99)),
        "others_tpot_p99_ms": ms(percentile([t for r in others for t in [tpot(r.times)] if t is not None], 0.99)),
    }


async def run(url: str, data_dir: Path, args: argparse.Namespace, vocab_size: int) -> None:
    # Sent with the streams before the router's kill: both decode workers full, N/2 wait in its queue.
    queued = 2 * inflight_limit(args) - args.concurrency + args.concurrency // 2
    requests = workload(args.concurrency + args.late + queued, args.input_len, args.max_tokens, vocab_size)
    async with connect(url, data_dir=str(data_dir), request_timeout_s=300, reconnect_s=30) as client:
        await client.complete(requests[0]["prompt"], max_tokens=4, temperature=0.0)  # warm-up
        reference = [Record() for _ in requests]
        await asyncio.gather(*(consume(client, r, rec) for r, rec in zip(requests, reference)))
        failed = [r.error for r in reference if r.error]
        if failed:
            raise SystemExit(f"the undisturbed run failed: {failed[0]}")
        for target in args.kill:
            # The same requests each time; the router's kill has the queued ones among its streams.
            chosen = list(range(args.concurrency)) + list(range(args.concurrency + args.late, len(requests)))
            chosen = (chosen if target == "router" else chosen[:args.concurrency])
            chosen += list(range(args.concurrency, args.concurrency + args.late))
            records, killed_at, name = await disturbed(client, [requests[i] for i in chosen], args.late, target,
                                                       args, data_dir)
            print(json.dumps(figures(target, name, records, [reference[i] for i in chosen], killed_at, args.late,
                                     args)), flush=True)
            await wait_for_system(client, 120)  # what was killed is back before the next target


async def wait_for_system(client: Client, timeout_s: float) -> None:
    """Until a request goes through again (the restarted part serving)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.complete([1, 2, 3], max_tokens=2, temperature=0.0, timeout_s=10)
            await asyncio.sleep(2.0)  # the planner-less up restarts workers one by one: let both come
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, else tiny")
    parser.add_argument("--kill", nargs="+", choices=["decode", "prefill", "router", "nats"],
                        default=["decode", "prefill", "router", "nats"], help="what to kill, one run each")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--late", type=int, default=4, help="requests sent in the instant after each kill")
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
    up_args = ["--model", args.model, "--no-planner", "--http-port", "0", "--prefill", "1", "--decode", "2",
               "--max-num-seqs", str(max(64, args.concurrency)),
               "--router-max-inflight-per-worker", str(inflight_limit(args)), *args.up_arg]
    with tandem_up(up_args, data_dir, out_dir / "chaos-up.log") as url:
        print(f"# system up at {url}", flush=True)
        asyncio.run(run(url, data_dir, args, vocab_size))


if __name__ == "__main__":
    main()
