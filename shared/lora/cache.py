"""Which adapters a worker holds: in host memory (read from their PEFT directories) and in device slots.

Host memory keeps up to ``max_cpu_loras`` adapters, plus any a queued or running sequence still needs
(those are never dropped); device slots hold ``max_loras``, each pinned while a running sequence uses
it, the least recently used unpinned one evicted when a new adapter needs a slot. An adapter can be
read in ahead (``load``, off the engine thread: a worker does it before admitting the request); the
engine's ``hold``/``acquire``/``release`` are then memory copies only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from tandem.shared.lora.peft_format import AdapterError, LoraWeights, load_adapter
from tandem.shared.lora.slots import AdapterSlots
from tandem.shared.model.config import ModelConfig
from tandem.shared.protocol.adapters import AdapterRef


class AdapterCache:
    def __init__(self, config: ModelConfig, slots: AdapterSlots, max_cpu_loras: int = 0,
                 reader: Callable[[str, ModelConfig, int], LoraWeights] | None = None) -> None:
        self.config = config
        self.slots = slots
        self.max_cpu_loras = max_cpu_loras or slots.max_loras
        self._read = reader or (lambda path, cfg, rank: load_adapter(path, cfg, rank))
        self._lock = threading.Lock()  # loads run on worker threads while the engine thread acquires
        self.host: OrderedDict[str, LoraWeights] = OrderedDict()  # least recently used first
        self.host_holds: dict[str, int] = {}  # sequences (queued or running) that need each host copy
        self.slot_of: dict[str, int] = {}
        self.key_in_slot: list[str | None] = [None] * slots.max_loras
        self.slot_refs = [0] * slots.max_loras  # running sequences in each slot
        self.slot_lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(slots.max_loras))
        self.loads = 0  # adapters read from disk
        self.slot_writes = 0  # adapters copied into a slot

    def load(self, adapter: AdapterRef) -> LoraWeights:
        """The adapter's weights, read from its directory unless in host memory; AdapterError when it
        cannot be served (missing, malformed, rank above the limit, targets the model lacks)."""
        with self._lock:
            weights = self.host.get(adapter.key)
            if weights is not None:
                self.host.move_to_end(adapter.key)
                return weights
        weights = self._read(adapter.path, self.config, self.slots.max_rank)
        with self._lock:
            self.host[adapter.key] = weights
            self.host.move_to_end(adapter.key)
            self.loads += 1
            self._trim_host()
        return weights

    def hold(self, adapter: AdapterRef) -> None:
        """A sequence of ``adapter`` is queued: keep its weights in host memory until ``unhold``."""
        self.load(adapter)
        with self._lock:
            self.host_holds[adapter.key] = self.host_holds.get(adapter.key, 0) + 1

    def unhold(self, adapter: AdapterRef) -> None:
        with self._lock:
            left = self.host_holds.get(adapter.key, 0) - 1
            if left > 0:
                self.host_holds[adapter.key] = left
            else:
                self.host_holds.pop(adapter.key, None)
            self._trim_host()

    def _trim_host(self) -> None:
        for key in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if key not in self.host_holds and key not in self.slot_of:
                del self.host[key]

    def can_acquire(self, adapter: AdapterRef) -> bool:
        """Whether a sequence of ``adapter`` can run now: its adapter is in a slot, or a slot is free
        or held by no running sequence."""
        return adapter.key in self.slot_of or any(refs == 0 for refs in self.slot_refs)

    def acquire(self, adapter: AdapterRef) -> int:
        """The slot ``adapter`` is in, put there (evicting the least recently used unpinned slot) if
        needed, pinned once more; AdapterError when every slot is pinned (check ``can_acquire``)."""
        slot = self.slot_of.get(adapter.key)
        if slot is None:
            slot = next((s for s in self.slot_lru if self.slot_refs[s] == 0), None)
            if slot is None:
                raise AdapterError(f"all {self.slots.max_loras} adapter slots are in use; raise --max-loras")
            weights = self.load(adapter)
            evicted = self.key_in_slot[slot]
            if evicted is not None:
                del self.slot_of[evicted]
            self.slots.write(slot, weights)
            self.slot_writes += 1
            self.slot_of[adapter.key], self.key_in_slot[slot] = slot, adapter.key
        self.slot_refs[slot] += 1
        self.slot_lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot >= 0:
            self.slot_refs[slot] -= 1

    def resident(self) -> list[str]:
        """Adapter keys (``name@version``) in device slots, most recently used last."""
        return [self.key_in_slot[s] for s in self.slot_lru if self.key_in_slot[s] is not None]

    def in_host(self) -> list[str]:
        with self._lock:
            return list(self.host)
