"""Talking to a KV-store from a worker: lookup, get and put of KV blocks by chained hash.

    store = KVStoreClient(nc, "kvstore-host-1a2b3c")
    leading = (await store.lookup(namespace, hashes)).leading
    found, blob, block_bytes = await store.get(namespace, hashes[:leading], prefix_only=True)
    await store.put(namespace, new_hashes, blob, block_bytes)

Bytes move as credited binary frames (:mod:`tandem.shared.kvtransfer.frames`), over the worker's bulk
connections when it has them (``links``), and are verified block by block (crc32) on arrival; every
refusal comes back as :class:`ProtocolError` with its typed code.
"""

from __future__ import annotations

import uuid

from tandem.shared.infra.config import BusSettings
from tandem.shared.kvtransfer.bulklinks import BulkLinks
from tandem.shared.kvtransfer.frames import KVReceiver, send_kv
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
    KVTransfer,
)

MIB = 1024 * 1024


class KVStoreClient:
    """One KV-store instance, over an existing NATS connection."""

    def __init__(self, nc, store_id: str, timeout_s: float = 30.0, window: int = BusSettings().kv_window,
                 links: BulkLinks | None = None) -> None:
        self.nc, self.store_id, self.timeout_s, self.window = nc, store_id, timeout_s, window
        self.links = links  # a BulkLinks: frames sent and landed on its threads

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

        async def on_frame(msg) -> None:
            reply = receiver.answer(msg.data)
            if reply is not None and msg.reply:
                await self.nc.publish(msg.reply, reply)

        if self.links is not None and self.links.usable:  # the inbox is this identity's: its bulk connections read it
            sub = await self.links.serve_kv(inbox, receiver)
        else:
            sub = await self.nc.subscribe(inbox, cb=on_frame, pending_bytes_limit=256 * MIB)
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
        transfer_id = uuid.uuid4().hex
        checksums = await send_kv(self.nc, subjects.kvstore_kv(self.store_id), transfer_id, blob, window=self.window,
                                  timeout_s=self.timeout_s, block_bytes=block_bytes, links=self.links)
        transfer = KVTransfer(transfer_id=transfer_id, num_blocks=len(hashes), block_bytes=block_bytes,
                              checksums=checksums)
        request = KVPutRequest(request_id=transfer_id, namespace=namespace, hashes=hashes, transfer=transfer)
        return await self._ask(subjects.kvstore_put(self.store_id), request, KVPutReply)
