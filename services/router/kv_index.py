"""The router's index of which worker or store holds which KV blocks, built from KV events.

Every decode worker, prefill worker and KV-store publishes :class:`KVEvent` messages (blocks
stored, blocks removed, all cleared) into the JetStream stream ``TANDEM_KV_EVENTS``. The router
applies them here, from the start of the stream when it starts (so a restarted router routes as
the old one did) and live after that. Applying an event twice changes nothing, so a replay that
overlaps live delivery is harmless.

Invariant: ``holders[(namespace, hash)]`` is exactly the set of sources whose latest events say
they hold that block; a source that leaves (no heartbeat) or clears is removed everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.shared.infra.log_limit import LimitedLog
from tandem.shared.protocol.kv import KVEvent

log = logging.getLogger("tandem.router.index")
limited = LimitedLog(log)


@dataclass
class Source:
    service: str
    last_seq: int = -1
    blocks: dict[str, set[int]] = field(default_factory=dict)  # namespace -> hashes (a store holds several)


class KVIndex:
    """Block hash -> holders, per namespace, with per-source bookkeeping for clears and gaps."""

    def __init__(self) -> None:
        self.holders: dict[tuple[str, int], set[str]] = {}
        self.sources: dict[str, Source] = {}
        self.gaps = 0  # events lost somewhere (a source's seq jumped): the index may be stale

    def apply(self, event: KVEvent) -> None:
        source = self.sources.get(event.source)
        if source is None or event.cleared:
            self.forget(event.source)
            source = self.sources[event.source] = Source(event.service)
        if event.seq <= source.last_seq:
            return  # a replayed event this index has already applied
        if source.last_seq >= 0 and event.seq != source.last_seq + 1:
            self.gaps += 1
            limited.warning("kv event gaps", "kv events of %s jumped from %d to %d", event.source,
                            source.last_seq, event.seq)
        source.last_seq = event.seq
        held = source.blocks.setdefault(event.namespace, set())
        for block in event.stored:
            held.add(block)
            self.holders.setdefault((event.namespace, block), set()).add(event.source)
        for block in event.removed:
            held.discard(block)
            self._drop(event.namespace, block, event.source)

    def forget(self, source_id: str) -> None:
        """Drop everything ``source_id`` held (it left, restarted or cleared)."""
        source = self.sources.pop(source_id, None)
        if source is None:
            return
        for namespace, blocks in source.blocks.items():
            for block in blocks:
                self._drop(namespace, block, source_id)

    def _drop(self, namespace: str, block: int, source_id: str) -> None:
        holders = self.holders.get((namespace, block))
        if holders is not None:
            holders.discard(source_id)
            if not holders:
                del self.holders[(namespace, block)]

    def prefix_overlap(self, namespace: str, hashes: Sequence[int]) -> dict[str, int]:
        """For every source holding the first block: how many leading blocks of ``hashes`` it holds.

        Only a leading run counts: a block is reusable only if every block before it is too."""
        if not hashes:
            return {}
        alive = set(self.holders.get((namespace, hashes[0]), ()))
        counts = dict.fromkeys(alive, 0)
        for depth, block in enumerate(hashes):
            alive &= self.holders.get((namespace, block), set())
            for source in alive:
                counts[source] = depth + 1
            if not alive:
                break
        return counts

    def num_blocks(self, source_id: str) -> int:
        source = self.sources.get(source_id)
        return sum(len(b) for b in source.blocks.values()) if source else 0

