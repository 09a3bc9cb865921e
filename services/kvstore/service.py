"""The KV-store service: KV blocks by chained block hash in host RAM and on local disk, over NATS.

``tandem serve kvstore --nats-url URL [--kvstore-ram-mib N] [--kvstore-disk-mib N] [--kvstore-dir DIR]``
(default folder ``<data-dir>/kvstore``; one store per folder). Endpoints, per instance ``<id>``:

- ``tandem.v1.kvstore.<id>.lookup``: :class:`KVLookupRequest` -> :class:`KVLookupReply` (leading
  count and per-hash presence); ``tandem.v1.kvstore.lookup`` is the same, answered by every store
  (each in its own queue group), for a scatter-gather over all stores;
- ``tandem.v1.kvstore.<id>.get``: :class:`KVGetRequest` -> the blocks found go as KV frames to the
  request's ``inbox`` (the requester credits them, as a decode worker does), then
  :class:`KVGetReply` lists the hashes sent and a :class:`KVTransfer` (block_bytes, crc32 per block);
- ``tandem.v1.kvstore.<id>.kv``: KV frames of a put (:meth:`tandem.shared.kvtransfer.channel.KVChannel.send`),
  landed by the reader threads of the store's bulk connections (``--kv-connections``);
- ``tandem.v1.kvstore.<id>.put``: :class:`KVPutRequest` naming that transfer and one hash per block
  -> :class:`KVPutReply`; the blocks' checksums are verified before anything is stored;
- ``tandem.v1.kvstore.<id>.stats``: any payload -> a msgpack map of tier usage and hit counters.

Every bad input gets a typed :class:`ErrorReply`. Blocks stored and removed are published as
:class:`KVEvent` into the JetStream stream (``tandem.v1.kv.events.kvstore.<id>``); at start a
``cleared`` event and then every block found on disk. The store runs on one worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgpack
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.micro.request import Request

from tandem.services.common.kv_event_publisher import KVEventPublisher
from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.services.common.service_metrics import kvstore_metrics
from tandem.services.kvstore.store import KVBlockStore
from tandem.shared.infra.config import Settings
from tandem.shared.kvtransfer.channel import KVChannel
from tandem.shared.kvtransfer.frames import KVReceiver
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode, error_reply
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.kv import (
    KVGetReply,
    KVGetRequest,
    KVLookupReply,
    KVLookupRequest,
    KVPutReply,
    KVPutRequest,
)

MIB = 1 << 20
PUT_BYTES_IN_FLIGHT = 512 * MIB  # put transfers being reassembled at once
GET_MAX_BYTES = 512 * MIB  # one get sends at most this much; ``found`` says what was sent
MAX_CONCURRENT_GETS = 4
WRITE_BEHIND_BYTES = 64 * MIB  # written to disk per write-behind round at most


class KVStoreService(ServiceRuntime):
    name = "kvstore"
    description = "KV-block store: host RAM and local disk tiers, by chained block hash"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        disk_bytes = int(settings.kvstore.disk_mib * MIB)
        disk_dir = (settings.kvstore.dir or settings.data_dir / "kvstore") if disk_bytes else None
        self.store = KVBlockStore(int(settings.kvstore.ram_mib * MIB), disk_bytes, disk_dir)
        self.receiver = KVReceiver(max_bytes_in_flight=PUT_BYTES_IN_FLIGHT)
        self.kv_channel: KVChannel | None = None  # opened in setup
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstore")
        self.tier_stats: dict = self.store.stats()  # refreshed after every store operation
        kvstore_metrics(self.prom, lambda: self.tier_stats)
        self._gets = asyncio.Semaphore(MAX_CONCURRENT_GETS)
        self.kv_events = KVEventPublisher(None, self.name, self.instance_id)  # connected in setup

    async def setup(self) -> None:
        # Gets and puts move their blocks over bulk connections of the store's own.
        self.kv_channel = await KVChannel.open(self.nc, self.settings.bus, options=self.bus_options,
                                               name=f"tandem-{self.name}-{self.instance_id}", log=self.log,
                                               add_endpoint=functools.partial(self.add_endpoint, bulk=True))
        self.kv_events.nc = self.nc
        for namespace, hashes in (await self._call(self.store.namespaces)).items():
            self.kv_events.add(namespace, hashes, [])  # what survived on disk; the first event clears the rest
        self.spawn(self.kv_events.run(), "kv event publisher")
        iid = self.instance_id
        await self.add_endpoint("lookup", subjects.kvstore_lookup(iid), self.on_lookup)
        await self.add_endpoint("lookup_all", subjects.KVSTORE_LOOKUP_ALL, self.on_lookup, queue_group=iid)
        await self.add_endpoint("get", subjects.kvstore_get(iid), self.on_get)
        await self.kv_channel.serve("kv", subjects.kvstore_kv(iid), self.receiver)
        await self.add_endpoint("put", subjects.kvstore_put(iid), self.on_put)
        await self.add_endpoint("stats", subjects.kvstore_stats(iid), self.on_stats)
        if self.settings.kvstore.write_behind_s > 0 and self.store.disk_capacity:
            self.spawn(self.write_behind_loop(), "write-behind", in_flight=False)

    async def teardown(self) -> None:
        await self._call(self.store.close)  # RAM blocks go to disk, so a restart keeps them
        self._thread.shutdown(wait=True)

    async def disconnected(self) -> None:
        if self.kv_channel is not None:
            await self.kv_channel.close()

    async def write_behind_loop(self) -> None:
        """RAM blocks to disk every ``--kvstore-write-behind-s``, a bounded amount per round so gets
        queued behind it on the store's thread wait little."""
        while True:
            await asyncio.sleep(self.settings.kvstore.write_behind_s)
            if self.tier_stats.get("ram_unwritten_blocks"):
                await self._call(self.store.write_behind, WRITE_BEHIND_BYTES)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(service=self.name, instance_id=self.instance_id, host=self.host, pid=os.getpid(),
                         incarnation=self.incarnation, model="")

    # -- endpoints ----------------------------------------------------------------------------------
    async def on_lookup(self, request: Request) -> None:
        msg: KVLookupRequest = decode(request.data, KVLookupRequest)
        leading, present = await self._call(self.store.lookup, msg.namespace, msg.hashes)
        reply = KVLookupReply(store=self.instance_id, namespace=msg.namespace, leading=leading, present=present)
        await request.respond(encode(reply))

    async def on_get(self, request: Request) -> None:
        msg: KVGetRequest = decode(request.data, KVGetRequest)
        await self._gets.acquire()  # sending may take a while: later requests need not wait for it
        self.spawn(self._serve_get(msg, request), f"get {msg.request_id}")

    async def _serve_get(self, msg: KVGetRequest, request: Request) -> None:
        try:
            await request.respond(encode(await self._get(msg)))
        except Exception as exc:
            reply = error_reply(exc, msg.request_id)
            self.limited.warning(f"get replies {reply.code.value}", "get: replied %s (%s)", reply.code.value,
                                 reply.message)
            await request.respond(encode(reply))
        finally:
            self._gets.release()

    def _gather(self, msg: KVGetRequest) -> tuple[list[int], bytes, int]:
        """``(hashes found, their blocks joined, block bytes)`` for a get, at most GET_MAX_BYTES; on the
        store's thread, so joining up to 512 MiB never holds the event loop."""
        found, parts, total = [], [], 0
        for h, data in zip(msg.hashes, self.store.get(msg.namespace, msg.hashes)):
            if data is None:
                if msg.prefix_only:
                    break
                continue
            if total + len(data) > GET_MAX_BYTES:
                break
            if parts and len(data) != len(parts[0]):
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"blocks of namespace {msg.namespace!r} differ in size")
            found.append(h)
            parts.append(data)
            total += len(data)
        return found, b"".join(parts), len(parts[0]) if parts else 0

    async def _get(self, msg: KVGetRequest) -> KVGetReply:
        found, blob, block_bytes = await self._call(self._gather, msg)
        if not found:
            return KVGetReply(request_id=msg.request_id, found=[])
        try:
            transfer = await self.kv_channel.send(msg.inbox, blob, num_blocks=len(found), block_bytes=block_bytes,
                                                  transfer_id=f"{self.instance_id}-{uuid.uuid4().hex[:12]}")
        except NoRespondersError:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"nobody listens on inbox {msg.inbox}") from None
        except NatsTimeoutError:
            raise ProtocolError(ErrorCode.TIMEOUT, f"inbox {msg.inbox} did not acknowledge KV frames") from None
        return KVGetReply(request_id=msg.request_id, found=found, transfer=transfer)

    async def on_put(self, request: Request) -> None:
        msg: KVPutRequest = decode(request.data, KVPutRequest)
        blob = self.receiver.take(msg.transfer)  # raises (and forgets the transfer) unless complete and intact
        if len(msg.hashes) != msg.transfer.num_blocks:
            raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                f"{len(msg.hashes)} hashes for a transfer of {msg.transfer.num_blocks} blocks")
        stored = await self._call(self._put_all, msg.namespace, msg.hashes, blob, msg.transfer.block_bytes)
        await request.respond(encode(KVPutReply(request_id=msg.request_id, stored=stored)))

    def metrics(self) -> dict:
        """Tier usage and hit counters as of the last store operation (read on the store's thread)."""
        return dict(self.tier_stats)

    async def on_stats(self, request: Request) -> None:
        stats = await self._call(self.store.stats)
        stats.update(instance_id=self.instance_id, events_published=self.kv_events.published,
                     events_failed=self.kv_events.failed, put_bytes_in_flight=self.receiver.bytes_in_flight)
        await request.respond(msgpack.packb(stats, use_bin_type=True))

    # -- internals ----------------------------------------------------------------------------------
    def _put_all(self, namespace: str, hashes: list[int], blob: bytearray, block_bytes: int) -> int:
        view = memoryview(blob)
        return sum(self.store.put(namespace, h, view[i * block_bytes : (i + 1) * block_bytes])
                   for i, h in enumerate(hashes))

    async def _call(self, fn, *args):
        """Run ``fn`` on the store's thread, then queue the KV events it caused (in order)."""

        def run():
            return fn(*args), self.store.drain_events(), self.store.stats()

        result, events, self.tier_stats = await asyncio.get_running_loop().run_in_executor(self._thread, run)
        for namespace, (stored, removed) in events.items():
            self.kv_events.add(namespace, stored, removed)
        return result


def main(settings: Settings) -> None:
    run_service(KVStoreService(settings))
