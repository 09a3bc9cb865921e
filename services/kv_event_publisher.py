"""Publishing one worker's KV events into the JetStream stream, in order and coalesced.

The engine reports blocks stored and removed after every step; publishing each report as its own
persisted event would cost a stream write and an ack round trip per step. Instead reports pile up
while a publish is in flight (at most one every ``min_interval_s``) and go out as one event that
keeps each block's last change: a block stored then removed in one window is reported removed,
which a router holding nothing for it simply ignores. Sequence numbers count published events, so
the router still sees gaps when events are lost.
"""

from __future__ import annotations

import asyncio
import logging

from tandem.shared import subjects
from tandem.shared.kvevents import ensure_kv_events_stream, publish_kv_event
from tandem.shared.messages import KVEvent, encode

log = logging.getLogger("tandem.kvevents")


class KVEventPublisher:
    def __init__(self, nc, service: str, source: str, namespace: str, min_interval_s: float = 0.05) -> None:
        self.nc, self.service, self.source, self.namespace = nc, service, source, namespace
        self.min_interval_s = min_interval_s
        self.published = 0
        self._changes: dict[int, bool] = {}  # block hash -> held after its last change
        self._cleared = True  # a fresh cache: whatever this source id held before is gone
        self._wake = asyncio.Event()
        self._wake.set()

    def add(self, stored: list[int], removed: list[int]) -> None:
        """Record one engine report (stored and removed never overlap within a report)."""
        self._changes.update(dict.fromkeys(stored, True))
        self._changes.update(dict.fromkeys(removed, False))
        self._wake.set()

    def next_event(self) -> KVEvent:
        changes, self._changes = self._changes, {}
        event = KVEvent(source=self.source, service=self.service, namespace=self.namespace, seq=self.published,
                        stored=[h for h, held in changes.items() if held],
                        removed=[h for h, held in changes.items() if not held], cleared=self._cleared)
        self._cleared = False
        self.published += 1
        return event

    async def run(self) -> None:
        js = self.nc.jetstream()
        try:
            await ensure_kv_events_stream(js)
        except Exception as exc:  # no JetStream on this server: live subscribers still hear events
            log.warning("KV events stream unavailable (%s); publishing without persistence", exc)
            js = None
        while True:
            await self._wake.wait()
            self._wake.clear()
            event = self.next_event()
            try:
                if js is None:
                    raise ConnectionError("no JetStream")
                await publish_kv_event(js, event)
            except Exception as exc:
                if js is not None:
                    log.warning("KV event %d not persisted (%s); publishing it plainly", event.seq, exc)
                await self.nc.publish(subjects.kv_events(self.service, self.source), encode(event))
            await asyncio.sleep(self.min_interval_s)
