"""KV-aware routing end to end: two decode workers, prefixes cached on each, a router restart.

A request whose prefix is cached on one decode worker goes there (the index is fed by the workers'
KV events); a new router process rebuilds the index from the JetStream stream and routes the same.
"""

from __future__ import annotations

import asyncio
import json

import nats
import pytest
from support import prompt_of, worker_beats

from tandem.client import connect

PREFIX_TOKENS = 96  # six full blocks


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(prefill=0, decode=2)


async def place(url: str, prompts: list[str]) -> list[str]:
    async with connect(url) as client:
        results = await asyncio.gather(*(
            client.complete(p, max_tokens=2, temperature=0.0, ignore_eos=True) for p in prompts))
    return [r.decode_worker for r in results]


async def test_requests_follow_their_cached_prefix_across_a_router_restart(system):
    prefixes = [prompt_of(PREFIX_TOKENS, salt=0), prompt_of(PREFIX_TOKENS, salt=40)]
    # Sent together, the two land on different workers (the second sees the first's load).
    homes = await place(system.url, [p + "#first" for p in prefixes])
    assert len(set(homes)) == 2, f"expected the two prefixes on different workers, got {homes}"
    await asyncio.sleep(0.5)  # the KV events reach the router

    for attempt in ("again", "after-restart"):
        if attempt == "after-restart":
            system.restart(system.instance("router"))
        for prefix, home in zip(prefixes, homes):
            (placed,) = await place(system.url, [prefix + f"?{attempt}"])
            assert placed == home, f"{attempt}: prefix cached on {home} was routed to {placed}"

    beats = await worker_beats(system.url)
    hits = {i: b.prefix_cache_hits for i, b in beats.items()}
    assert all(hits[h] >= 2 * (PREFIX_TOKENS - 16) for h in homes), f"prefix cache hits per worker: {hits}"


async def test_srv_stats_show_prefix_cache_counters(system):
    nc = await nats.connect(system.url)
    try:
        inbox, replies = nc.new_inbox(), []

        async def collect(msg):
            replies.append(json.loads(msg.data))

        sub = await nc.subscribe(inbox, cb=collect)
        await nc.publish("$SRV.STATS.tandem-decode", b"", reply=inbox)
        await asyncio.sleep(0.5)
        await sub.unsubscribe()
    finally:
        await nc.close()
    assert len(replies) == 2, f"expected both decode workers in $SRV.STATS, got {len(replies)}"
    data = [e["data"] for r in replies for e in r["endpoints"]]
    assert all("prefix_cache_hits" in d and "prefix_cache_queries" in d for d in data), data
    assert sum(d["prefix_cache_hits"] for d in data) > 0
