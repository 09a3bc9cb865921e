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

Who carries a decision out is the actuator (``--planner-actuator``, :func:`select_actuator`): under
``tandem up`` its supervisor does and the planner only publishes; in a Kubernetes pod or a compose
container the planner itself scales the prefill and decode Deployments or services
(:mod:`.actuator` has the contract), in the background, so decisions keep coming while a drain
takes its time. Scaling down drains first: the actuator names the hosts (pods, containers) to go,
and :meth:`PlannerService.drain_hosts` maps them to the workers beating from there, sends each a
:class:`DrainRequest` and waits until their heartbeats stop, for at most the drain timeout
(``TANDEM_DRAIN_TIMEOUT_S``, the one ``tandem up`` gives a draining worker).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Mapping
from pathlib import Path

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.services.planner.actuator import Actuator, ActuatorError
from tandem.services.planner.kubernetes_actuator import SERVICE_ACCOUNT_DIR, KubernetesActuator, import_client, in_pod
from tandem.services.planner.policy import Decision, Load, Planner, Targets
from tandem.services.planner.window import LoadWindow
from tandem.shared.infra.config import Settings
from tandem.shared.infra.jetstream import ensure_stream
from tandem.shared.infra.liveness import Liveness
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat, MetricsSnapshot, ScaleRequest, ScalingDecision

STREAM_MAX_MSGS = 10_000
SCALED = ("prefill", "decode")  # the services an actuator scales, in the order it does
DRAIN_ASK_S = 2.0  # a worker answers a DrainRequest at once; one that does not is not serving yet
DRAIN_POLL_S = 0.25
FORGET_AFTER_S = 300.0  # a host -> worker entry this long silent is dropped (the map stays small)


def in_compose() -> bool:
    """Whether this is a compose container the Docker actuator can act from (False where that
    actuator is not part of this install)."""
    try:
        from tandem.services.planner.docker_actuator import in_compose_container
    except ImportError:
        return False
    return bool(in_compose_container())


def actuator_kind(settings: Settings, environ: Mapping[str, str] = os.environ,
                  account_dir: Path = SERVICE_ACCOUNT_DIR) -> str:
    """``up``, ``docker`` or ``kubernetes``: ``--planner-actuator`` as given, or for ``auto`` where
    this process runs (a pod with a service account token; a compose container; else under up)."""
    chosen = settings.planner.actuator
    if chosen != "auto":
        return chosen
    if in_pod(environ, account_dir):
        return "kubernetes"
    if in_compose():
        return "docker"
    return "up"


async def make_actuator(kind: str, settings: Settings, environ: Mapping[str, str] = os.environ,
                        account_dir: Path = SERVICE_ACCOUNT_DIR) -> Actuator | None:
    """The actuator of ``kind`` (:func:`actuator_kind`); None for ``up`` (its supervisor acts).
    Raises :class:`ActuatorError` (one line) for one that cannot work here: the package it needs
    missing, no service account in the pod, no Docker socket."""
    if kind == "kubernetes":
        return KubernetesActuator.in_cluster(account_dir, environ)
    if kind == "docker":
        try:
            from tandem.services.planner.docker_actuator import DockerActuator
        except ImportError as exc:
            raise ActuatorError(f"--planner-actuator docker: the Docker actuator cannot be loaded ({exc})") from None
        return await DockerActuator.from_environment()
    return None


async def select_actuator(settings: Settings, environ: Mapping[str, str] = os.environ,
                          account_dir: Path = SERVICE_ACCOUNT_DIR) -> Actuator | None:
    """The actuator that carries the decisions out where this process runs (``--planner-actuator``);
    None under ``tandem up``. Raises :class:`ActuatorError` as :func:`make_actuator` does."""
    kind = await asyncio.to_thread(actuator_kind, settings, environ, account_dir)  # the compose check blocks
    return await make_actuator(kind, settings, environ, account_dir)


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

    def __init__(self, settings: Settings, actuator: Actuator | None = None, actuator_kind: str = "up") -> None:
        """``actuator``: the one to use; else one of ``actuator_kind`` is made once connected (the
        Docker one needs the event loop), ``up`` making none."""
        super().__init__(settings)
        self.actuator = actuator
        self.actuator_kind = actuator_kind
        # The prefill and decode workers' last heartbeats (which host each beats from), for drains.
        self.beats: Liveness[Heartbeat] = Liveness(settings.bus.worker_timeout_s)
        self.target: dict[str, int] = {}  # what the actuator is to bring the platform to
        self.acting: asyncio.Task | None = None
        self.act_failed = False  # a step failed: tried again at the next interval
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
        if self.actuator is None and self.actuator_kind != "up":
            try:
                self.actuator = await make_actuator(self.actuator_kind, self.settings)
            except ActuatorError as exc:  # asked for explicitly or found by auto: acting is this planner's job
                raise SystemExit(f"tandem serve planner: {exc}") from None
        if self.actuator is None:
            self.log.info("decisions are published only: tandem up's supervisor carries them out")
        else:
            self.log.info("decisions are carried out through %s", self.actuator.where)
        self.spawn(self.loop(), "planner loop")

    async def teardown(self) -> None:
        if self.acting is not None:  # a step cut short leaves at most a mark, which the next step clears
            self.acting.cancel()
            await asyncio.gather(self.acting, return_exceptions=True)
        if self.actuator is not None:
            await self.actuator.close()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service=self.name, instance_id=self.instance_id, host=self.host, pid=os.getpid(),
                         incarnation=self.incarnation, model="")

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
            beat = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        self.window.add_heartbeat(beat)
        if beat.service in SCALED:
            self.beats.beat(beat.instance_id, beat, incarnation=beat.incarnation)

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
                    self.actuate(decision)
                elif decision.reason.split()[0] != self.last_reason:  # one line when a hold starts
                    self.log.info("holding prefill %d, decode %d: %s", decision.prefill, decision.decode,
                                  decision.reason)
                self.last_reason = "" if decision.changed else decision.reason.split()[0]
            if self.act_failed and (self.acting is None or self.acting.done()):
                self.act_failed = False
                self.actuate()
            await asyncio.sleep(interval)

    async def on_scale(self, request) -> None:
        msg: ScaleRequest = decode(request.data, ScaleRequest)
        load = self.window.load()
        if self.planner.prefill is None:  # no decision yet: start from what runs
            self.planner.prefill, self.planner.decode = self.planner.clamp(load.prefill_workers, load.decode_workers)
        decision = self.planner.request(msg.prefill, msg.decode, msg.reason, time.monotonic())
        await request.respond(encode(await self.publish(decision, load)))
        if decision.changed:
            self.actuate(decision)

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

    # -- carrying decisions out ---------------------------------------------------------------------
    def actuate(self, decision: Decision | None = None) -> None:
        """Have the actuator bring the platform to ``decision`` (None: the last one again), in the
        background; a decision made meanwhile is taken up when the step under way ends."""
        if self.actuator is None:
            return
        if decision is not None:
            self.target = {"prefill": decision.prefill, "decode": decision.decode}
        if self.target and (self.acting is None or self.acting.done()):
            self.acting = self.spawn(self._act(), "actuator", in_flight=False)

    async def _act(self) -> None:
        while True:
            target = dict(self.target)
            for service in SCALED:
                try:
                    running = await self.actuator.scale(service, target[service],
                                                        functools.partial(self.drain_hosts, service))
                except ActuatorError as exc:
                    self.act_failed = True
                    self.log.warning("%s: %s not scaled to %d (tried again in %.0fs): %s", self.actuator.where,
                                     service, target[service], self.settings.planner.interval_s, exc)
                    continue
                self.log.info("%s: %s at %d replicas", self.actuator.where, service, running)
            if self.target == target:
                return

    def workers_on(self, service: str, hosts: list[str]) -> dict[str, str]:
        """The live workers of ``service`` on ``hosts``, from their heartbeats: instance id -> host."""
        self.beats.forget_stale(FORGET_AFTER_S)
        wanted = set(hosts)
        return {instance: beat.host for instance, beat in self.beats.alive().items()
                if beat.service == service and beat.host in wanted}

    def gone(self, instance: str) -> bool:
        """Whether ``instance`` stopped beating ``worker_timeout_s`` ago (or was never heard from)."""
        return not self.beats.is_alive(instance)

    async def drain_hosts(self, service: str, hosts: list[str]) -> list[str]:
        """The actuator's ``drain``: send every ``service`` worker beating from ``hosts`` a
        :class:`DrainRequest` and wait until their heartbeats stop, at most ``TANDEM_DRAIN_TIMEOUT_S``;
        returns the hosts left with no worker (one with none to begin with among them)."""
        workers = self.workers_on(service, hosts)
        for host in sorted(set(hosts) - set(workers.values())):
            self.log.info("drain: no %s worker beats from %s; nothing to drain there", service, host)

        async def ask(instance: str, host: str) -> None:
            try:
                await self.nc.request(subjects.drain(service, instance), encode(DrainRequest()), timeout=DRAIN_ASK_S)
                self.log.info("drain: %s %s on %s asked to drain and exit", service, instance, host)
            except (NoRespondersError, NatsTimeoutError):
                self.log.info("drain: %s %s on %s did not answer (not serving yet); it stops with its host",
                              service, instance, host)

        await asyncio.gather(*(ask(instance, host) for instance, host in workers.items()))
        timeout_s = self.settings.supervisor.drain_timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = set(workers)
        while waiting:
            for instance in [i for i in waiting if self.gone(i)]:
                waiting.discard(instance)
                self.log.info("drain: %s %s on %s left", service, instance, workers[instance])
            if not waiting or time.monotonic() >= deadline:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        for instance in sorted(waiting):
            self.log.warning("drain: %s %s on %s still beating %.0fs after the drain request", service, instance,
                             workers[instance], timeout_s)
        busy = {workers[i] for i in waiting}
        return [host for host in hosts if host not in busy]


def main(settings: Settings) -> None:
    kind = actuator_kind(settings)
    if kind == "kubernetes":  # before connecting: a missing package is one line naming the extra
        try:
            import_client()
        except ActuatorError as exc:
            raise SystemExit(f"tandem serve planner: {exc}") from None
    run_service(PlannerService(settings, actuator_kind=kind))
