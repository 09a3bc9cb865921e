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
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, Heartbeat

if TYPE_CHECKING:
    from tandem.services.common.worker import EngineWorker

POLL_S = 0.05


class Drainer:
    """The drain endpoint and procedure of one :class:`EngineWorker`."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.owed: dict[str, float] = {}  # prefill workers that still owe this worker a hand-off -> last seen
        self._sub = None

    async def register(self) -> None:
        w = self.worker
        await w.add_endpoint("drain", subjects.drain(w.name, w.instance_id), self.on_drain)

    async def on_drain(self, request) -> None:
        msg: DrainRequest = decode(request.data, DrainRequest)
        w = self.worker
        if not w.draining:
            w.draining = True
            w.log.info("draining: no new requests; finishing %d held", len(w.streams))
            beat = w.heartbeat()
            if beat is not None:  # tell the routers now, not at the next beat
                await w.nc.publish(subjects.heartbeat(w.name, w.instance_id), encode(beat))
            w.spawn(self.drain(msg.exit), "drain")
        await request.respond(encode(Ack()))

    async def drain(self, exit_after: bool) -> None:
        w = self.worker
        grace = max(1.0, 2 * w.settings.bus.heartbeat_interval_s)
        if w.name == "decode":
            self._sub = await w.nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_beat)
        await asyncio.sleep(grace)  # requests placed before the routers saw the flag arrive meanwhile
        idle_since = None
        while True:
            now = time.monotonic()
            if self.busy(now):
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= grace:
                break
            await asyncio.sleep(POLL_S)
        if self._sub is not None:
            await self._sub.unsubscribe()
        w.log.info("drained%s", ": exiting" if exit_after else "; staying idle")
        if exit_after:
            w.request_stop()

    def busy(self, now: float) -> bool:
        timeout = self.worker.settings.bus.worker_timeout_s
        owed = any(now - seen < timeout for seen in self.owed.values())
        return owed or self.worker.busy()

    async def _on_beat(self, msg) -> None:
        try:
            beat = decode(msg.data, Heartbeat)
        except ProtocolError:
            return
        if beat.service != "prefill":
            return
        if self.worker.instance_id in beat.pending_decode:
            self.owed[beat.instance_id] = time.monotonic()
        else:
            self.owed.pop(beat.instance_id, None)
