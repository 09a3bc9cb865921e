"""The router's part in LoRA adapters: which names it serves, loading and unloading them, and what an
adapter adds to a worker's placement cost.

A request's ``model`` is the served model's name (the base) or an adapter's from the registry
(``shared/infra/adapter_registry.py``); anything else is ``unknown_model``. Loads and unloads arrive
on ``tandem.v1.router.adapters`` (one router of the queue group takes each): the router checks the
adapter's directory against the served model (config and tensor shapes, no weights read) before it
publishes the record, so a bad adapter is refused in one line before any request names it. Adapters
given by ``--router-lora-modules`` are published the same way when the router starts.

Placement: only workers with adapter slots (heartbeat ``max_loras``) and a rank limit at least the
adapter's take its requests; among them a worker holding the adapter in a slot costs nothing more, one
holding it in host memory a little (a copy into a slot), one without it more (a read from disk),
in blocks of prefill as the rest of the cost (``policy.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tandem.shared.infra.adapter_registry import AdapterRegistry, publish_adapter_record
from tandem.shared.infra.config import lora_modules
from tandem.shared.lora.peft_format import AdapterError, adapter_digest, check_adapter
from tandem.shared.model.config import ModelConfig
from tandem.shared.protocol.adapters import AdapterRecord, AdapterRef, LoadAdapter, UnloadAdapter
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.fleet import Heartbeat

# What an adapter the worker lacks costs its placement, in blocks of prefill (policy.py's unit).
ADAPTER_IN_HOST_COST = 1.0  # a copy from host memory into a slot
ADAPTER_ON_DISK_COST = 8.0  # a read of the PEFT directory, then the copy


class RouterAdapters:
    def __init__(self, base_model: str, config: ModelConfig, log: logging.Logger) -> None:
        self.base_model, self.config, self.log = base_model, config, log
        self.registry = AdapterRegistry(on_change=self._changed)
        self.nc = None

    async def start(self, nc, modules: str, rank_limit: Callable[[], int | None]) -> None:  # noqa: ANN001
        """Follow the registry, then publish ``--router-lora-modules`` (a bad one is logged and skipped)."""
        self.nc = nc
        await self.registry.follow(nc)
        for name, path in lora_modules(modules):
            try:
                record = await self.load(LoadAdapter(name=name, path=path, source="lora-modules"), rank_limit())
            except (ProtocolError, ValueError) as exc:
                self.log.error("--lora-modules %s=%s not served: %s", name, path, getattr(exc, "message", exc))
                continue
            self.log.info("serving adapter %s (rank %d, %s) from %s", record.name, record.rank,
                          ",".join(record.targets), record.path)

    def _changed(self, record: AdapterRecord) -> None:
        if record.base_model == self.base_model:
            self.log.info("adapter %s %s (version %s, %s)", record.name, "removed" if record.removed else "published",
                          record.version, record.source)

    def resolve(self, model: str | None) -> AdapterRecord | None:
        """The adapter a request's ``model`` names (None: the base model); ``unknown_model`` otherwise."""
        if not model or model == self.base_model:
            return None
        record = self.registry.lookup(model)
        if record is not None and record.base_model == self.base_model:
            return record
        served = [self.base_model, *(r.name for r in self.registry.served(self.base_model))]
        shown = ", ".join(repr(name) for name in served[:8]) + (" ..." if len(served) > 8 else "")
        raise ProtocolError(ErrorCode.UNKNOWN_MODEL, f"unknown model {model!r}; this router serves {shown}", "model")

    async def load(self, msg: LoadAdapter, rank_limit: int | None) -> AdapterRecord:
        """Check the adapter at ``msg.path`` against the served model and publish its record."""
        if msg.name == self.base_model:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{msg.name!r} is the base model's name; give the adapter "
                                "another", "lora_name")
        if not self.registry.available:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "adapters need JetStream on the bus (nats-server -js)")
        try:
            adapter = await asyncio.to_thread(check_adapter, msg.path, self.config, rank_limit)
            version = msg.version or await asyncio.to_thread(adapter_digest, msg.path)
        except AdapterError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc), "lora_path") from None
        current = self.registry.lookup(msg.name)
        if current is not None and (current.version, current.path) == (version, msg.path):
            return current  # the same adapter again (a restarted router's --lora-modules): nothing new
        record = AdapterRecord(name=msg.name, version=version, path=msg.path, base_model=self.base_model,
                               rank=adapter.rank, targets=list(adapter.targets), source=msg.source,
                               published_at=time.time())
        await publish_adapter_record(self.nc.jetstream(), record)
        self.registry.apply(record)  # this router places by it at once; the stream echoes it later
        return record

    async def unload(self, msg: UnloadAdapter) -> AdapterRecord:
        current = self.registry.lookup(msg.name)
        if current is None or current.base_model != self.base_model:
            raise ProtocolError(ErrorCode.UNKNOWN_MODEL, f"no adapter {msg.name!r} is served", "lora_name")
        record = current.model_copy(update={"removed": True, "published_at": time.time()})
        await publish_adapter_record(self.nc.jetstream(), record)
        self.registry.apply(record)
        return record

    @staticmethod
    def serves(beat: Heartbeat, record: AdapterRecord) -> bool:
        return beat.max_loras > 0 and beat.max_lora_rank >= record.rank

    @staticmethod
    def extra_cost(beat: Heartbeat, adapter: AdapterRef | None) -> float:
        if adapter is None or adapter.key in beat.adapters_resident:
            return 0.0
        return ADAPTER_IN_HOST_COST if adapter.key in beat.adapters_host else ADAPTER_ON_DISK_COST

