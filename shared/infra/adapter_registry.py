"""The fleet's LoRA adapters: the JetStream stream that keeps one :class:`AdapterRecord` per name,
publishing into it, and following it.

Routers publish (they check an adapter against the served model first: ``LoadAdapter``); routers and
front ends follow. The stream keeps only the last record per name, so a process that starts late
replays exactly the adapters served now (a removed one's record says so) and then follows live::

    registry = AdapterRegistry()
    await registry.follow(nc)              # replayed to the end before it returns
    registry.lookup("sql-lora")            # the live record, or None
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from tandem.shared.infra.jetstream import ensure_stream
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import AdapterRecord
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode, encode

log = logging.getLogger("tandem.adapters")


def adapters_stream_config() -> StreamConfig:
    return StreamConfig(
        name=subjects.ADAPTERS_STREAM, subjects=[subjects.ADAPTERS_ALL], storage=StorageType.FILE,
        max_msgs_per_subject=1, discard=DiscardPolicy.OLD,
        description="the LoRA adapters the fleet serves: the last record per adapter name",
    )


async def ensure_adapters_stream(js: JetStreamContext) -> None:
    await ensure_stream(js, adapters_stream_config())


async def publish_adapter_record(js: JetStreamContext, record: AdapterRecord, timeout_s: float = 5.0) -> None:
    """Publish ``record`` and wait until JetStream has stored it."""
    await js.publish(subjects.adapter_record(record.name), encode(record), timeout=timeout_s)


class AdapterRegistry:
    """The adapters served now, by name, as the stream says; ``on_change(record)`` hears each update."""

    def __init__(self, on_change: Callable[[AdapterRecord], None] | None = None) -> None:
        self.records: dict[str, AdapterRecord] = {}
        self.on_change = on_change
        self._seen_seq = 0
        self.available = False  # False: no JetStream (adapters cannot be published or found)

    def lookup(self, name: str) -> AdapterRecord | None:
        return self.records.get(name)

    def served(self, base_model: str) -> list[AdapterRecord]:
        """The live adapters of ``base_model``, by name."""
        return sorted((r for r in self.records.values() if r.base_model == base_model), key=lambda r: r.name)

    async def follow(self, nc, catch_up_timeout_s: float = 10.0) -> None:  # noqa: ANN001 - a nats Client
        """Replay the stream, then follow it live; returns once the replay reached the stream's end as
        of the call (or the timeout passed). Without JetStream, logs it and follows nothing."""
        js = nc.jetstream()
        try:
            await ensure_adapters_stream(js)
            last = (await js.stream_info(subjects.ADAPTERS_STREAM)).state.last_seq
            await js.subscribe(subjects.ADAPTERS_ALL, stream=subjects.ADAPTERS_STREAM, cb=self._on_record,
                               ordered_consumer=True)
        except Exception as exc:
            log.warning("adapter registry unavailable (%s): no LoRA adapters can be served", exc)
            return
        self.available = True
        deadline = time.monotonic() + catch_up_timeout_s
        while self._seen_seq < last and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _on_record(self, msg) -> None:  # noqa: ANN001
        try:
            self._seen_seq = max(self._seen_seq, msg.metadata.sequence.stream)
        except Exception:  # not a stream message: nothing to count
            pass
        try:
            record = decode(msg.data, AdapterRecord)
        except ProtocolError as exc:
            log.warning("ignored a bad adapter record: %s", exc)
            return
        self.apply(record)

    def apply(self, record: AdapterRecord) -> None:
        if record.removed:
            self.records.pop(record.name, None)
        else:
            self.records[record.name] = record
        if self.on_change is not None:
            self.on_change(record)
