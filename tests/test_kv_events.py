"""Coalescing of a worker's KV events: each block's last change wins, sequence numbers count events."""

from __future__ import annotations

from tandem.services.kv_event_publisher import KVEventPublisher


def test_reports_coalesce_to_each_blocks_last_change():
    pub = KVEventPublisher(nc=None, service="decode", source="d1", namespace="ns")
    first = pub.next_event()
    assert (first.seq, first.cleared, first.stored, first.removed) == (0, True, [], []), "a fresh source clears"
    pub.add([1, 2, 3], [])
    pub.add([4], [2])  # 2 stored then evicted within one window
    pub.add([2], [3])  # ... and stored again; 3 evicted
    event = pub.next_event()
    assert (event.seq, event.cleared) == (1, False)
    assert sorted(event.stored) == [1, 2, 4] and event.removed == [3]
    assert pub.next_event().stored == [], "reported changes are not repeated"
