"""What ``tandem up`` does while it runs: keep the wanted children alive and carry out the planner.

:class:`Scaler` checks the children four times a second:

- a child that exited without being asked to is restarted (a new instance id; the router forgets
  the old one when its heartbeats stop), with a back-off of 0.5 s doubling to 30 s for a service
  that keeps crashing;
- with the planner on, every :class:`ScalingDecision` on ``tandem.v1.planner.decisions`` sets the
  wanted prefill and decode counts, clamped to the supervisor's limits; missing workers are started
  and surplus ones (the newest first) drained: a :class:`DrainRequest` on
  ``tandem.v1.<service>.<id>.drain``, after which the worker takes no new requests, finishes what it
  holds and exits. A worker not serving yet (still loading) is simply stopped; one still draining
  after ``drain_timeout_s`` gets SIGTERM, and SIGKILL 15 s later;
- once a second, when the live children changed (a restart or a scaling step: new instance ids and,
  with free ports, new URLs), their URLs are read again from ``$SRV.INFO`` and the state file
  rewritten, so what it says stays what serves;
- health, not only exit codes: a child that has answered ``$SRV.PING`` (asked every ``PING_S``) or
  sent heartbeats, and then stays silent on both for ``--health-timeout-s``, is off the bus though
  its process lives (a connection closed for good, a hung loop): it is stopped (SIGKILL
  ``HEALTH_KILL_AFTER_S`` after SIGTERM) and replaced. A worker whose heartbeats say it drains
  without the supervisor having asked (an operator's ``DrainRequest``, ``exit`` or not) takes no
  new requests: a replacement starts at once, and the drained one is stopped after
  ``drain_timeout_s`` if it does not leave by itself. A child that exits with code 0 unasked
  (``EXIT_DRAINED``: it drained and left, after a ``DrainRequest`` with ``exit`` or a SIGTERM from
  outside) is no crash: it is replaced without the crash back-off;
- a child that listens on a fixed port (the frontend: the port it was given, or the one its first
  instance got with ``--http-port 0``) is restarted on that port, once it can be listened on: the
  child it replaces may still be leaving;
- the embedded nats-server, if it died, is started again on its port with its JetStream store
  (:meth:`Supervisor.ensure_server`); the children reconnect by themselves.

When ``tandem up`` is told to stop, the loop ends and :mod:`tandem.cli.shutdown` takes over: nothing
is restarted from then on.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import TYPE_CHECKING

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from tandem.cli.shutdown import drain_system
from tandem.client.discovery import service_pongs
from tandem.services.common.runtime import EXIT_DRAINED
from tandem.shared.infra.liveness import Liveness
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat, ScalingDecision

if TYPE_CHECKING:
    from tandem.cli.supervisor import Child, Supervisor

log = logging.getLogger("tandem.cli.up")

TICK_S = 0.25
URLS_S = 1.0
PING_S = 1.0
HEALTH_KILL_AFTER_S = 3.0  # a child off the bus may be hung: it gets less time to honour SIGTERM
KILL_AFTER_S = 15.0
CRASH_WINDOW_S = 60.0


class Scaler:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.crashes: dict[str, list[float]] = {}  # service -> monotonic times of recent crashes
        self.not_before: dict[str, float] = {}  # service -> earliest restart time
        self.decisions = 0
        self.stale_after_s = sup.settings.supervisor.health_timeout_s
        # Every child heard from: its last heartbeat (load, draining), and when it last beat or
        # answered a ping; stale (off the bus) after ``--health-timeout-s``.
        self.heard: Liveness[Heartbeat] = Liveness(self.stale_after_s)
        self.port_waits: dict[str, int] = {}  # service -> the fixed port its next child waits for

    async def run(self) -> None:
        nc = await self.connect()
        if nc is None:  # asked to stop while connecting
            return
        # Only a supervisor that wrote a state file keeps it current (the benchmarks write none).
        tracker = asyncio.create_task(self.track_urls(nc)) if self.sup.state is not None else None
        pinger = asyncio.create_task(self.ping_loop(nc))
        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=self.on_beat)
        try:
            try:
                if self.sup.planner:
                    await nc.subscribe(subjects.PLANNER_DECISIONS, cb=self.on_decision)
                while not self.sup.stop_requested:  # (the signal's KeyboardInterrupt itself can be lost)
                    await self.reconcile(nc)
                    await asyncio.sleep(TICK_S)
            finally:
                pinger.cancel()
                await asyncio.gather(pinger, return_exceptions=True)
                if tracker is not None:
                    tracker.cancel()
                    await asyncio.gather(tracker, return_exceptions=True)
            if not self.sup.stop_now:
                await drain_system(self, nc)
        finally:
            if not nc.is_closed:
                await nc.close()

    async def connect(self) -> nats.NATS | None:
        """The scaler's connection, or None when a stop is asked first: a signal's KeyboardInterrupt
        raised inside the connecting transport's callback is swallowed by the loop, and nats-py's
        first connect then waits on forever (CI saw `up` ignore SIGINT for a minute so)."""
        connecting = asyncio.ensure_future(nats.connect(self.sup.url, max_reconnect_attempts=-1,
                                                        reconnect_time_wait=0.5,
                                                        **self.sup.own_connect_options("tandem-up-scaler")))
        while not connecting.done():
            if self.sup.stop_requested:
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                return None
            await asyncio.wait({connecting}, timeout=0.1)
        return connecting.result()

    def live_ids(self) -> frozenset[str]:
        return frozenset(c.instance_id for c in self.sup.children if c.process.poll() is None)

    async def track_urls(self, nc: nats.NATS) -> None:
        """Rewrite the state file's URLs when the live children change (see the module's docstring)."""
        recorded = self.live_ids()
        while True:
            await asyncio.sleep(URLS_S)
            current = self.live_ids()
            if current == recorded or not nc.is_connected:
                continue
            old_metrics, old_http = dict(self.sup.metrics_urls), self.sup.http_url
            try:
                missing = await self.sup.read_urls(nc)
            except Exception as exc:  # the bus went mid-read: the next round tries again
                log.info("could not read the services' URLs: %s", exc)
                continue
            if self.sup.write_state():  # partial too: the gone instances' URLs leave the file at once
                for instance, url in self.sup.metrics_urls.items():
                    if old_metrics.get(instance) != url:
                        log.info("metrics: %s %s", instance, url)
                if self.sup.http_url != old_http and self.sup.http_url:
                    log.info("HTTP at %s", self.sup.http_url)
            if not missing:  # else a child still starting: read again next round
                recorded = current

    async def on_beat(self, msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        self.heard.beat(beat.instance_id, beat, incarnation=beat.incarnation)

    async def ping_loop(self, nc: nats.NATS) -> None:
        """Which children answer ``$SRV.PING`` (their metadata names their instance id)."""
        while True:
            if nc.is_connected:
                try:
                    pongs = await service_pongs(nc, wait_s=0.3)
                except Exception:  # the bus went mid-ask: the next round asks again
                    pongs = []
                now = time.monotonic()
                for pong in pongs:
                    instance = (pong.get("metadata") or {}).get("instance_id")
                    if instance:
                        self.heard.touch(instance, at=now)
            await asyncio.sleep(PING_S)

    def check_health(self, child: Child, now: float) -> None:
        """Stop a child that went silent on the bus; replace one drained from outside (see the module)."""
        if child.leaving:
            return
        if self.drains_unasked(child):
            log.warning("%s %s is draining, not asked by tandem up; starting a replacement", child.service,
                        child.instance_id)
            child.draining_since = now
            return
        if self.heard.is_stale(child.instance_id, now=now):
            log.warning("%s %s (pid %d) is off the bus: silent for %.0fs; restarting it", child.service,
                        child.instance_id, child.process.pid, now - self.heard.last(child.instance_id))
            self.terminate(child, kill_after_s=HEALTH_KILL_AFTER_S)

    async def on_decision(self, msg) -> None:
        try:
            decision = decode(msg.data, ScalingDecision)
        except ProtocolError as exc:
            log.warning("ignored bad scaling decision: %s", exc)
            return
        self.decisions += 1
        wanted = {"prefill": decision.prefill_wanted, "decode": decision.decode_wanted}
        for service, count in wanted.items():
            lo, hi = self.sup.limits(service)
            count = min(max(count, lo), hi)
            if count != self.sup.wanted.get(service):
                log.info("planner: %s %d -> %d (%s)", service, self.sup.wanted.get(service, 0), count, decision.reason)
                self.sup.wanted[service] = count

    def drains_unasked(self, child: Child) -> bool:
        """Whether ``child``'s last heartbeat says it drains (:meth:`check_health` asks only of a child
        up did not ask to leave)."""
        beat = self.heard.payload(child.instance_id)
        return beat is not None and beat.draining

    def in_flight(self) -> int:
        """Requests the live workers hold, as their last heartbeats say (a prompt being handed off
        counts on both sides)."""
        beats = [self.heard.payload(instance) for instance in self.live_ids()]
        return sum(beat.running + beat.waiting for beat in beats if beat is not None)

    async def reconcile(self, nc: nats.NATS) -> None:
        now = time.monotonic()
        if self.sup.ensure_server():  # every child was cut off meanwhile: give it time to reconnect
            self.heard.refresh(now)
        for child in list(self.sup.children):
            code = child.process.poll()
            if code is None:
                self.check_health(child, now)
                self.hurry(child, now)
                continue
            self.sup.children.remove(child)
            self.sup.forget(child)
            self.heard.forget(child.instance_id)
            if child.leaving:
                log.info("%s %s left (exit code %d)", child.service, child.instance_id, code)
            elif code == EXIT_DRAINED:
                log.info("%s %s left on its own (exit code 0: drained, asked from outside); starting a replacement",
                         child.service, child.instance_id)
            else:
                self.crashed(child, code, now)
        for service, want in self.sup.wanted.items():
            live = [c for c in self.sup.children if c.service == service and not c.leaving]
            if len(live) < want and now >= self.not_before.get(service, 0.0) and self.port_free(service):
                for _ in range(want - len(live)):
                    self.sup.spawn(service)
            for child in reversed(live[want:]):  # the newest go first
                await self.drain(nc, child)

    def port_free(self, service: str) -> bool:
        """Whether a ``service`` child may start now: not while its fixed port (the frontend's) is
        still held, by the child it replaces or by anyone, so the new one starts on that port, where
        clients look for it, instead of failing to bind it and counting as a crash (one line when the
        wait begins and one when it ends)."""
        port = self.sup.port_in_use(service)
        if port is not None:
            if self.port_waits.get(service) != port:
                log.warning("%s: port %d is still in use; its replacement starts once it is free", service, port)
                self.port_waits[service] = port
            return False
        if self.port_waits.pop(service, None) is not None:
            log.info("%s: its port is free again; starting its replacement", service)
        return True

    def crashed(self, child: Child, code: int, now: float) -> None:
        recent = [t for t in self.crashes.get(child.service, []) if now - t < CRASH_WINDOW_S] + [now]
        self.crashes[child.service] = recent
        delay = min(30.0, 0.5 * 2 ** (len(recent) - 1))
        self.not_before[child.service] = now + delay
        log.warning("%s %s (pid %d) exited with code %d; restarting in %.1fs", child.service, child.instance_id,
                    child.process.pid, code, delay)

    async def drain(self, nc: nats.NATS, child: Child) -> None:
        child.draining_since = time.monotonic()
        try:
            await nc.request(subjects.drain(child.service, child.instance_id), encode(DrainRequest()), timeout=2.0)
        except (NoRespondersError, NatsTimeoutError):
            log.info("stopping %s %s: not serving yet", child.service, child.instance_id)
            self.terminate(child)
            return
        log.info("draining %s %s", child.service, child.instance_id)

    def hurry(self, child: Child, now: float) -> None:
        """SIGTERM a drain that takes too long, SIGKILL a stop that does."""
        if child.stop_sent is not None:
            if now - child.stop_sent > (child.kill_after_s or KILL_AFTER_S):
                log.warning("%s %s ignored SIGTERM; killing it", child.service, child.instance_id)
                child.process.kill()
            return
        drain_timeout_s = self.sup.settings.supervisor.drain_timeout_s
        if child.draining_since is not None and now - child.draining_since > drain_timeout_s:
            log.warning("%s %s still busy %.0fs into its drain; stopping it", child.service, child.instance_id,
                        now - child.draining_since)
            self.terminate(child)

    def terminate(self, child: Child, kill_after_s: float = KILL_AFTER_S) -> None:
        child.stop_sent = time.monotonic()
        child.kill_after_s = kill_after_s
        child.process.send_signal(signal.SIGTERM)
