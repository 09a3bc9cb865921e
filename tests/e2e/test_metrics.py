"""Metrics of every service: Prometheus pages with vLLM-style names that count what was served,
and MetricsSnapshot messages on tandem.v1.metrics.<service>.<id>."""

from __future__ import annotations

import asyncio
import os

import nats
import pytest
from support import prompt_of

from tandem.client import connect
from tandem.client.discovery import scrape_services, service_infos
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import MetricsSnapshot

N, MAX_TOKENS = 4, 6


@pytest.fixture(scope="module")
def system(start_system):
    old = os.environ.get("TANDEM_METRICS_INTERVAL_S")
    os.environ["TANDEM_METRICS_INTERVAL_S"] = "0.3"
    try:
        yield start_system(prefill=1, decode=1, kvstore=1)
    finally:
        if old is None:
            os.environ.pop("TANDEM_METRICS_INTERVAL_S", None)
        else:
            os.environ["TANDEM_METRICS_INTERVAL_S"] = old


def total(pages: dict, instance_prefix: str, key: str, kind: int = 0) -> float:
    """Sum of one counter (kind 0) or gauge (kind 1) over the instances whose id starts with the prefix."""
    return sum(page[kind].get(key, 0.0) for iid, page in pages.items() if iid.startswith(instance_prefix))


async def test_pages_count_what_was_served(system):
    prompts = [prompt_of(40 + 7 * i, salt=i) for i in range(N)]
    async with connect(system.url) as client:
        results = await asyncio.gather(*(client.complete(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                                         for p in prompts))
    assert all(r.prefill_worker for r in results), "expected remote prefill for every request"
    nc = await nats.connect(system.url)
    try:
        infos = await service_infos(nc)
        urls = {i["name"]: i["metadata"].get("metrics_url", "") for i in infos}
        for name in ("tandem-router", "tandem-prefill", "tandem-decode", "tandem-kvstore"):
            assert urls.get(name, "").startswith("http://"), f"{name} advertises no metrics_url: {urls}"
        pages = await scrape_services(nc)
    finally:
        await nc.close()
    prompt_tokens = sum(len(p) for p in prompts)
    assert total(pages, "router", "tandem:router_requests_total") == N
    assert total(pages, "prefill", "tandem:prompt_tokens_total") == prompt_tokens
    generated = total(pages, "prefill", "tandem:generation_tokens_total") + total(
        pages, "decode", "tandem:generation_tokens_total")
    assert generated == N * MAX_TOKENS, "each token is counted once, where it was sampled"
    assert total(pages, "decode", 'tandem:request_success_total{finished_reason="length"}') == N
    prefill_hist = next(p[2] for i, p in pages.items() if i.startswith("prefill"))
    decode_hist = next(p[2] for i, p in pages.items() if i.startswith("decode"))
    assert prefill_hist["tandem:time_to_first_token_seconds"].count == N
    assert prefill_hist["tandem:request_queue_time_seconds"].count == N
    assert decode_hist["tandem:inter_token_latency_seconds"].count == N * (MAX_TOKENS - 1)
    assert decode_hist["tandem:e2e_request_latency_seconds"].count == N
    assert decode_hist["tandem:request_generation_tokens"].sum == N * MAX_TOKENS
    client_ttft = sum(r.ttft_s for r in results)
    server_ttft = prefill_hist["tandem:time_to_first_token_seconds"].sum
    assert 0 < server_ttft <= client_ttft, "the service's TTFT is part of the client's"
    decode_page = next(p for i, p in pages.items() if i.startswith("decode"))
    for gauge in ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_cache_usage_perc"):
        assert gauge in decode_page[1], f"decode page lacks {gauge}"
    for counter in ("tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total",
                    "tandem:engine_busy_seconds_total"):
        assert counter in decode_page[0], f"decode page lacks {counter}"
    assert total(pages, "prefill", "tandem:engine_busy_seconds_total") > 0
    assert 'tandem:kvstore_usage_bytes{tier="ram"}' in next(p for i, p in pages.items() if i.startswith("kvstore"))[1]


async def test_snapshots_are_published_for_every_service(system):
    seen: dict[str, MetricsSnapshot] = {}
    nc = await nats.connect(system.url)

    async def on_snapshot(msg) -> None:
        snap = decode(msg.data, MetricsSnapshot)
        assert msg.subject == subjects.metrics(snap.service, snap.instance_id)
        seen[snap.service] = snap

    try:
        await nc.subscribe(subjects.METRICS_ALL, cb=on_snapshot)
        for _ in range(40):
            if {"router", "prefill", "decode", "kvstore"} <= set(seen):
                break
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
    assert {"router", "prefill", "decode", "kvstore"} <= set(seen), f"snapshots only from {sorted(seen)}"
    decode_snap = seen["decode"]
    assert "tandem:generation_tokens_total" in decode_snap.counters
    hist = decode_snap.histograms["tandem:inter_token_latency_seconds"]
    assert len(hist.counts) == len(hist.bounds) + 1 and sum(hist.counts) == hist.count
