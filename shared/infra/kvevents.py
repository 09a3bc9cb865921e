"""The JetStream stream of KV events (:class:`~tandem.shared.protocol.KVEvent`), and publishing into it.

Whoever publishes first creates the stream: every publisher calls :func:`ensure_kv_events_stream`
once at start (idempotent, safe when several race), then :func:`publish_kv_event` per event, which
waits for JetStream's ack so the event is persisted. A router rebuilding its index reads the stream
from the start (each source's last ``cleared`` event onwards is what it holds)::

    js = nc.jetstream()
    await ensure_kv_events_stream(js)
    await publish_kv_event(js, KVEvent(source="kvstore-1", service="kvstore", namespace=ns, seq=0, stored=[h]))
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from tandem.shared.infra.jetstream import ensure_stream
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.kv import KVEvent

STREAM_MAX_BYTES = 1 << 30  # oldest events go first beyond this


def kv_events_stream_config(max_bytes: int = STREAM_MAX_BYTES) -> StreamConfig:
    return StreamConfig(
        name=subjects.KV_EVENTS_STREAM, subjects=[subjects.KV_EVENTS_ALL], storage=StorageType.FILE,
        max_bytes=max_bytes, discard=DiscardPolicy.OLD,
        description="KV blocks stored and removed by every worker and store, for router index rebuilds",
    )


async def ensure_kv_events_stream(js: JetStreamContext, max_bytes: int = STREAM_MAX_BYTES) -> None:
    """Create the KV events stream unless it exists (an existing one is left as configured)."""
    await ensure_stream(js, kv_events_stream_config(max_bytes))


async def publish_kv_event(js: JetStreamContext, event: KVEvent, timeout_s: float = 5.0) -> None:
    """Publish one event into the stream and wait until JetStream has stored it."""
    await js.publish(subjects.kv_events(event.service, event.source), encode(event), timeout=timeout_s)
