"""The planner service: decides how many prefill and decode workers to run; a supervisor acts on it.

``tandem serve planner --nats-url URL [--ttft-target-ms 1000] [--tpot-target-ms 100] ...``
(every ``--planner-*`` setting in :mod:`tandem.shared.infra.config`). It follows every service's
:class:`MetricsSnapshot` (``tandem.v1.metrics.>``) and heartbeats, and every ``planner_interval_s``
turns the last ``planner_window_s`` of them into a :class:`Load` (``window.py``) and a decision
(``policy.py``: the formulas, hysteresis and cooldown). Its first wanted counts are the live
ones it sees (start it once the workers are up, as ``tandem up`` does). A change of the wanted counts
goes out as a :class:`ScalingDecision` on ``tandem.v1.planner.decisions``, which the JetStream
stream ``TANDEM_PLANNER`` keeps for the console's history; every decision is logged.
``tandem.v1.planner.scale`` takes an operator's :class:`ScaleRequest` and replies the decision it made.
"""

from __future__ import annotations

import asyncio
import os
import time

from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.services.planner.policy import Decision, Load, Planner, Targets
from tandem.services.planner.window import LoadWindow
from tandem.shared.infra.config import Settings
from tandem.shared.infra.streams import ensure_stream
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat, MetricsSnapshot, ScaleRequest, ScalingDecision

STREAM_MAX_MSGS = 10_000


def targets_from(settings: Settings) -> Targets:
    return Targets(
        ttft_s=settings.planner.ttft_target_ms / 1e3, tpot_s=settings.planner.tpot_target_ms / 1e3,
        kv_usage=settings.planner.kv_usage_target, scale_down_margin=settings.planner.scale_down_margin,
        cooldown_s=settings.planner.cooldown_s, prefill_tokens_per_s=settings.planner.prefill_tokens_per_s,
        min_prefill=settings.planner.min_prefill,
        max_prefill=max(settings.planner.max_prefill, settings.planner.min_prefill),
        min_decode=settings.planner.min_decode,
        max_decode=max(settings.planner.max_decode, settings.planner.min_decode),
    )


async def ensure_planner_stream(js) -> None:
    """Create the decisions stream unless it exists (idempotent)."""
    config = StreamConfig(name=subjects.PLANNER_STREAM, subjects=[subjects.PLANNER_DECISIONS],
                          storage=StorageType.FILE, max_msgs=STREAM_MAX_MSGS, discard=DiscardPolicy.OLD,
                          description="the planner's scaling decisions, for the console's history")
    await ensure_stream(js, config)


class PlannerService(ServiceRuntime):
    name = "planner"
    description = "decides prefill and decode worker counts from live metrics against TTFT/TPOT targets"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.window = LoadWindow(settings.planner.window_s, stale_s=settings.bus.worker_timeout_s)
        self.planner = Planner(targets_from(settings))
        self.js = None
        self.decisions = 0
        self.last_reason = ""
        wanted = lambda: {("prefill",): self.planner.prefill or 0, ("decode",): self.planner.decode or 0}  # noqa: E731
        self.prom.gauge_fn("tandem:planner_wanted_workers", "workers the planner wants", wanted, ["service"])
        self.decision_counter = self.prom.counter("tandem:planner_decisions_total", "scaling decisions published")

    async def setup(self) -> None:
        try:
            self.js = self.nc.jetstream()
            await ensure_planner_stream(self.js)
        except Exception as exc:  # a server without JetStream: decisions on the subject only
            self.log.warning("planner stream unavailable (%s); decisions are not kept", exc)
            self.js = None
        await self.nc.subscribe(subjects.METRICS_ALL, cb=self.on_snapshot)
        await self.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.on_heartbeat)
        await self.add_endpoint("scale", subjects.PLANNER_SCALE, self.on_scale)
        self.spawn(self.loop(), "planner loop")

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service=self.name, instance_id=self.instance_id, host=self.host, pid=os.getpid(), model="")

    def metrics(self) -> dict:
        return {"prefill_wanted": self.planner.prefill, "decode_wanted": self.planner.decode,
                "decisions": self.decisions}

    async def on_snapshot(self, msg) -> None:
        try:
            self.window.add_snapshot(decode(msg.data, MetricsSnapshot))
        except ProtocolError as exc:
            self.log.warning("ignored bad metrics snapshot on %s: %s", msg.subject, exc)

    async def on_heartbeat(self, msg) -> None:
        try:
            self.window.add_heartbeat(decode(msg.data, Heartbeat))
        except ProtocolError:
            pass

    async def loop(self) -> None:
        interval = self.settings.planner.interval_s
        await asyncio.sleep(interval)  # snapshots and heartbeats arrive meanwhile
        while True:
            now = time.monotonic()
            load = self.window.load(now)
            if load.decode_workers or load.prefill_workers:
                decision = self.planner.decide(load, now)
                if decision.changed:
                    await self.publish(decision, load)
                elif decision.reason.split()[0] != self.last_reason:  # one line when a hold starts
                    self.log.info("holding prefill %d, decode %d: %s", decision.prefill, decision.decode,
                                  decision.reason)
                self.last_reason = "" if decision.changed else decision.reason.split()[0]
            await asyncio.sleep(interval)

    async def on_scale(self, request) -> None:
        msg: ScaleRequest = decode(request.data, ScaleRequest)
        load = self.window.load()
        if self.planner.prefill is None:  # no decision yet: start from what runs
            self.planner.prefill, self.planner.decode = self.planner.clamp(load.prefill_workers, load.decode_workers)
        decision = self.planner.request(msg.prefill, msg.decode, msg.reason, time.monotonic())
        await request.respond(encode(await self.publish(decision, load)))

    async def publish(self, decision: Decision, load: Load) -> ScalingDecision:
        message = ScalingDecision(
            time=time.time(), prefill_current=load.prefill_workers, decode_current=load.decode_workers,
            prefill_wanted=decision.prefill, decode_wanted=decision.decode, reason=decision.reason,
            inputs=decision.inputs,
        )
        payload = encode(message)
        try:
            if self.js is not None:
                await self.js.publish(subjects.PLANNER_DECISIONS, payload, timeout=5.0)
            else:
                await self.nc.publish(subjects.PLANNER_DECISIONS, payload)
        except Exception as exc:  # kept or not, the decision still reaches live subscribers
            self.log.warning("decision not stored in %s (%s)", subjects.PLANNER_STREAM, exc)
            await self.nc.publish(subjects.PLANNER_DECISIONS, payload)
        self.decisions += 1
        self.decision_counter.inc()
        self.log.info("decision: prefill %d -> %d, decode %d -> %d: %s", load.prefill_workers, decision.prefill,
                      load.decode_workers, decision.decode, decision.reason)
        return message


def main(settings: Settings) -> None:
    run_service(PlannerService(settings))
