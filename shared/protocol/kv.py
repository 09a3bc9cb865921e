"""KV blocks on the bus: hand-off descriptors, KV events for the router's index, and the KV-store's
lookup, get and put by chained block hash (:mod:`tandem.shared.protocol.block_hashes`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.shared.protocol.base import WireMessage


class RingSlots(BaseModel):
    """Where a hand-off's KV bytes lie in the decode worker's ring (a SlotDescriptor on the wire)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ring: str
    slots: list[Annotated[int, Field(ge=0)]]
    length: int = Field(ge=1)
    generation: int = Field(ge=0)


class KVTransfer(BaseModel):
    """Describes the KV bytes sent ahead of a :class:`DecodeRequest` as binary frames."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    transfer_id: str
    num_blocks: int = Field(ge=1)
    block_bytes: int = Field(ge=1)
    checksums: list[int]  # crc32 of each block, in order


BlockHash = Annotated[int, Field(ge=0, lt=2**64)]


class KVEvent(WireMessage):
    """Blocks a worker or store now holds (``stored``) or no longer holds (``removed``), by chained
    block hash within ``namespace``; ``cleared`` drops everything ``source`` held before. Published to
    the JetStream stream ``TANDEM_KV_EVENTS`` so a restarted router can rebuild its index."""

    kind: Literal["kv_event"] = "kv_event"
    source: str  # instance id
    service: str  # "decode", "prefill" or "kvstore"
    namespace: str  # model, dtype and KV layout: blocks are only comparable within one
    seq: int = Field(ge=0)  # per-source counter: a gap means events were lost
    stored: list[Annotated[int, Field(ge=0, lt=2**64)]] = Field(default_factory=list)
    removed: list[Annotated[int, Field(ge=0, lt=2**64)]] = Field(default_factory=list)
    cleared: bool = False


MAX_KV_HASHES = 65536  # hashes per request: a 1M-token prompt at block size 16


# A subject a store may send frames to: dot-separated tokens, no spaces, no wildcards.
SUBJECT_PATTERN = r"^[^\s.*>]+(\.[^\s.*>]+)*$"


class KVLookupRequest(WireMessage):
    """To a KV store: which of ``hashes`` (a chain, in order) do you hold in ``namespace``?"""

    kind: Literal["kv_lookup"] = "kv_lookup"
    namespace: str = Field(min_length=1, max_length=256)
    hashes: list[BlockHash] = Field(max_length=MAX_KV_HASHES)


class KVLookupReply(WireMessage):
    """``leading``: how many of the first hashes are all present; ``present``: one flag per hash."""

    kind: Literal["kv_lookup_reply"] = "kv_lookup_reply"
    store: str  # instance id of the answering store
    namespace: str
    leading: int
    present: list[bool]


class KVGetRequest(WireMessage):
    """To a KV store: send the blocks of ``hashes`` you hold as KV frames to ``inbox`` (the requester
    acks each frame, see :mod:`tandem.shared.kvtransfer.frames`), then reply with a :class:`KVGetReply`.
    ``prefix_only`` stops at the first missing hash."""

    kind: Literal["kv_get"] = "kv_get"
    request_id: str = Field(min_length=1, max_length=128)
    namespace: str = Field(min_length=1, max_length=256)
    hashes: list[BlockHash] = Field(min_length=1, max_length=MAX_KV_HASHES)
    inbox: str = Field(min_length=1, max_length=256, pattern=SUBJECT_PATTERN)
    prefix_only: bool = False


class KVGetReply(WireMessage):
    """The blocks sent: ``found[i]`` is the hash of block ``i`` of ``transfer`` (None: none found)."""

    kind: Literal["kv_get_reply"] = "kv_get_reply"
    request_id: str
    found: list[int]
    transfer: KVTransfer | None = None


class KVPutRequest(WireMessage):
    """To a KV store, after the transfer's frames went to its ``kv`` subject: keep these blocks,
    block ``i`` of ``transfer`` under ``hashes[i]``."""

    kind: Literal["kv_put"] = "kv_put"
    request_id: str = Field(min_length=1, max_length=128)
    namespace: str = Field(min_length=1, max_length=256)
    hashes: list[BlockHash] = Field(min_length=1, max_length=MAX_KV_HASHES)
    transfer: KVTransfer


class KVPutReply(WireMessage):
    """``stored``: blocks new to the store; the rest were already there or larger than both tiers."""

    kind: Literal["kv_put_reply"] = "kv_put_reply"
    request_id: str
    stored: int
