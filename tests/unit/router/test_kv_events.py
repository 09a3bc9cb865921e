"""Coalescing of a source's KV events: each block's last change wins, per namespace, in chunks;
the first event clears; sequence numbers count events."""

from __future__ import annotations

from tandem.services.common.kv_event_publisher import KVEventPublisher


def test_reports_coalesce_to_each_blocks_last_change():
    pub = KVEventPublisher(nc=None, service="decode", source="d1")
    (first,) = pub.next_events()
    assert (first.seq, first.cleared, first.stored, first.removed) == (0, True, [], []), "a fresh source clears"
    pub.add("ns", [1, 2, 3], [])
    pub.add("ns", [4], [2])  # 2 stored then evicted within one round
    pub.add("ns", [2], [3])  # ... and stored again; 3 evicted
    (event,) = pub.next_events()
    assert (event.seq, event.cleared, event.namespace) == (1, False, "ns")
    assert sorted(event.stored) == [1, 2, 4] and event.removed == [3]
    assert pub.next_events() == [], "reported changes are not repeated"


def test_namespaces_and_long_lists_split_into_events():
    pub = KVEventPublisher(nc=None, service="kvstore", source="s1", max_hashes=3)
    pub.add("a", list(range(7)), [])
    pub.add("b", [9], [])
    events = pub.next_events()
    assert [(e.namespace, e.seq, e.cleared, e.stored) for e in events] == [
        ("a", 0, True, [0, 1, 2]), ("a", 1, False, [3, 4, 5]), ("a", 2, False, [6]), ("b", 3, False, [9])]
