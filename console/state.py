"""Everything the console shows, as plain data: what the data source fills in and the panes read.

No NATS and no widgets here, so a test or the screenshot script can build a :class:`ConsoleState`
by hand (see :mod:`tandem.console.demo`) and every pane renders it the same way each time. The
panes never read a clock: ``now`` is set by whoever fills the state (the NATS source, each refresh).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime

from tandem.shared.infra.metrics import histogram_delta, histogram_merge, histogram_quantile
from tandem.shared.protocol.fleet import Heartbeat, HistogramSnapshot, MetricsSnapshot, RoutingDecision, ScalingDecision
from tandem.shared.protocol.training import TrainStepMetrics, TrainTimeline
from tandem.shared.protocol.views import BlockSnapshot, KVTransferEvent

WORKER_SERVICES = ("decode", "prefill")
CONSOLE_ENDPOINTS = {"blocks", "stats", "drain"}  # polled by the console itself: not counted as traffic
# The front end's answers by route and status (services/frontend/metrics.py): its traffic is HTTP,
# which no $SRV endpoint counts, so its row takes requests and errors from its metrics snapshots.
HTTP_ANSWERS = "tandem:http_requests_total"
HTTP_LATENCY = "tandem:http_e2e_request_latency_seconds"
HTTP_POLLS = ("/health", "/metrics")  # probes and scrapes, like the console's own polls: not traffic
LATENCY_KINDS = ("ttft", "tpot")
# The services' histogram of each kind (tandem.services.common.service_metrics); other names that contain
# the kind ("ttft", "tpot") are taken too, for services that name theirs so.
LATENCY_METRICS = {"ttft": "tandem:time_to_first_token_seconds",
                   "tpot": "tandem:request_time_per_output_token_seconds"}
SERIES_POINTS = 60


@dataclass
class ServiceRow:
    """One live service instance, from its ``$SRV.STATS`` reply."""

    service: str  # "decode" (the micro name without "tandem-")
    instance_id: str
    host: str
    started: float  # unix seconds
    requests: int = 0
    errors: int = 0
    mean_latency_s: float = 0.0
    last_error: str = ""
    version: str = ""
    data: dict = field(default_factory=dict)  # the service's metrics() dict

    def matches(self, text: str) -> bool:
        text = text.lower()
        return any(text in v.lower() for v in (self.service, self.instance_id, self.host, self.last_error))


def service_row(stats: dict, now: float, snapshots: dict[tuple[str, str], MetricsSnapshot] | None = None) -> ServiceRow:
    """A row from one ``$SRV.STATS`` reply (JSON already parsed); the console's own polls are left out.
    ``snapshots``: the latest metrics of each (service, instance id), whose HTTP answers (the front
    end's) count as requests too, those of status 5xx as errors."""
    meta = stats.get("metadata") or {}
    try:
        started = datetime.strptime(stats["started"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    except (KeyError, ValueError):
        started = now
    traffic = [e for e in stats.get("endpoints") or [] if e.get("name") not in CONSOLE_ENDPOINTS]
    requests = sum(int(e.get("num_requests", 0)) for e in traffic)
    busy_ns = sum(int(e.get("processing_time", 0)) for e in traffic)
    errors = [e for e in traffic if e.get("last_error")]
    data = next((e.get("data") for e in stats.get("endpoints") or [] if isinstance(e.get("data"), dict)), {}) or {}
    service = str(stats.get("name", "?")).removeprefix("tandem-")
    instance_id = meta.get("instance_id", stats.get("id", "?"))
    http = http_traffic((snapshots or {}).get((service, instance_id)))
    timed = requests + http.timed
    return ServiceRow(
        service=service, instance_id=instance_id,
        host=meta.get("host", "?"), started=started, requests=requests + http.answers,
        errors=sum(int(e.get("num_errors", 0)) for e in traffic) + http.errors,
        mean_latency_s=(busy_ns / 1e9 + http.busy_s) / timed if timed else 0.0,
        last_error=errors[-1]["last_error"] if errors else "", version=str(stats.get("version", "")), data=data,
    )


@dataclass
class HTTPTraffic:
    """What one instance answered over HTTP, from its metrics snapshot."""

    answers: int = 0
    errors: int = 0  # answers of status 5xx (a client's mistake, 4xx, is no error of the service)
    timed: int = 0  # generation requests whose end-to-end time is known
    busy_s: float = 0.0  # their time together


def http_traffic(snapshot: MetricsSnapshot | None) -> HTTPTraffic:
    if snapshot is None:
        return HTTPTraffic()
    traffic = HTTPTraffic()
    for key, value in snapshot.counters.items():
        if not key.startswith(HTTP_ANSWERS + "{") or any(f'handler="{poll}"' in key for poll in HTTP_POLLS):
            continue
        traffic.answers += int(value)
        if 'status="5' in key:
            traffic.errors += int(value)
    latency = snapshot.histograms.get(HTTP_LATENCY)
    if latency is not None:
        traffic.timed, traffic.busy_s = latency.count, latency.sum
    return traffic


@dataclass(frozen=True)
class WorkerAdapters:
    """A worker's LoRA adapters as its last heartbeat named them: names only (a version changes with
    every publish of a name and says little on screen), most recently used last."""

    slots: int  # --max-loras (0: serves no adapters)
    resident: tuple[str, ...] = ()  # in device slots
    in_host: tuple[str, ...] = ()  # read into host memory (those in slots among them)

    @classmethod
    def of(cls, beat: Heartbeat) -> WorkerAdapters:
        return cls(beat.max_loras, tuple(adapter_name(k) for k in beat.adapters_resident),
                   tuple(adapter_name(k) for k in beat.adapters_host))

    def summary(self) -> str:
        """``used/slots name,name`` for a worker with slots; "-" for one without."""
        if not self.slots:
            return "-"
        names = ",".join(reversed(self.resident))  # most recently used first
        return f"{len(self.resident)}/{self.slots} {names}".rstrip()


def adapter_name(key: str) -> str:
    """An adapter's name from its ``name@version`` key (a name may hold "@", a version never does)."""
    return key.rsplit("@", 1)[0]


@dataclass
class LatencySeries:
    """p50 and p99 of one latency (seconds) per sampling interval, oldest first."""

    p50: deque = field(default_factory=lambda: deque(maxlen=SERIES_POINTS))
    p99: deque = field(default_factory=lambda: deque(maxlen=SERIES_POINTS))
    target_s: float | None = None
    last_total: HistogramSnapshot | None = None


@dataclass
class ConsoleState:
    """What the console knows now; ``version`` goes up with every change so panes redraw only then."""

    url: str | None = None
    follow: str = ""  # the data dir whose `tandem up` the console follows ("": a fixed --nats-url)
    connection: str = "connecting"  # connecting | connected | unreachable | no-url
    connection_error: str = ""
    now: float = 0.0
    services: list[ServiceRow] = field(default_factory=list)
    discovered: bool = False  # at least one discovery round finished
    selected_worker: tuple[str, str] | None = None  # (service, instance id) for the block view
    blocks: dict[str, BlockSnapshot] = field(default_factory=dict)
    blocks_error: str = ""
    kvstores: dict[str, dict] = field(default_factory=dict)  # instance id -> its stats map
    timeline: TrainTimeline | None = None
    train_step: TrainStepMetrics | None = None
    transfers: deque = field(default_factory=lambda: deque(maxlen=200))
    decisions: deque = field(default_factory=lambda: deque(maxlen=100))
    planner_stream: bool | None = None  # None: not looked up yet
    metrics: dict[tuple[str, str], MetricsSnapshot] = field(default_factory=dict)
    adapters: dict[str, WorkerAdapters] = field(default_factory=dict)  # worker instance id -> from its heartbeats
    latency: dict[str, LatencySeries] = field(default_factory=lambda: {k: LatencySeries() for k in LATENCY_KINDS})
    routing: deque = field(default_factory=lambda: deque(maxlen=100))
    version: int = 0

    def changed(self) -> None:
        self.version += 1

    # -- queries the panes share ------------------------------------------------------------------
    def instances(self, *services: str) -> list[ServiceRow]:
        return [s for s in self.services if s.service in services]

    def has(self, service: str) -> bool:
        return any(s.service == service for s in self.services)

    def latest_decision(self) -> ScalingDecision | None:
        return self.decisions[-1] if self.decisions else None

    def latest_routing(self) -> RoutingDecision | None:
        return self.routing[-1] if self.routing else None

    # -- updates the source makes ----------------------------------------------------------------
    def reset(self, url: str | None) -> None:
        """Start afresh on another system (a restarted `tandem up`): nothing the old one said holds.
        In place, since the app and its panes hold this object; ``version`` goes on counting."""
        fresh = ConsoleState(url=url, follow=self.follow)
        for f in fields(self):
            if f.name != "version":
                setattr(self, f.name, getattr(fresh, f.name))
        self.changed()

    def forget_live(self) -> None:
        """The bus is gone: drop what only a live answer vouches for (the service rows, KV-store
        stats, block tables, adapters). History (decisions, routing, transfers, latency) stays."""
        self.services, self.kvstores, self.blocks, self.adapters = [], {}, {}, {}
        self.discovered = False
        self.changed()

    def add_decision(self, decision: ScalingDecision) -> None:
        key = (decision.time, decision.prefill_wanted, decision.decode_wanted, decision.reason)
        if any((d.time, d.prefill_wanted, d.decode_wanted, d.reason) == key for d in self.decisions):
            return  # heard live and read back from the stream
        self.decisions.append(decision)
        self.decisions = deque(sorted(self.decisions, key=lambda d: d.time), maxlen=self.decisions.maxlen)
        self.note_targets(decision.inputs)
        self.changed()

    def add_transfer(self, event: KVTransferEvent) -> None:
        self.transfers.append(event)
        self.changed()

    def add_heartbeat(self, beat: Heartbeat) -> None:
        """A worker's beat; the panes redraw only when its adapters changed (beats come every second)."""
        adapters = WorkerAdapters.of(beat)
        if self.adapters.get(beat.instance_id) != adapters:
            self.adapters[beat.instance_id] = adapters
            self.changed()

    def add_metrics(self, snapshot: MetricsSnapshot) -> None:
        self.metrics[(snapshot.service, snapshot.instance_id)] = snapshot
        self.note_targets(snapshot.gauges)
        self.changed()

    def note_targets(self, figures: dict[str, float]) -> None:
        """Targets from any figure named like ``ttft_target_s`` (planner inputs or gauges)."""
        for kind in LATENCY_KINDS:
            for name, value in figures.items():
                if kind in name.lower() and "target" in name.lower():
                    self.latency[kind].target_s = value / 1000 if name.endswith("_ms") else value

    def sample_latency(self) -> None:
        """One sparkline point per latency kind: p50/p99 of what every instance observed since the
        previous sample (histograms are cumulative; names containing ``ttft`` / ``tpot``)."""
        for kind, series in self.latency.items():
            hists = [h for m in self.metrics.values() for name, h in m.histograms.items()
                     if name == LATENCY_METRICS[kind] or kind in name.lower()]
            total = histogram_merge(hists)
            if total is None:
                continue
            window = histogram_delta(total, series.last_total)
            series.last_total = total
            if window.count > 0:
                series.p50.append(histogram_quantile(window, 0.5))
                series.p99.append(histogram_quantile(window, 0.99))
                self.changed()
