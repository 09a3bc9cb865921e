"""What a worker serves the ops console: its KV block snapshot, and KV-transfer events.

``take_snapshot(engine, instance_id)`` reads the engine's KV pool and its sequences (what
:class:`~tandem.shared.engine.engine_view.EngineView` offers) into a
:class:`BlockSnapshot`: one state byte per physical block (0 free, 1 in use, 2 free but cached,
3 shared by more than one block table) and its ref count, the blocks copy-on-write has copied so
far (forked samples and beams share blocks until one writes), and every live sequence's block
table with how many of its leading blocks came from the prefix cache and how many were imported
(a hand-off or a KV-store fetch), and the name of its LoRA adapter. The engine is not thread-safe,
so the worker takes the snapshot on its engine thread (:meth:`EngineThread.call`), between two
steps. ``register_blocks_endpoint(worker)`` serves it on ``tandem.v1.<service>.<id>.blocks`` (any
request payload); ``tandem console`` asks for it::

    nats req tandem.v1.decode.<id>.blocks ''   # msgpack BlockSnapshot

``publish_transfer`` sends one :class:`KVTransferEvent` on ``tandem.v1.kv.transfers`` once a
hand-off or store transfer completed (the console's transfer lanes); a failure is only logged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.views import MAX_SHOWN_REF_COUNT, BlockSnapshot, KVTransferEvent, SequenceBlocks

if TYPE_CHECKING:
    from tandem.services.common.worker import EngineWorker
    from tandem.shared.engine.engine_view import EngineView

log = logging.getLogger("tandem.blocks")

FREE, IN_USE, CACHED, SHARED = 0, 1, 2, 3
SNAPSHOT_TIMEOUT_S = 5.0
MAX_SEQUENCES = 1024  # a snapshot lists at most this many sequences (running first)


def take_snapshot(engine: EngineView, instance_id: str) -> BlockSnapshot:
    """The engine's KV pool as it is now. Call it on the thread that steps the engine."""
    pool = engine.kv_pool()
    states = bytes(
        (SHARED if refs > 1 else IN_USE) if refs else (CACHED if cached else FREE)
        for refs, cached in zip(pool.ref_counts, pool.cached)
    )
    ref_counts = bytes(min(refs, MAX_SHOWN_REF_COUNT) for refs in pool.ref_counts)
    sequences = [
        SequenceBlocks(request_id=seq.request_id, num_tokens=seq.num_tokens, block_table=list(seq.block_table),
                       prefix_cached_blocks=seq.prefix_cached_blocks, imported_blocks=seq.imported_blocks,
                       sample_index=seq.sample_index, constrained=seq.constrained,
                       # getattr: a SequenceView without the adapter field (shared/engine/engine_view.py) says none
                       adapter=seq.adapter)
        for seq in engine.sequences(limit=MAX_SEQUENCES) if seq.status != "swapped"
    ]
    return BlockSnapshot(instance_id=instance_id, num_blocks=pool.num_blocks, block_size=pool.block_size,
                         states=states, ref_counts=ref_counts, cow_copies=pool.cow_copies, sequences=sequences)


async def register_blocks_endpoint(worker: EngineWorker) -> None:
    """Serve ``worker``'s block snapshot on ``subjects.blocks(name, id)``."""

    async def on_blocks(request) -> None:
        call = worker.thread.call(lambda engine: take_snapshot(engine, worker.instance_id))
        snapshot = await asyncio.wait_for(call, SNAPSHOT_TIMEOUT_S)
        await request.respond(encode(snapshot))

    await worker.add_endpoint("blocks", subjects.blocks(worker.name, worker.instance_id), on_blocks)


async def publish_transfer(nc, request_id: str, source: str, dest: str, path: str, blocks: int, nbytes: int,
                           start: float, end: float) -> None:
    """Publish one completed transfer (``path``: "ring", "nats" or "store"); never raises."""
    try:
        event = KVTransferEvent(request_id=request_id, source=source, dest=dest, path=path, blocks=blocks,
                                bytes=nbytes, start=start, end=end)
        await nc.publish(subjects.KV_TRANSFERS, encode(event))
    except Exception as exc:  # the console's view is not worth failing a request for
        log.warning("could not publish the KV transfer of %s: %s", request_id, exc)
