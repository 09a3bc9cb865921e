"""Talking to a KV-store from a worker: lookup, get and put of KV blocks by chained hash.

    store = KVStoreClient(nc, "kvstore-host-1a2b3c")
    leading = (await store.lookup(namespace, hashes)).leading
    found, blob, block_bytes = await store.get(namespace, hashes[:leading], prefix_only=True)
    await store.put(namespace, new_hashes, blob, block_bytes)

Bytes move as credited binary frames through a :class:`tandem.shared.kvtransfer.channel.KVChannel`: the
worker's own (``channel``: over its bulk connections when it has them), else one over ``nc``; they are
verified block by block (crc32) on arrival. Every refusal comes back as :class:`ProtocolError` with its
typed code.
"""

from __future__ import annotations

import uuid

from tandem.shared.kvtransfer.channel import KVChannel
from tandem.shared.kvtransfer.frames import KVReceiver
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.kv import (
    KVGetReply,
    KVGetRequest,
    KVLookupReply,
    KVLookupRequest,
    KVPutReply,
    KVPutRequest,
)


class KVStoreClient:
    """One KV-store instance, over an existing NATS connection."""

    def __init__(self, nc, store_id: str, timeout_s: float = 30.0, channel: KVChannel | None = None) -> None:
        self.nc, self.store_id, self.timeout_s = nc, store_id, timeout_s
        self.channel = channel if channel is not None else KVChannel(nc)

    async def _ask(self, subject: str, message, expect):
        reply = decode((await self.nc.request(subject, encode(message), timeout=self.timeout_s)).data,
                       (expect, ErrorReply))
        if isinstance(reply, ErrorReply):
            raise ProtocolError(reply.code, f"kvstore {self.store_id}: {reply.message}")
        return reply

    async def lookup(self, namespace: str, hashes: list[int]) -> KVLookupReply:
        request = KVLookupRequest(namespace=namespace, hashes=hashes)
        return await self._ask(subjects.kvstore_lookup(self.store_id), request, KVLookupReply)

    async def get(self, namespace: str, hashes: list[int], prefix_only: bool = False,
                  max_bytes: int = 1 << 30) -> tuple[list[int], bytearray, int]:
        """(hashes found, their blocks end to end, bytes per block); blocks come in ``found`` order."""
        receiver, inbox = KVReceiver(max_bytes), self.nc.new_inbox()
        sub = await self.channel.listen(inbox, receiver)
        try:
            request = KVGetRequest(request_id=uuid.uuid4().hex, namespace=namespace, hashes=hashes, inbox=inbox,
                                   prefix_only=prefix_only)
            reply: KVGetReply = await self._ask(subjects.kvstore_get(self.store_id), request, KVGetReply)
        finally:
            await sub.unsubscribe()
        if reply.transfer is None or not reply.found:
            return [], bytearray(), 0
        return list(reply.found), receiver.take(reply.transfer), reply.transfer.block_bytes

    async def put(self, namespace: str, hashes: list[int], blob: bytes | memoryview, block_bytes: int) -> KVPutReply:
        """Store ``len(hashes)`` blocks laid end to end in ``blob``."""
        transfer = await self.channel.send(subjects.kvstore_kv(self.store_id), blob, num_blocks=len(hashes),
                                           block_bytes=block_bytes, timeout_s=self.timeout_s)
        request = KVPutRequest(request_id=transfer.transfer_id, namespace=namespace, hashes=hashes, transfer=transfer)
        return await self._ask(subjects.kvstore_put(self.store_id), request, KVPutReply)
