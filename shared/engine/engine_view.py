"""What a service may use of an engine: the boundary between ``shared/engine`` and the services.

A worker holds an ``LLMEngine`` but uses it only as an :class:`EngineView`: it queues requests,
aborts them, steps, and reads the figures and snapshots below. The scheduler, the block manager,
the swap space and the model runner are the engine's own parts; their fields change whenever the
engine does, so nothing outside ``shared/engine`` reads them.
``tests/unit/engine/test_engine_boundary.py`` fails when a module of the services, the console or
the ``tandem`` package reaches past this view.

Everything here reads the engine as it is between two steps: call it on the thread that steps the
engine (``EngineThread.call`` in a worker). The records are frozen copies, safe to hand to another
thread once taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    import torch

    from tandem.shared.engine.sequence import EngineRequest, RequestOutput
    from tandem.shared.infra.config import EngineSettings


class EngineStats(TypedDict):
    """``LLMEngine.stats()``: queue lengths, KV pool and swap space use, and counters since start."""

    running: int
    waiting: int
    free_blocks: int
    num_blocks: int
    usage: float
    preemptions: int  # by swap and by recompute
    swaps: int  # preemptions by swap
    recomputes: int  # preemptions by recompute
    swap_fallbacks: int  # swapped, then recomputed after all
    swapped: int
    swap_blocks: int
    free_swap_blocks: int
    swap_usage: float
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens found cached
    cached_blocks: int  # free but holding a cached prefix
    cow_copies: int  # blocks copied on a forked sequence's first write
    adapter_loads: int  # LoRA adapters read from their directories
    adapter_slot_writes: int  # adapters copied into a device slot
    adapters_resident: list[str]  # name@version in device slots, most recently used last
    adapters_running: list[str]  # adapter names of running sequences, sorted
    adapters_waiting: list[str]  # of waiting and swapped ones


@dataclass(frozen=True)
class SequenceView:
    """One unfinished sequence (one output of a request) and the KV blocks it holds."""

    request_id: str
    sample_index: int  # which of its request's outputs (0 for a single-output request)
    status: str  # "running", "waiting" or "swapped"
    num_tokens: int  # prompt and output tokens known so far
    num_output_tokens: int
    block_table: tuple[int, ...]  # device blocks, in token order (empty while waiting or swapped)
    prefix_cached_blocks: int  # leading blocks claimed from the prefix cache
    imported_blocks: int  # blocks after those that came with it (a hand-off or a KV-store fetch)
    constrained: str = ""  # the kind of its structured output (json_schema, regex, ...); "": free text
    adapter: str = ""  # its LoRA adapter's name ("": the base model)


@dataclass(frozen=True)
class KVPoolView:
    """The device KV pool, one entry per physical block in the ``*_blocks`` tuples."""

    num_blocks: int
    block_size: int
    ref_counts: tuple[int, ...]  # block tables holding each block (0: free)
    cached: tuple[bool, ...]  # the block holds a hashed, reusable prefix (in use or free)
    cow_copies: int  # blocks copied so far on a forked sequence's first write into a shared one


class EngineView(Protocol):
    """The calls and reads a service may make on an engine, all on the thread that steps it."""

    config: EngineSettings  # what the engine was built with

    def add_request(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def drain_kv_events(self) -> tuple[list[int], list[int]]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def prepare_structured_outputs(self) -> None: ...

    @property
    def kv_layout(self) -> tuple[int, ...]:
        """The shape of one exported or imported KV block (a hand-off's or a KV-store's ``kv[i]``)."""
        ...

    def running_request_ids(self) -> list[str]:
        """Requests with a running sequence, by arrival (a request with several outputs once)."""
        ...

    def sequences(self, limit: int | None = None) -> list[SequenceView]:
        """Unfinished sequences: running, then waiting, then swapped, each by arrival; at most ``limit``."""
        ...

    def kv_pool(self) -> KVPoolView:
        """The device KV pool's blocks as they are now."""
        ...
