"""Helpers of the chaos tests: a mixed workload of streams, each recorded token by token with
arrival times, and what a kill did to them (token-exact against an undisturbed run, time from the
kill to each migrated stream's next token)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from support import prompt_of

from tandem.client import Client, RequestStream


def mixed_workload(count: int, max_tokens: int, prompt_len: Callable[[int], int] = lambda i: 24 + 5 * i) -> list[dict]:
    """``count`` requests' keywords for ``Client.generate``: greedy, seeded sampling, seeded sampling
    with penalties and ``min_tokens``, and a stop string that may or may not come (every kind whose
    output must not change when the request migrates)."""
    kinds = [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 0.95},
        {"temperature": 0.8, "top_k": 40, "repetition_penalty": 1.2, "presence_penalty": 0.5, "min_tokens": 8},
        {"temperature": 0.0, "frequency_penalty": 0.3, "stop": ["\n\n\n"]},
    ]
    return [{"prompt": prompt_of(prompt_len(i), salt=i), "max_tokens": max_tokens, "ignore_eos": True, "seed": 100 + i,
             **kinds[i % len(kinds)]} for i in range(count)]


@dataclass
class Record:
    """One stream as its caller saw it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    times: list[float] = field(default_factory=list)  # monotonic arrival of each token
    finish_reason: str | None = None
    error: str | None = None
    migrations: int = 0
    stream: RequestStream | None = None

    def first_token_after(self, moment: float) -> float | None:
        return next((t for t in self.times if t > moment), None)

    def tpot(self) -> float | None:
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None

    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


async def consume(client: Client, request: dict, record: Record) -> None:
    """Run one request to its end into ``record`` (an error is recorded, not raised)."""
    record.stream = client.generate(**request)
    try:
        async for chunk in record.stream:
            now = time.monotonic()
            record.token_ids += chunk.token_ids
            record.text += chunk.text
            record.times += [now] * len(chunk.token_ids)
            record.finish_reason = chunk.finish_reason or record.finish_reason
    except Exception as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.migrations = record.stream.migrations


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def report(what: str, records: list[Record], expected: list[Record], killed_at: float) -> dict:
    """The figures of one kill, printed and returned: streams token-exact / total, requests failed,
    migrated, time from the kill to each migrated stream's next token (p50, max)."""
    exact = sum(r.error is None and (r.token_ids, r.text) == (e.token_ids, e.text) for r, e in zip(records, expected))
    resumes = [t - killed_at for r in records if r.migrations for t in [r.first_token_after(killed_at)] if t]
    figures = {"exact": exact, "total": len(records), "failed": sum(r.error is not None for r in records),
               "migrated": sum(r.migrations > 0 for r in records),
               "resume_p50_s": round(statistics.median(resumes), 2) if resumes else None,
               "resume_max_s": round(max(resumes), 2) if resumes else None}
    print(f"{what}: {exact}/{len(records)} streams token-exact, {figures['failed']} failed, {figures['migrated']} "
          f"migrated, kill to resume p50 {figures['resume_p50_s']} s, max {figures['resume_max_s']} s")
    return figures
