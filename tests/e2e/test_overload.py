"""Overload refused early, on real processes: one decode worker running two sequences at most (so
the router gives it four), a router whose admission queue holds four. A burst past that gets
``overloaded`` at once (the bus client's ``OverloadedError``, HTTP 429 at the front end) while every
request it accepted completes.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import pytest
from cli_support import launch, run_sync
from support import assert_pools_free, prompt_of

from tandem.cli.supervisor import wait_until_ready
from tandem.client import OverloadedError, connect
from tandem.client.discovery import service_infos

MAX_NUM_SEQS = 2
QUEUE = 4
BURST = 14  # 2 running + 2 waiting on the worker (the router's default: two batches) + 4 queued + 6 past it
NEW_TOKENS = 48
AT_ONCE_S = 1.0  # "at once": far below a queued request's wait and any client's timeout


async def frontend_url(url: str) -> str:
    nc = await nats.connect(url)
    try:
        (info,) = await service_infos(nc, name="tandem-frontend")
    finally:
        await nc.close()
    return info["metadata"]["http_url"]


@pytest.fixture(scope="module")
def system(start_system):
    system = start_system(prefill=0, decode=1, router=0,
                          decode_args=["--max-num-seqs", str(MAX_NUM_SEQS), "--num-blocks", "200"])
    system.processes["router-overload"] = launch(
        system.url, "router", "router-overload", system.logdir, system.env,
        ["--router-max-queued-requests", str(QUEUE), "--router-max-queue-wait-s", "20"])
    system.processes["frontend-overload"] = launch(system.url, "frontend", "frontend-overload", system.logdir,
                                                   system.env, ["--http-port", "0"])
    run_sync(wait_until_ready(system.url, {"router": 1, "frontend": 1}, system.check_alive, 60))
    system.http = run_sync(frontend_url(system.url))
    yield system
    system.stop_all()


async def one(client, salt: int) -> tuple[str, float, float]:
    """(outcome, seconds to it, seconds queued at the router): outcome "ok" or "overloaded"."""
    start = time.perf_counter()
    stream = client.stream(prompt_of(30, salt=salt), max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        tokens = [t async for chunk in stream for t in chunk.token_ids]
    except OverloadedError:
        return "overloaded", time.perf_counter() - start, 0.0
    assert len(tokens) == NEW_TOKENS, "an accepted request completes whole"
    return "ok", time.perf_counter() - start, stream.accepted.queue_wait_s


@pytest.mark.slow  # 8 s: a burst of 48 requests run to the end
async def test_a_burst_past_the_queue_gets_overloaded_at_once_and_the_rest_completes(system):
    async with connect(system.url) as client:
        await client.complete("warm up", max_tokens=2)  # the router has seen the worker's heartbeat
        await asyncio.sleep(0.5)  # and one since the warm-up ended (it would count as in flight)
        results = await asyncio.gather(*(one(client, salt) for salt in range(BURST)))
    refused = sorted(t for outcome, t, _ in results if outcome == "overloaded")
    accepted = [(t, wait) for outcome, t, wait in results if outcome == "ok"]
    waits = sorted(wait for _, wait in accepted)
    print(f"\nburst of {BURST}: {len(accepted)} accepted, {len(refused)} overloaded; time to overloaded "
          f"p50 {refused[len(refused) // 2] * 1e3:.1f} ms, max {refused[-1] * 1e3:.1f} ms; router queue wait "
          f"p50 {waits[len(waits) // 2] * 1e3:.0f} ms, max {waits[-1] * 1e3:.0f} ms" if refused else "none refused")
    assert refused, f"a burst of {BURST} past {MAX_NUM_SEQS} running + {QUEUE} queued must be refused in part"
    assert len(accepted) >= 2 * MAX_NUM_SEQS + QUEUE, "what fits the worker and the queue is accepted"
    assert refused[-1] < AT_ONCE_S, f"overloaded must come at once, took up to {refused[-1]:.2f} s"
    assert sum(wait > 0 for wait in waits) >= QUEUE, "the queued requests waited at the router, not the worker"
    await assert_pools_free(system.url)


async def test_the_front_end_answers_overloaded_with_429(system):
    body = {"model": "tiny", "prompt": prompt_of(30), "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True}
    async with httpx.AsyncClient(base_url=system.http, timeout=60) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(BURST)))
    statuses = sorted(a.status_code for a in answers)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2 * MAX_NUM_SEQS + QUEUE, statuses
    error = next(a for a in answers if a.status_code == 429).json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "overloaded", None)
    assert error["message"].startswith("overloaded: every decode worker is busy"), error
