"""The KV-store service over a real nats-server, as its own process (``tandem serve kvstore``).

Put/get round trips byte-exact (64 KiB and 2 MiB blocks, on the 8 MiB session server and on a
1 MiB-max_payload server, where a block spans frames), lookup prefix counts, typed errors for bad
input on every subject, restart keeping the disk tier, corrupt files not served, JetStream events.
The helpers ``kv_put`` / ``kv_get`` / ``kv_lookup`` are what a prefill worker does.

    python -m pytest -q tests/e2e/test_kvstore_service.py
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import nats
import pytest

from tandem.services.common.kvstore_client import KVStoreClient
from tandem.services.kvstore.store import namespace_digest
from tandem.shared.infra import natsserver
from tandem.shared.kvtransfer.frames import block_checksums, pack_frame, send_kv
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION, Ack, ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode, encode, error_reply
from tandem.shared.protocol.kv import (
    KVEvent,
    KVGetReply,
    KVGetRequest,
    KVLookupReply,
    KVLookupRequest,
    KVPutReply,
    KVPutRequest,
    KVTransfer,
)

NS = "tiny/float32/test"
KIB, MIB = 1024, 1024 * 1024


class Store:
    """One ``tandem serve kvstore`` process; restartable on the same folder and instance id."""

    def __init__(self, url: str, workdir: Path, ram_mib: float = 1, disk_mib: float = 64,
                 write_behind_s: float = 0.0) -> None:
        self.url, self.kvdir, self.id = url, workdir / "kv", f"kvstore-{uuid.uuid4().hex[:6]}"
        self.args = ["--kvstore-ram-mib", str(ram_mib), "--kvstore-disk-mib", str(disk_mib),
                     "--kvstore-dir", str(self.kvdir), "--kvstore-write-behind-s", str(write_behind_s)]
        self.log, self.proc = workdir / "kvstore.log", None

    async def start(self) -> Store:
        env = dict(os.environ, TANDEM_HEARTBEAT_INTERVAL_S="0.2", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "tandem", "serve", "kvstore", "--nats-url", self.url, "--instance-id", self.id]
        self.proc = subprocess.Popen(cmd + self.args, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        async with connect(self.url) as nc:
            for _ in range(300):
                assert self.proc.poll() is None, self.log.read_text()
                try:
                    await nc.request(subjects.kvstore_stats(self.id), b"", timeout=1)
                    return self
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):  # not up, or a killed one lingers
                    await asyncio.sleep(0.05)
        raise AssertionError("kvstore did not come up:\n" + self.log.read_text())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        assert self.proc.wait(20) in (0, -signal.SIGKILL), self.log.read_text()

    def block_file(self, h: int) -> Path:
        return self.kvdir / namespace_digest(NS) / f"{h:016x}.blk"


@asynccontextmanager
async def connect(url: str):
    nc = await nats.connect(url, pending_size=64 * MIB)
    try:
        yield nc
    finally:
        await nc.close()


async def kv_lookup(nc, store: str, hashes: list[int], namespace: str = NS) -> KVLookupReply:
    try:
        return await KVStoreClient(nc, store, timeout_s=10).lookup(namespace, hashes)
    except ProtocolError as exc:
        return error_reply(exc)


async def kv_put(nc, store: str, hashes: list[int], blob: bytes, block_bytes: int) -> KVPutReply:
    try:
        return await KVStoreClient(nc, store, timeout_s=10).put(NS, hashes, blob, block_bytes)
    except ProtocolError as exc:
        return error_reply(exc)


async def kv_get(nc, store: str, hashes: list[int], prefix_only: bool = False) -> tuple[KVGetReply, dict[int, bytes]]:
    """The blocks found, by hash (an ErrorReply and nothing when the store refused)."""
    try:
        found, blob, bb = await KVStoreClient(nc, store, timeout_s=10).get(NS, hashes, prefix_only=prefix_only)
    except ProtocolError as exc:
        return error_reply(exc), {}
    return KVGetReply(request_id="get", found=found), {h: bytes(blob[i * bb : (i + 1) * bb])
                                                       for i, h in enumerate(found)}


async def stats(nc, store: str) -> dict:
    return msgpack.unpackb((await nc.request(subjects.kvstore_stats(store), b"")).data)


async def events_of(nc, store: str) -> list[KVEvent]:
    sub = await nc.jetstream().pull_subscribe(subjects.kv_events("kvstore", store), stream=subjects.KV_EVENTS_STREAM)
    out = []
    try:
        while True:
            out += [decode(m.data, KVEvent) for m in await sub.fetch(100, timeout=0.3)]
    except TimeoutError:  # nothing more (nats-py raises asyncio's or its own subclass)
        return out
    finally:
        await sub.unsubscribe()


def blocks(n: int, size: int, seed: int) -> tuple[list[int], bytes]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)], rng.randbytes(n * size)


@pytest.fixture(scope="module")
def servers(nats_server):
    saved, natsserver.MAX_PAYLOAD = natsserver.MAX_PAYLOAD, MIB
    try:
        small = natsserver.NatsServer.start()
    finally:
        natsserver.MAX_PAYLOAD = saved
    yield {"8MiB": nats_server.url, "1MiB": small.url}
    small.stop()


@pytest.fixture(scope="module")
async def stores(servers, tmp_path_factory):
    started = {}
    for name, url in servers.items():
        started[name] = await Store(url, tmp_path_factory.mktemp(name), ram_mib=4).start()
    yield started
    for store in started.values():
        store.stop()


@pytest.mark.parametrize("block_bytes", [64 * KIB, 2 * MIB], ids=["64KiB", "2MiB"])
@pytest.mark.parametrize("server", ["8MiB", "1MiB"])
async def test_put_get_round_trip(stores, server, block_bytes):
    store = stores[server]
    hashes, blob = blocks(5, block_bytes, seed=block_bytes + len(server))  # 10 MiB: > one frame on both
    async with connect(store.url) as nc:
        assert nc.max_payload == {"8MiB": 8 * MIB, "1MiB": MIB}[server]
        assert (await kv_put(nc, store.id, hashes, blob, block_bytes)).stored == 5
        assert (await kv_put(nc, store.id, hashes[:2], blob[: 2 * block_bytes], block_bytes)).stored == 0
        reply, got = await kv_get(nc, store.id, [hashes[3], 12345, hashes[0], hashes[4]])
        assert reply.found == [hashes[3], hashes[0], hashes[4]]
        for i in (3, 0, 4):
            assert got[hashes[i]] == blob[i * block_bytes : (i + 1) * block_bytes]
        reply, got = await kv_get(nc, store.id, [hashes[0], 12345, hashes[1]], prefix_only=True)
        assert reply.found == [hashes[0]] and len(got) == 1
        reply, got = await kv_get(nc, store.id, [777])
        assert reply.found == [] and got == {}
        s = await stats(nc, store.id)
        assert s["ram_bytes"] + s["disk_bytes"] >= 5 * block_bytes and s["ram_bytes"] <= 4 * MIB
        assert s["hits_ram"] + s["hits_disk"] >= 4 and s["misses"] >= 2


async def test_lookup_prefix_counts_and_events(stores):
    store = stores["8MiB"]
    hashes, blob = blocks(4, 64 * KIB, seed=1)
    async with connect(store.url) as nc:
        await kv_put(nc, store.id, hashes[:2] + hashes[3:], blob[: 3 * 64 * KIB], 64 * KIB)
        reply = await kv_lookup(nc, store.id, hashes)
        assert (reply.leading, reply.present, reply.store) == (2, [True, True, False, True], store.id)
        assert (await kv_lookup(nc, store.id, hashes, namespace="other")).leading == 0
        everyone = await nc.request(subjects.KVSTORE_LOOKUP_ALL, encode(KVLookupRequest(namespace=NS, hashes=hashes)))
        assert decode(everyone.data).leading == 2
        for _ in range(50):
            events = await events_of(nc, store.id)
            stored = {h for e in events if e.namespace == NS for h in e.stored}
            if set(hashes) - {hashes[2]} <= stored:
                break
        assert set(hashes) - {hashes[2]} <= stored and hashes[2] not in stored
        assert events[0].cleared and [e.seq for e in events] == list(range(len(events)))


def frame(header_changes: dict, payload: bytes = b"x" * 16) -> bytes:
    header = {"v": SCHEMA_VERSION, "kind": "kv_chunk", "transfer_id": "t", "offset": 0, "total_bytes": 16}
    return pack_frame({**header, **header_changes}, payload)


def request(which: str, store_id: str, **changes) -> bytes:
    good = {
        "lookup": KVLookupRequest(namespace=NS, hashes=[1, 2]),
        "get": KVGetRequest(request_id="r", namespace=NS, hashes=[1], inbox="_INBOX.nobody"),
        "put": KVPutRequest(request_id="r", namespace=NS, hashes=[1],
                            transfer=KVTransfer(transfer_id="none", num_blocks=1, block_bytes=4, checksums=[0])),
    }[which].model_dump()
    return msgpack.packb({**good, **changes})


BAD = [  # (endpoint, payload builder, expected code)
    *[(ep, lambda s: b"\xc1 garbage", "bad_frame") for ep in ("lookup", "get", "put", "kv")],
    *[(ep, lambda s: msgpack.packb([1, 2]), "bad_frame") for ep in ("lookup", "get", "put")],
    *[(ep, lambda s: encode(Ack()), "bad_schema") for ep in ("lookup", "get", "put")],
    *[(ep, lambda s, ep=ep: request(ep, s, v=99), "unsupported_version") for ep in ("lookup", "get", "put")],
    *[(ep, lambda s, ep=ep: request(ep, s, kind="teleport"), "bad_schema") for ep in ("lookup", "get", "put")],
    *[(ep, lambda s, ep=ep: request(ep, s, hashes=[-1]), "invalid_request") for ep in ("lookup", "get", "put")],
    *[(ep, lambda s, ep=ep: request(ep, s, namespace=""), "invalid_request") for ep in ("lookup", "get", "put")],
    ("lookup", lambda s: request("lookup", s, hashes=list(range(65537))), "invalid_request"),
    ("get", lambda s: request("get", s, hashes=[]), "invalid_request"),
    ("get", lambda s: request("get", s, inbox="a b"), "invalid_request"),
    ("get", lambda s: request("get", s, inbox="_INBOX.*"), "invalid_request"),
    ("get", lambda s: request("get", s, hashes="nope"), "bad_schema"),
    ("put", lambda s: request("put", s), "invalid_request"),  # no frames arrived for the transfer
    ("kv", lambda s: b"\x00", "bad_frame"),
    ("kv", lambda s: frame({"v": 7}), "unsupported_version"),
    ("kv", lambda s: frame({"offset": None}), "bad_schema"),
    ("kv", lambda s: frame({"offset": 10}), "bad_frame"),
    ("kv", lambda s: frame({"transfer_id": "huge", "total_bytes": 1 << 40}), "invalid_request"),
]


async def test_bad_input_gets_typed_errors(stores):
    store = stores["8MiB"]
    subject = {"lookup": subjects.kvstore_lookup, "get": subjects.kvstore_get, "put": subjects.kvstore_put,
               "kv": subjects.kvstore_kv}
    async with connect(store.url) as nc:
        for endpoint, build, code in BAD:
            reply = decode((await nc.request(subject[endpoint](store.id), build(store.id), timeout=5)).data)
            assert isinstance(reply, ErrorReply) and reply.code.value == code, (endpoint, code, reply)
        hashes, blob = blocks(2, 4 * KIB, seed=9)  # a present block sent to an inbox nobody reads
        await kv_put(nc, store.id, hashes, blob, 4 * KIB)
        reply = decode((await nc.request(subjects.kvstore_get(store.id), request("get", store.id, hashes=hashes))).data)
        assert reply.code.value == "invalid_request" and "nobody listens" in reply.message
        tid = "corrupt"  # frames arrive, but the put's checksums do not match them
        await send_kv(nc, subjects.kvstore_kv(store.id), tid, blob, window=2, timeout_s=5)
        wrong = KVTransfer(transfer_id=tid, num_blocks=2, block_bytes=4 * KIB, checksums=[1, 2])
        put = KVPutRequest(request_id="r", namespace=NS, hashes=hashes, transfer=wrong)
        assert decode((await nc.request(subjects.kvstore_put(store.id), encode(put))).data).code.value == "bad_frame"
        await send_kv(nc, subjects.kvstore_kv(store.id), tid, blob, window=2, timeout_s=5)
        put = KVPutRequest(request_id="r", namespace=NS, hashes=hashes[:1], transfer=wrong.model_copy(
            update={"checksums": block_checksums(blob, 4 * KIB)}))
        assert (decode((await nc.request(subjects.kvstore_put(store.id), encode(put))).data).code.value
                == "invalid_request")
        assert (await kv_lookup(nc, store.id, hashes)).leading == 2  # still serving
    assert store.proc.poll() is None


async def test_restart_keeps_disk_tier_and_corrupt_block_not_served(nats_server, tmp_path):
    store = await Store(nats_server.url, tmp_path, ram_mib=1).start()
    hashes, blob = blocks(24, 64 * KIB, seed=3)  # 1.5 MiB: the first 8 blocks are demoted to disk
    try:
        async with connect(store.url) as nc:
            assert (await kv_put(nc, store.id, hashes, blob, 64 * KIB)).stored == 24
            store.stop(signal.SIGKILL)  # a crash with no write-behind: RAM is lost, the disk tier stays
            await store.start()
            assert (await kv_lookup(nc, store.id, hashes)).present == [True] * 8 + [False] * 16
            store.stop()  # a clean stop writes RAM back too
            await store.start()
            assert (await kv_lookup(nc, store.id, hashes)).leading == 8
            raw = store.block_file(hashes[0]).read_bytes()
            store.block_file(hashes[0]).write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
            reply, got = await kv_get(nc, store.id, hashes[:8])
            assert reply.found == hashes[1:8] and got[hashes[1]] == blob[64 * KIB : 128 * KIB]
            assert not store.block_file(hashes[0]).exists()
            assert (await stats(nc, store.id))["corrupt_blocks"] == 1
            assert (await kv_lookup(nc, store.id, hashes[:2])).present == [False, True]
            for _ in range(50):
                events = await events_of(nc, store.id)
                if any(hashes[0] in e.removed for e in events):
                    break
            assert any(hashes[0] in e.removed for e in events)
            assert sum(e.cleared for e in events) == 3  # one per start
    finally:
        if store.proc.poll() is None:
            store.stop()


async def test_write_behind_keeps_ram_blocks_across_a_kill(nats_server, tmp_path):
    """With write-behind (every 0.2 s here; 1 s by default), a kill -9 after the round loses no block
    of the RAM tier: the restarted store finds all of them on disk."""
    store = await Store(nats_server.url, tmp_path, ram_mib=4, write_behind_s=0.2).start()
    hashes, blob = blocks(24, 64 * KIB, seed=5)  # 1.5 MiB: every block fits in RAM
    try:
        async with connect(store.url) as nc:
            assert (await kv_put(nc, store.id, hashes, blob, 64 * KIB)).stored == 24
            for _ in range(100):
                if (await stats(nc, store.id))["ram_unwritten_blocks"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await stats(nc, store.id))["ram_unwritten_blocks"] == 0, "write-behind never caught up"
            store.stop(signal.SIGKILL)
            await store.start()
            assert (await kv_lookup(nc, store.id, hashes)).present == [True] * 24, "blocks lost to the kill"
            reply, got = await kv_get(nc, store.id, hashes)
            assert got[hashes[5]] == blob[5 * 64 * KIB : 6 * 64 * KIB]
    finally:
        if store.proc.poll() is None:
            store.stop()
