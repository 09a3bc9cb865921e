"""KV hand-off throughput between two hosts (NATS frames across a route) against one host (frames
through one server, and the shared-memory ring), with real services, in one run.

It builds the two hosts of ``benchmarks/two_hosts.py`` (network namespaces with a private
/dev/shm each, a veth link, a clustered nats-server on each; needs root), starts the router and a
prefill worker on host A, then one decode worker at a time:

- across: on host B, connected to B's server: the KV goes as frames A -> route -> B (their host ids
  differ, so the prefill worker never tries the ring);
- nats: on host A with ``--kv-ring-mib 0``: frames through A's server alone;
- ring: on host A with its ring: only a slot descriptor crosses NATS.

A client on A sends greedy requests one at a time (``--repeat`` per prompt size, each prompt new,
so no prefix cache shortens a hand-off); the prefill worker's KV transfer events on
``tandem.v1.kv.transfers`` give each hand-off's bytes and time (KV copied out, sent, admitted), so
MB/s is what the services themselves achieve, prefill -> decode. It prints each run, a table of
medians and one JSON line per prompt size, as ``benchmarks/kv_transfer.py`` does for the transport
alone::

    python3 benchmarks/kv_across_hosts.py                          # 256, 1024, 4000 tokens; 5 repeats
    python3 benchmarks/kv_across_hosts.py --prompt-tokens 2000 --repeat 9 --paths across ring
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

from two_hosts import HostsError, TwoHosts, namespaces_unavailable

PATHS = {  # name: (host, decode worker's extra flags, what it measures)
    "across": ("b", [], "NATS frames across the route, A -> B"),
    "nats": ("a", ["--kv-ring-mib", "0"], "NATS frames on host A"),
    "ring": ("a", [], "shared-memory ring on host A"),
}


def service_env(data_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    return dict(os.environ, TANDEM_DATA_DIR=str(data_dir), TANDEM_DEVICE=args.device,
                TANDEM_TORCH_THREADS=str(args.torch_threads), TANDEM_HEARTBEAT_INTERVAL_S="0.2",
                TANDEM_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")


def prompt(tokens: int, seed: int) -> str:
    """A new prompt of ``tokens`` bytes (the tiny model's tokenizer is bytes) for every seed."""
    return "".join(random.Random(seed).choices(string.ascii_letters + string.digits + " \n", k=tokens))


def measure(hosts: TwoHosts, servers: dict, name: str, args: argparse.Namespace, env: dict[str, str],
            seed: int, by_size: dict[int, list[dict]], label: str) -> None:
    """Start this path's decode worker, hand off every size once to warm up (its buffers, the
    first frames of a size) and then ``--repeat`` times, stop it; adds the transfer events to
    ``by_size``."""
    host_key, flags, what = PATHS[name]
    host, server = (hosts.a, servers["a"]) if host_key == "a" else (hosts.b, servers["b"])
    instance = f"decode-{name}-{seed}"
    print(f"[{name}{label}] {what}: starting {instance} on {host.name}", flush=True)
    hosts.serve(host, "decode", instance, server.url, [*flags, *args.model_args], env)
    want = {"router": 1, "prefill": 1, "decode": 1}
    hosts.agent(hosts.a, "ready", servers["a"].url, {"want": want}, env, 180)
    warm = len(args.prompt_tokens)
    sizes = [*args.prompt_tokens, *(n for n in args.prompt_tokens for _ in range(args.repeat))]
    requests = [{"prompt": prompt(n, seed + i), "max_tokens": args.max_tokens} for i, n in enumerate(sizes)]
    answer = hosts.agent(hosts.a, "client", servers["a"].url, {"requests": requests}, env, 60 + 30 * len(requests))
    hosts.stop_service(instance)
    for i, (n, result) in enumerate(zip(sizes, answer["results"], strict=True)):
        if result["decode_worker"] != instance:
            raise HostsError(f"[{name}] a request went to {result['decode_worker']}, not {instance}")
        paths = {t["path"] for t in result["transfers"]}
        if paths != {"ring" if name == "ring" else "nats"}:
            raise HostsError(f"[{name}] a {n}-token hand-off went by {sorted(paths) or 'no transfer event'}")
        (event,) = result["transfers"]
        if i < warm:
            continue
        by_size[n].append(event)
        mbs = event["bytes"] / (event["end"] - event["start"]) / 1e6
        print(f"[{n} tokens, {event['bytes'] / 1e6:.2f} MB KV] run {len(by_size[n])}/{args.repeat * args.rounds} "
              f"{name}: {mbs:,.0f} MB/s ({(event['end'] - event['start']) * 1e3:.1f} ms)", flush=True)


def summarize(events: list[dict]) -> dict:
    rates = [e["bytes"] / (e["end"] - e["start"]) / 1e6 for e in events]
    return {"mbs": round(statistics.median(rates), 1), "ms": round(statistics.median(
        (e["end"] - e["start"]) * 1e3 for e in events), 2), "runs_mbs": [round(r, 1) for r in rates]}


def main(args: argparse.Namespace) -> None:
    reason = namespaces_unavailable()
    if reason:
        raise HostsError(f"{reason} (the two hosts need root)")
    workdir = Path(tempfile.mkdtemp(prefix="tandem-two-hosts-"))
    env = service_env(workdir / "data", args)
    results: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in args.prompt_tokens} for name in args.paths}
    started = time.monotonic()
    try:
        with TwoHosts.make(workdir) as hosts:
            nats_a, nats_b = hosts.start_nats()
            servers = {"a": nats_a, "b": nats_b}
            hosts.serve(hosts.a, "router", "router-a", nats_a.url, ["--model", args.model], env)
            hosts.serve(hosts.a, "prefill", "prefill-a", nats_a.url, args.model_args, env)
            try:
                for r in range(args.rounds):
                    label = f", round {r + 1}/{args.rounds}" if args.rounds > 1 else ""
                    for i, name in enumerate(args.paths):
                        measure(hosts, servers, name, args, env, 10_000 * (1 + i + len(args.paths) * r),
                                results[name], label)
            except BaseException:
                print(hosts.logs(), file=sys.stderr)
                raise
    finally:
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{'prompt':>12} | {'KV MB':>7} | " + " | ".join(f"{n + ' MB/s':>12}" for n in args.paths)
          + f"   ({args.device}, median of {args.repeat * args.rounds}, {time.monotonic() - started:.0f} s in all)")
    rows = []
    for n in args.prompt_tokens:
        stats = {name: summarize(results[name][n]) for name in args.paths}
        kv_bytes = results[args.paths[0]][n][0]["bytes"]
        print(f"{n:>5} tokens | {kv_bytes / 1e6:>7.2f} | " + " | ".join(f"{stats[p]['mbs']:>12,.0f}"
                                                                        for p in args.paths))
        rows.append({"prompt_tokens": n, "kv_bytes": kv_bytes, "blocks": results[args.paths[0]][n][0]["blocks"],
                     "device": args.device, "runs": args.repeat * args.rounds,
                     **{f"{p}_mbs": stats[p]["mbs"] for p in args.paths},
                     **{f"{p}_ms": stats[p]["ms"] for p in args.paths},
                     "runs_mbs": {p: stats[p]["runs_mbs"] for p in args.paths}})
    print()
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 1024, 4000],
                   help="prompt sizes (the tiny model: one token a byte, at most --max-model-len minus --max-tokens)")
    p.add_argument("--repeat", type=int, default=5, help="hand-offs per size and path (the median is printed)")
    p.add_argument("--rounds", type=int, default=1,
                   help="cycle through the paths this many times (a fresh decode worker each), so drift in the "
                        "machine's load spreads over all of them")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS),
                   help="across: host B over the route; nats, ring: host A (the baselines)")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens per request (the hand-off is after the first)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", help="the workers' device (cuda: GPU KV, the ring pinned)")
    p.add_argument("--torch-threads", type=int, default=1, help="per worker, as tandem up shares out 2 cores")
    p.add_argument("--keep", action="store_true", help="keep the services' logs")
    a = p.parse_args()
    a.model_args = ["--model", a.model, "--max-model-len", str(a.max_model_len)]
    try:
        main(a)
    except HostsError as exc:
        print(f"kv_across_hosts: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
