"""Finding tandem's services on a NATS server and reading their metrics.

``$SRV.INFO`` answers carry each instance's metadata (instance id, host, pid, model and the
``metrics_url`` of its Prometheus page), so a tool needs only the NATS URL::

    nc = await nats.connect(url)
    for info in await service_infos(nc):
        print(info["name"], info["metadata"]["instance_id"], info["metadata"].get("metrics_url"))
    counters, gauges, histograms = await scrape(info["metadata"]["metrics_url"])
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import nats

from tandem.shared.infra.metrics import parse_text
from tandem.shared.protocol.fleet import HistogramSnapshot


async def gather_replies(nc: nats.NATS, subject: str, wait_s: float = 0.3) -> list[dict]:
    """Every JSON answer to one request on ``subject`` (``$SRV.PING``, ``$SRV.INFO``, ``$SRV.STATS``,
    maybe narrowed to one service) that arrives within ``wait_s``; answers that are not JSON are skipped."""
    found: list[dict] = []
    inbox = nc.new_inbox()

    async def on_reply(msg) -> None:
        try:
            found.append(json.loads(msg.data))
        except ValueError:
            pass

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    return found


async def service_pongs(nc: nats.NATS, wait_s: float = 0.3) -> list[dict]:
    """Every ``$SRV.PING`` answer within ``wait_s``: one dict per live instance, with its service's
    ``name`` and its ``metadata`` (``instance_id``, ...)."""
    return [pong for pong in await gather_replies(nc, "$SRV.PING", wait_s) if isinstance(pong, dict)]


async def service_infos(nc: nats.NATS, wait_s: float = 0.3, name: str = "") -> list[dict]:
    """Every micro service instance's ``$SRV.INFO`` answer within ``wait_s`` (``name``: only that
    service, e.g. ``tandem-decode``)."""
    return await gather_replies(nc, f"$SRV.INFO.{name}" if name else "$SRV.INFO", wait_s)


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


async def scrape(url: str, timeout_s: float = 5.0) -> tuple[dict[str, float], dict[str, float],
                                                            dict[str, HistogramSnapshot]]:
    """One /metrics page as (counters, gauges, histograms), keyed as in a MetricsSnapshot."""
    return parse_text(await asyncio.to_thread(_fetch, url, timeout_s))


async def scrape_services(nc: nats.NATS, names: tuple[str, ...] = ()) -> dict[str, tuple]:
    """instance id -> scraped page of every reachable service (``names``: only those, e.g.
    ``("tandem-prefill",)``); an instance whose page cannot be read is left out."""
    infos = [i for i in await service_infos(nc) if not names or i.get("name") in names]
    urls = {i["metadata"].get("instance_id", i.get("id")): i["metadata"].get("metrics_url") for i in infos}
    urls = {k: v for k, v in urls.items() if v}
    pages = await asyncio.gather(*(scrape(u) for u in urls.values()), return_exceptions=True)
    return {k: p for k, p in zip(urls, pages) if not isinstance(p, BaseException)}
