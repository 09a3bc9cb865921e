"""Draining a prefill or decode worker before it stops, so that no request is lost.

``tandem.v1.<service>.<id>.drain`` takes a :class:`DrainRequest` (the supervisor sends it before
it removes a worker) and replies :class:`Ack`. From then on:

1. the worker's heartbeats carry ``draining=True`` (one goes out at once), and routers stop
   placing new requests on it; a request a router placed just before still gets served;
2. it finishes what it holds: its streams, and for a prefill worker the KV hand-offs under way.
   A decode worker also waits while any prefill worker's heartbeat lists it in
   ``pending_decode`` (a prompt placed for it is still being prefilled elsewhere);
3. once idle for a grace period (two heartbeats, at least a second), it exits (``exit=True``) or
   stays up and idle.

A worker told to stop (SIGTERM, Ctrl-C, ``tandem up`` shutting down) drains the same way
(:meth:`EngineWorker.drain <tandem.services.common.worker.EngineWorker.drain>`), and what is still
held when its time is up ends with a typed ``shutting_down`` error on its stream (:meth:`Drainer.abandon`),
so a client sees a request fail, never a connection drop (``tandem.client`` places it again when
another worker is there to take it, as after a scale-down).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from tandem.shared.infra.liveness import Liveness
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat

if TYPE_CHECKING:
    from tandem.services.common.worker import EngineWorker

POLL_S = 0.05


class Drainer:
    """The drain endpoint and procedure of one :class:`EngineWorker`."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        # Prefill workers whose last heartbeat said they still owe this worker a hand-off: owing while
        # they beat, not once they stopped (a dead one's hand-off never comes).
        self.owed: Liveness[None] = Liveness(worker.settings.bus.worker_timeout_s)
        self.exiting = False  # a drain will end the process
        self._idle: asyncio.Task | None = None  # one wait for idleness, however many ask for a drain

    async def register(self) -> None:
        w = self.worker
        await w.add_endpoint("drain", subjects.drain(w.name, w.instance_id), self.on_drain)

    async def on_drain(self, request) -> None:
        msg: DrainRequest = decode(request.data, DrainRequest)
        first = await self.begin()
        if first or (msg.exit and not self.exiting):
            self.exiting = self.exiting or msg.exit
            # Not work in flight: a shutdown's own drain waits for the requests, not for this.
            self.worker.spawn(self.drain(msg.exit), "drain", in_flight=False)
        await request.respond(encode(Ack()))

    async def begin(self) -> bool:
        """Take no new requests: the flag in the heartbeats, one sent at once. False if already draining."""
        w = self.worker
        if w.draining:
            return False
        w.draining = True
        w.log.info("draining: no new requests; finishing %d held", len(w.streams))
        beat = w.heartbeat()
        if beat is not None and w.nc.is_connected:  # tell the routers now, not at the next beat
            try:
                await w.nc.publish(subjects.heartbeat(w.name, w.instance_id), encode(beat))
            except Exception as exc:  # the next beat carries the flag all the same
                w.log.info("could not send the draining heartbeat at once: %s", exc)
        return True

    async def drain(self, exit_after: bool) -> None:
        w = self.worker
        await self.idle()
        w.log.info("drained%s", ": exiting" if exit_after else "; staying idle")
        if exit_after:
            w.stop_drained()

    def idle(self) -> asyncio.Future:
        """Resolves once the worker has held nothing for the grace period (see the module's docstring)."""
        if self._idle is None:  # one of the worker's tasks: its shutdown cancels it
            self._idle = self.worker.spawn(self._until_idle(), "wait until idle", in_flight=False)
        return asyncio.shield(self._idle)  # a shutdown that gives up waiting must not end a scale-down's drain

    async def _until_idle(self) -> None:
        w = self.worker
        grace = max(1.0, 2 * w.settings.bus.heartbeat_interval_s)
        sub = await w.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_beat) if w.name == "decode" else None
        try:
            await asyncio.sleep(grace)  # requests placed before the routers saw the flag arrive meanwhile
            idle_since = None
            while True:
                now = time.monotonic()
                if self.busy(now):
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since >= grace:
                    return
                await asyncio.sleep(POLL_S)
        finally:
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # the connection is going: the subscription goes with it
                    pass

    def abandon(self) -> int:
        """End every request still held with a typed error on its stream; returns how many."""
        w = self.worker
        held = list(w.streams.items())
        for request_id, stream in held:
            del w.streams[request_id]  # first: the engine's last output for it is then ignored
            w.send_error(request_id, stream, f"{w.name} worker {w.instance_id} stopped before this request "
                                             "finished (its shutdown timeout ran out)", ErrorCode.SHUTTING_DOWN)
            if w.thread is not None:
                w.thread.abort(request_id)
        return len(held)

    def busy(self, now: float) -> bool:
        return bool(self.owed.alive(now=now)) or self.worker.busy()

    async def _on_beat(self, msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        if beat.service != "prefill":
            return
        if self.worker.instance_id in beat.pending_decode:
            self.owed.beat(beat.instance_id)
        else:
            self.owed.forget(beat.instance_id)
