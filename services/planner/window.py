"""The planner's view of the load: MetricsSnapshots and heartbeats over a sliding window.

Counters and histograms are differenced per instance between the oldest snapshot inside the window
(or the last one before it) and the newest, and rates are each instance's delta over its own time
span, summed over instances. Gauges are the newest values. Worker counts come from heartbeats seen
within ``stale_s`` that are not draining. The measured prefill throughput (prompt tokens per busy
second of a prefill worker) is remembered between windows, so a quiet window does not forget it.
"""

from __future__ import annotations

import time
from collections import deque

from tandem.services.planner.policy import Load
from tandem.shared.infra.metrics import histogram_delta, histogram_merge, histogram_quantile
from tandem.shared.protocol.fleet import Heartbeat, HistogramSnapshot, MetricsSnapshot

MIN_BUSY_S = 0.05  # less busy time than this in a window measures nothing


class LoadWindow:
    def __init__(self, window_s: float, stale_s: float) -> None:
        self.window_s, self.stale_s = window_s, stale_s
        self.snaps: dict[tuple[str, str], deque[tuple[float, MetricsSnapshot]]] = {}
        self.beats: dict[str, tuple[float, Heartbeat]] = {}
        self.prefill_tokens_per_s = 0.0

    def add_snapshot(self, snap: MetricsSnapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        history = self.snaps.setdefault((snap.service, snap.instance_id), deque())
        history.append((now, snap))
        while len(history) > 2 and history[1][0] <= now - self.window_s:
            history.popleft()  # keep one snapshot at or before the window's start

    def add_heartbeat(self, beat: Heartbeat, now: float | None = None) -> None:
        self.beats[beat.instance_id] = (time.monotonic() if now is None else now, beat)

    def workers(self, service: str, now: float) -> int:
        return sum(1 for seen, b in self.beats.values()
                   if b.service == service and not b.draining and now - seen < self.stale_s)

    def _live(self, service: str, now: float) -> list[deque]:
        for key in [k for k, h in self.snaps.items() if now - h[-1][0] > max(self.stale_s, self.window_s)]:
            del self.snaps[key]  # an instance that went away
        return [h for (s, _), h in self.snaps.items() if s == service and now - h[-1][0] <= self.stale_s * 4]

    def _delta(self, service: str, key: str, now: float) -> tuple[float, float]:
        """(sum of counter deltas, sum of per-instance rates) over the window."""
        total, rate = 0.0, 0.0
        for h in self._live(service, now):
            (_, old), (_, new) = h[0], h[-1]
            span = new.time - old.time
            d = new.counters.get(key, 0.0) - old.counters.get(key, 0.0)
            total += d
            rate += d / span if span > 0 else 0.0
        return total, rate

    def _span(self, service: str, now: float) -> float:
        return sum(h[-1][1].time - h[0][1].time for h in self._live(service, now))

    def _hist(self, services: tuple[str, ...], key: str, now: float) -> HistogramSnapshot | None:
        parts = []
        for service in services:
            for h in self._live(service, now):
                new = h[-1][1].histograms.get(key)
                if new is not None:
                    parts.append(histogram_delta(new, h[0][1].histograms.get(key)) if len(h) > 1 else None)
        return histogram_merge(p for p in parts if p is not None)

    def _gauges(self, service: str, key: str, now: float) -> list[float]:
        return [h[-1][1].gauges.get(key, 0.0) for h in self._live(service, now)]

    def load(self, now: float | None = None) -> Load:
        now = time.monotonic() if now is None else now
        prompts = self._hist(("router",), "tandem:router_request_prompt_tokens", now)
        outputs = self._hist(("router",), "tandem:router_request_max_tokens", now)
        span = self._span("router", now)
        requests = prompts.count if prompts else 0
        tokens, _ = self._delta("prefill", "tandem:prompt_tokens_total", now)
        busy, _ = self._delta("prefill", "tandem:engine_busy_seconds_total", now)
        if busy >= MIN_BUSY_S and tokens > 0:
            measured = tokens / busy
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = measured if not old else 0.5 * old + 0.5 * measured
        prefill_span = self._span("prefill", now)
        ttft = self._hist(("prefill", "decode"), "tandem:time_to_first_token_seconds", now)
        itl = self._hist(("decode",), "tandem:inter_token_latency_seconds", now)
        return Load(
            request_rate=requests / span if span > 0 else 0.0,
            prompt_tokens_rate=prompts.sum / span if prompts and span > 0 else 0.0,
            mean_prompt_len=prompts.sum / requests if requests else 0.0,
            mean_output_len=outputs.sum / outputs.count if outputs and outputs.count else 0.0,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            prefill_busy=busy / prefill_span if prefill_span > 0 else 0.0,
            prefill_waiting=int(sum(self._gauges("prefill", "tandem:num_requests_waiting", now))),
            decode_running=int(sum(self._gauges("decode", "tandem:num_requests_running", now))),
            decode_waiting=int(sum(self._gauges("decode", "tandem:num_requests_waiting", now))),
            kv_usage=max(self._gauges("decode", "tandem:kv_cache_usage_perc", now), default=0.0),
            ttft_p50=histogram_quantile(ttft, 0.5), ttft_p99=histogram_quantile(ttft, 0.99),
            itl_p50=histogram_quantile(itl, 0.5), itl_p99=histogram_quantile(itl, 0.99),
            prefill_workers=self.workers("prefill", now), decode_workers=self.workers("decode", now),
        )
