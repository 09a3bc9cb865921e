"""What the console is shown of a worker's insides: its block pool and its KV transfers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from tandem.shared.protocol.base import WireMessage


class SequenceBlocks(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: str
    num_tokens: int
    block_table: list[int]
    prefix_cached_blocks: int = 0  # leading blocks claimed from this worker's prefix cache
    imported_blocks: int = 0  # leading blocks that came from a hand-off or the KV-store
    sample_index: int = 0  # which output of its request (n > 1, best_of, beams): each has its own table
    constrained: str = ""  # the kind of structured output its tokens are held to (json_schema, regex, ...)
    adapter: str = ""  # the name of the LoRA adapter it runs with ("": the base model)


MAX_SHOWN_REF_COUNT = 255  # a ref count byte saturates here


class BlockSnapshot(WireMessage):
    """A worker's KV pool: one state byte and one ref count byte per physical block, every live
    sequence's block table, and how many blocks copy-on-write has copied so far."""

    kind: Literal["block_snapshot"] = "block_snapshot"
    instance_id: str
    num_blocks: int
    block_size: int
    states: bytes  # per block: 0 free, 1 in use, 2 free but cached, 3 shared (ref count > 1)
    # Per block: the block tables holding it (MAX_SHOWN_REF_COUNT: that many or more); empty from a
    # worker that does not send them.
    ref_counts: bytes = b""
    cow_copies: int = 0  # blocks copied since the worker started because a forked table wrote into a shared one
    sequences: list[SequenceBlocks]


class KVTransferEvent(WireMessage):
    """One KV hand-off or store transfer, published after it completes (console's transfer lanes)."""

    kind: Literal["kv_transfer"] = "kv_transfer"
    request_id: str
    source: str
    dest: str
    path: Literal["ring", "nats", "store"]
    blocks: int
    bytes: int
    start: float  # unix seconds
    end: float
