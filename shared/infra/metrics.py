"""Prometheus metrics of one tandem process: a private registry, its /metrics HTTP server, and
the same figures published on NATS as :class:`MetricsSnapshot` messages.

Every service gets one through :class:`~tandem.services.common.runtime.ServiceRuntime` (``self.prom``):
the HTTP server listens on ``--metrics-port`` (0: a free port; its URL is logged and put in the
service's micro metadata as ``metrics_url``) and a :class:`MetricsPublisher` sends a snapshot on
``tandem.v1.metrics.<service>.<id>`` every ``--metrics-interval-s``. A service only declares its
metrics. Anything else (the trainer, a script) can use the same pieces on its own::

    from tandem.shared.infra.metrics import MetricsRegistry, MetricsPublisher

    prom = MetricsRegistry()
    steps = prom.counter("tandem:train_steps", "optimizer steps")        # exposed as ..._total
    loss = prom.gauge("tandem:train_loss", "loss of the last step")
    step_time = prom.histogram("tandem:train_step_seconds", "step time", (0.1, 1.0, 10.0))
    prom.gauge_fn("tandem:train_queue_depth", "jobs queued", lambda: len(queue))
    url = prom.serve(port=0)                                             # http://127.0.0.1:PORT/metrics
    publisher = MetricsPublisher(nc, prom, "trainer", instance_id, host, interval_s=2.0)
    task = asyncio.create_task(publisher.run())

Snapshot keys are sample names as Prometheus writes them, labels in braces
(``tandem:request_success_total{finished_reason="length"}``); histogram counts are per bucket, not
cumulative. :func:`parse_text` turns a scraped page into the same form, and
:func:`histogram_quantile` / :func:`histogram_delta` work on either.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.fleet import HistogramSnapshot, MetricsSnapshot

prometheus_client.disable_created_metrics()  # no *_created samples: they only double every page
log = logging.getLogger("tandem.metrics")

Value = Callable[[], float]
LabeledValues = Callable[[], dict[tuple[str, ...], float]]


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class _FnCollector:
    """A counter or gauge whose value is read from a function at collection time (engine stats)."""

    def __init__(self, kind: str, name: str, doc: str, fn, labels: tuple[str, ...]) -> None:
        self.kind, self.name, self.doc, self.fn, self.labels = kind, name, doc, fn, labels

    def collect(self):
        family_type = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = family_type(self.name, self.doc, labels=list(self.labels) or None)
        try:
            values = self.fn()
        except Exception:  # a metric never takes the page down
            values = {} if self.labels else math.nan
        if self.labels:
            for label_values, value in values.items():
                family.add_metric(list(label_values), float(value))
        else:
            family.add_metric([], float(values))
        yield family


class MetricsRegistry:
    """One process's metrics: declare them here, serve them over HTTP, snapshot them for NATS."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.url = ""
        self._server = None

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        """A counter; Prometheus exposes it as ``name`` + ``_total``."""
        return Counter(name.removesuffix("_total"), doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Iterable[float], labels: Iterable[str] = ()) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=list(buckets), registry=self.registry)

    def gauge_fn(self, name: str, doc: str, fn: Value | LabeledValues, labels: Iterable[str] = ()) -> None:
        """A gauge read from ``fn`` when collected; with ``labels``, ``fn`` returns {label values: value}."""
        self.registry.register(_FnCollector("gauge", name, doc, fn, tuple(labels)))

    def counter_fn(self, name: str, doc: str, fn: Value | LabeledValues, labels: Iterable[str] = ()) -> None:
        """A counter (cumulative, never decreasing) read from ``fn`` when collected."""
        self.registry.register(_FnCollector("counter", name.removesuffix("_total"), doc, fn, tuple(labels)))

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Serve ``/metrics`` from a daemon thread; returns its URL (port 0: a free port)."""
        self._server, _thread = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        shown = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = f"http://{shown}:{self._server.server_port}/metrics"
        return self.url

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def text(self) -> str:
        """The Prometheus exposition page, as /metrics serves it."""
        return prometheus_client.generate_latest(self.registry).decode()

    def snapshot(self, service: str, instance_id: str, host: str) -> MetricsSnapshot:
        counters, gauges, histograms = families_to_dicts(self.registry.collect())
        return MetricsSnapshot(service=service, instance_id=instance_id, host=host, time=time.time(),
                               counters=counters, gauges=gauges, histograms=histograms)


def families_to_dicts(families) -> tuple[dict[str, float], dict[str, float], dict[str, HistogramSnapshot]]:
    """Counters, gauges and histograms of collected (or parsed) metric families, keyed by sample name."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    histograms: dict[str, HistogramSnapshot] = {}
    for family in families:
        if family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    counters[_key(s.name, s.labels)] = s.value
        elif family.type == "gauge":
            for s in family.samples:
                gauges[_key(s.name, s.labels)] = s.value
        elif family.type == "histogram":
            groups: dict[str, dict] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                group = groups.setdefault(_key(family.name, labels), {"buckets": [], "sum": 0.0, "count": 0})
                if s.name.endswith("_bucket"):
                    group["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_sum"):
                    group["sum"] = s.value
                elif s.name.endswith("_count"):
                    group["count"] = int(s.value)
            for key, group in groups.items():
                cumulative = sorted(group["buckets"])
                bounds = [b for b, _ in cumulative if not math.isinf(b)]
                per_bucket, previous = [], 0.0
                for _bound, total in cumulative:
                    per_bucket.append(int(total - previous))
                    previous = total
                if len(per_bucket) == len(bounds):  # no +Inf bucket on the page
                    per_bucket.append(0)
                histograms[key] = HistogramSnapshot(bounds=bounds, counts=per_bucket, sum=group["sum"],
                                                    count=group["count"])
    return counters, gauges, histograms


def parse_text(page: str) -> tuple[dict[str, float], dict[str, float], dict[str, HistogramSnapshot]]:
    """A scraped /metrics page as (counters, gauges, histograms), keyed like a snapshot."""
    return families_to_dicts(text_string_to_metric_families(page))


def histogram_delta(new: HistogramSnapshot, old: HistogramSnapshot | None) -> HistogramSnapshot:
    """What was observed between two snapshots of one histogram (``old`` None: since its start; all of
    ``new`` also when the bounds changed or the count went down, i.e. the process restarted)."""
    if old is None or old.bounds != new.bounds or old.count > new.count:
        return new
    return HistogramSnapshot(bounds=new.bounds, counts=[a - b for a, b in zip(new.counts, old.counts)],
                             sum=new.sum - old.sum, count=new.count - old.count)


def histogram_merge(parts: Iterable[HistogramSnapshot]) -> HistogramSnapshot | None:
    """The sum of histograms with equal bounds (several instances of one service)."""
    merged = None
    for h in parts:
        if merged is None:
            merged = h
        elif h.bounds == merged.bounds:
            merged = HistogramSnapshot(bounds=merged.bounds, counts=[a + b for a, b in zip(merged.counts, h.counts)],
                                       sum=merged.sum + h.sum, count=merged.count + h.count)
    return merged


def histogram_quantile(h: HistogramSnapshot | None, q: float) -> float:
    """The ``q`` quantile (0..1), interpolated linearly within its bucket as Prometheus's
    ``histogram_quantile`` does; NaN for an empty histogram."""
    if h is None or h.count <= 0:
        return math.nan
    rank, seen = q * h.count, 0
    for i, count in enumerate(h.counts):
        if count and seen + count >= rank:
            lower = h.bounds[i - 1] if i > 0 else 0.0
            if i >= len(h.bounds):  # the +Inf bucket: the largest finite bound is all we know
                return h.bounds[-1] if h.bounds else math.nan
            return lower + (h.bounds[i] - lower) * (rank - seen) / count
        seen += count
    return h.bounds[-1] if h.bounds else math.nan


class MetricsPublisher:
    """Publishes ``registry``'s snapshot on ``tandem.v1.metrics.<service>.<id>`` every ``interval_s``."""

    def __init__(self, nc, registry: MetricsRegistry, service: str, instance_id: str, host: str,
                 interval_s: float = 2.0) -> None:
        self.nc, self.registry, self.interval_s = nc, registry, interval_s
        self.service, self.instance_id, self.host = service, instance_id, host
        self.subject = subjects.metrics(service, instance_id)
        self.published = 0

    async def publish_once(self) -> None:
        snapshot = self.registry.snapshot(self.service, self.instance_id, self.host)
        await self.nc.publish(self.subject, encode(snapshot))
        self.published += 1

    async def run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except Exception as exc:  # a lost snapshot is replaced by the next one
                log.warning("metrics snapshot not published: %s", exc)
            await asyncio.sleep(self.interval_s)
