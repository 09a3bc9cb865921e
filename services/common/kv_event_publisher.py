"""Publishing one source's KV events into the JetStream stream, in order and coalesced.

Workers report blocks stored and removed after every engine step, a KV-store after every
operation; publishing each report as its own persisted event would cost a stream write and an ack
round trip each. Instead reports pile up while a publish is in flight (at most one round every
``min_interval_s``) and go out as one event per namespace that keeps each block's last change: a
block stored then removed within one round is reported removed, which a router holding nothing
for it ignores. Long lists are cut into events of ``max_hashes``. The first event of a source
says ``cleared`` (whatever this source id held before is gone). Sequence numbers count events, so
a router sees the gap when one is lost.
"""

from __future__ import annotations

import asyncio
import logging

from tandem.shared.infra.kvevents import ensure_kv_events_stream, publish_kv_event
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.kv import KVEvent

log = logging.getLogger("tandem.kvevents")


class KVEventPublisher:
    def __init__(self, nc, service: str, source: str, min_interval_s: float = 0.05, max_hashes: int = 4096) -> None:
        self.nc, self.service, self.source = nc, service, source
        self.min_interval_s, self.max_hashes = min_interval_s, max_hashes
        self.seq = 0
        self.published = self.failed = 0
        self._changes: dict[str, dict[int, bool]] = {}  # namespace -> block hash -> held after its last change
        self._cleared = True
        self._wake = asyncio.Event()
        self._wake.set()

    def add(self, namespace: str, stored: list[int], removed: list[int]) -> None:
        """Record one report (stored and removed never overlap within a report)."""
        changes = self._changes.setdefault(namespace, {})
        changes.update(dict.fromkeys(stored, True))
        changes.update(dict.fromkeys(removed, False))
        self._wake.set()

    def next_events(self) -> list[KVEvent]:
        pending, self._changes = self._changes, {}
        if not pending and self._cleared:
            pending = {"": {}}  # nothing held yet: announce the clear alone
        events = []
        for namespace, changes in pending.items():
            stored = [h for h, held in changes.items() if held]
            removed = [h for h, held in changes.items() if not held]
            for i in range(0, max(len(stored), len(removed), 1), self.max_hashes):
                events.append(KVEvent(source=self.source, service=self.service, namespace=namespace, seq=self.seq,
                                      stored=stored[i : i + self.max_hashes], removed=removed[i : i + self.max_hashes],
                                      cleared=self._cleared))
                self._cleared = False
                self.seq += 1
        return events

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
            for event in self.next_events():
                await self._publish(js, event)
            await asyncio.sleep(self.min_interval_s)

    async def _publish(self, js, event: KVEvent) -> None:
        try:
            if js is None:
                raise ConnectionError("no JetStream")
            await publish_kv_event(js, event)
        except Exception as exc:
            if js is not None:
                log.warning("KV event %d not persisted (%s); publishing it plainly", event.seq, exc)
            try:
                await self.nc.publish(subjects.kv_events(self.service, self.source), encode(event))
            except Exception:
                self.failed += 1  # lost: the seq gap tells readers
                return
        self.published += 1
