"""Shared-prefix workload, prefix caching on versus off, same run.

Starts ``tandem up``'s system twice on an embedded nats-server (router, one prefill and one
decode worker; the second time with ``--no-enable-prefix-caching``) and sends the same requests
to each: ``--requests`` prompts of ``--prompt-len`` tokens whose first ``--shared`` fraction is
one common prefix (a system prompt, a long document) and the rest unique, ``--concurrency`` in
flight. Prints TTFT p50/p99, TPOT p50 and output tokens/s for both and the TTFT ratio (the KV-plane
issue's target: TTFT p50 with caching at most 0.25x without).

    python benchmarks/prefix_cache.py                      # 200 requests, 512 tokens, 90% shared
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

from tandem.cli.bench import percentile
from tandem.cli.supervisor import Supervisor
from tandem.client import connect
from tandem.services.common.runtime import run_async
from tandem.shared.infra.config import load_settings


def make_prompts(n: int, length: int, shared: float, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(32, 127) for _ in range(int(length * shared))]
    return [prefix + [rng.randrange(32, 127) for _ in range(length - len(prefix))] for _ in range(n)]


async def drive(url: str, prompts: list[list[int]], concurrency: int, output_len: int, creds: str | None) -> dict:
    sem = asyncio.Semaphore(concurrency)
    done = 0
    async with connect(url, request_timeout_s=300, creds=creds) as client:
        async def one(prompt):
            nonlocal done
            async with sem:
                result = await client.complete(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
            done += 1
            if done % 50 == 0:
                print(f"  {done}/{len(prompts)} requests", file=sys.stderr, flush=True)
            return result

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    ttfts = [r.ttft_s for r in results]
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99), "tpot_p50": percentile(tpots, 50),
            "tokens_per_s": sum(len(r.token_ids) for r in results) / wall}


def run_system(caching: bool, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    settings = load_settings(model=args.model, log_level="WARNING")
    sup = Supervisor(settings, extra_args=[flag, "--max-num-batched-tokens", str(args.chunk)])
    try:
        sup.start()
        run_async(sup.wait_ready())
        print(f"prefix caching {'on' if caching else 'off'}: system on {sup.url}", file=sys.stderr, flush=True)
        # warm-up (and, with caching, the prefix)
        run_async(drive(sup.url, prompts[:2], 1, args.output_len, sup.client_creds()))
        return run_async(drive(sup.url, prompts, args.concurrency, args.output_len, sup.client_creds()))
    finally:
        sup.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--shared", type=float, default=0.9, help="fraction of each prompt that is the common prefix")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    args = p.parse_args()
    prompts = make_prompts(args.requests, args.prompt_len, args.shared)
    rows = {"on": run_system(True, prompts, args), "off": run_system(False, prompts, args)}
    print(f"\n{args.requests} requests, {args.prompt_len}-token prompts, {args.shared:.0%} shared, "
          f"{args.output_len} output tokens, concurrency {args.concurrency}, model {args.model}")
    print(f"{'caching':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT p50':>10} {'tok/s':>8}")
    for name, r in rows.items():
        print(f"{name:>8} {r['ttft_p50'] * 1e3:>8.1f}ms {r['ttft_p99'] * 1e3:>8.1f}ms {r['tpot_p50'] * 1e3:>8.1f}ms "
              f"{r['tokens_per_s']:>8.1f}")
    print(f"TTFT p50 on/off: {rows['on']['ttft_p50'] / rows['off']['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
