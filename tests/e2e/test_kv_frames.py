"""KV frames over a real nats-server: :func:`send_kv` into a :class:`KVReceiver`, each end over
nats-py or over bulk connections (:mod:`tandem.shared.kvtransfer.bulklinks`), on a server with 8 MiB
frames and on one with nats-server's default 1 MiB (where a large block spans frames).

Every transfer arrives whole with the sender's and the receiver's checksums equal; a slow receiver
holds the sender to its window of uncredited bytes; a lost frame fails the send with ``timeout`` and
the take with ``bad_frame``, a corrupt one the take with ``bad_frame``, a malformed one gets its typed
error and disturbs no other transfer; nobody listening, or a receiver without room, fails the send
before any byte moves; bulk connections present the service's identity and its role's permissions
(over TLS too), come back after the server restarts, fail typed against something that is not a
NATS server, and leave the frames to nats-py when they cannot present the identity. Speed is the
benchmark's business (``benchmarks/kv_transfer.py``), not asserted here."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import random
import socket
import ssl
import threading
import time
import uuid

import msgpack
import nats
import pytest
from nats.errors import NoRespondersError
from support import flushed

from tandem.shared.auth.credentials import connect_options
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra import natsserver
from tandem.shared.kvtransfer.bulkconn import BulkConnection, BulkConnectionError
from tandem.shared.kvtransfer.bulklinks import BulkLinks
from tandem.shared.kvtransfer.frames import (
    KVCredit,
    KVReceiver,
    block_checksums,
    encode_reply,
    frame_payload_bytes,
    pack_frame,
    send_kv,
    unpack_frame,
)
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION, ErrorCode, ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.kv import KVTransfer

KIB, MIB = 1024, 1024 * 1024
VIAS = ["nats-py", "bulk"]


@pytest.fixture(scope="module")
def servers():
    """Two servers: tandem's own max_payload (8 MiB), and nats-server's default (1 MiB)."""
    big = natsserver.NatsServer.start(jetstream=False)
    saved, natsserver.MAX_PAYLOAD = natsserver.MAX_PAYLOAD, MIB
    try:
        small = natsserver.NatsServer.start(jetstream=False)
    finally:
        natsserver.MAX_PAYLOAD = saved
    yield {"8MiB": big.url, "1MiB": small.url}
    big.stop()
    small.stop()


@contextlib.asynccontextmanager
async def party(url: str, via: str, options: dict | None = None, size: int = 3):
    """One process's side of a transfer: its nats-py connection and, ``via`` bulk, its bulk connections."""
    nc = await nats.connect(url, **(options or {}))
    links = None
    if via == "bulk":
        links = await BulkLinks(lambda: url, options=options, size=size, timeout_s=10).start()
        assert links.open_connections == size, "the bulk connections did not open"
    try:
        yield nc, links
    finally:
        if links is not None:
            await links.close()
        await nc.close()


async def serve(nc, links, subject: str, receiver: KVReceiver, delay_s: float = 0.0):
    """Land ``subject``'s frames in ``receiver`` as a service does: from the bulk connections' threads,
    or from a nats-py subscription; ``delay_s`` makes it a slow receiver."""
    if links is not None:
        if delay_s:
            land = receiver.on_stream

            def slow(size, reader, *deferred):
                time.sleep(delay_s)
                return land(size, reader, *deferred)
            receiver.on_stream = slow
        return await links.serve_kv(subject, receiver)

    async def on_frame(msg) -> None:
        await asyncio.sleep(delay_s)
        reply = receiver.answer(msg.data)
        if reply is not None and msg.reply:
            await nc.publish(msg.reply, reply)

    sub = await nc.subscribe(subject, cb=on_frame, pending_bytes_limit=1 << 30)
    await flushed(nc)  # at the server before the sender's probe, which comes on another connection
    return sub


def blob_of(num_blocks: int, block_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(num_blocks * block_bytes)


def transfer_of(tid: str, blob: bytes, block_bytes: int, sums: list[int]) -> KVTransfer:
    return KVTransfer(transfer_id=tid, num_blocks=len(blob) // block_bytes, block_bytes=block_bytes, checksums=sums)


class Tampering:
    """Stands between ``send_kv`` and where it publishes (bulk connections or nats-py), seeing each
    frame; ``change(offset, payload)`` returns the payload to send instead, or None to lose it."""

    def __init__(self, nc, links, change=None) -> None:
        self.nc, self.links, self.change = nc, links, change or (lambda offset, payload: payload)
        self.published: list[tuple[int, int]] = []  # (frame end offset, when), in publishing order

    @property
    def max_payload(self) -> int:
        return self.links.max_payload if self.links is not None else self.nc.max_payload

    @property
    def usable(self) -> bool:
        return self.links is not None and self.links.usable

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

    async def subscribe(self, *args, **kwargs):
        return await self.nc.subscribe(*args, **kwargs)

    async def request(self, *args, **kwargs):
        return await self.nc.request(*args, **kwargs)

    def _frame(self, data: bytes) -> bytes | None:
        header, payload = unpack_frame(data)
        self.published.append((header["offset"] + len(payload), len(self.published)))
        changed = self.change(header["offset"], bytes(payload))
        return None if changed is None else pack_frame(header, changed)

    async def publish(self, subject, payload, reply="", then=None):
        if self.links is not None:  # called as a FramePublisher: payload is (head, view)
            frame = self._frame(b"".join(payload))
            if frame is not None:
                await self.links.publish(subject, [frame], reply, then)
            elif then is not None:
                then()
            return
        frame = self._frame(payload)
        if frame is not None:
            await self.nc.publish(subject, frame, reply=reply)


async def send(tamper: Tampering, subject: str, tid: str, blob: bytes, block_bytes: int, **kwargs) -> list[int]:
    links = tamper if tamper.links is not None else None
    return await send_kv(tamper, subject, tid, blob, block_bytes=block_bytes, links=links, **kwargs)


@pytest.mark.parametrize("server", ["8MiB", "1MiB"])
@pytest.mark.parametrize("block_kib", [512, 1536])
@pytest.mark.parametrize("sender", VIAS)
@pytest.mark.parametrize("receiver_via", VIAS)
async def test_transfers_arrive_whole_with_both_ends_checksums_equal(servers, server, block_kib, sender,
                                                                      receiver_via) -> None:
    url, block = servers[server], block_kib * KIB
    subject = f"test.kv.{uuid.uuid4().hex}"
    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    async with party(url, receiver_via) as (rnc, rlinks), party(url, sender) as (snc, slinks):
        await serve(rnc, rlinks, subject, receiver)
        blobs = {f"t{i}": blob_of(5, block, seed=i) for i in range(3)}
        sums = await asyncio.gather(*(send_kv(snc, subject, tid, blob, window=2, timeout_s=30, block_bytes=block,
                                              links=slinks) for tid, blob in blobs.items()))
        for (tid, blob), got in zip(blobs.items(), sums):
            assert got == block_checksums(blob, block), f"{tid}: the sender's checksums are not the blocks' crc32"
            out = receiver.take(transfer_of(tid, blob, block, got))
            assert bytes(out) == blob, f"{tid}: the bytes that arrived differ from those sent"
    assert receiver.bytes_in_flight == 0, "taken transfers must leave nothing behind"


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("via", VIAS)
async def test_a_slow_receiver_holds_the_sender_to_its_window(servers, window, via) -> None:
    url, block = servers["1MiB"], 256 * KIB
    chunk = frame_payload_bytes(MIB, block)
    subject, tid = f"test.kv.{uuid.uuid4().hex}", "slow"
    blob = blob_of(48, block, seed=5)  # 12 frames
    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    async with party(url, via) as (rnc, rlinks), party(url, via) as (snc, slinks):
        await serve(rnc, rlinks, subject, receiver, delay_s=0.05)
        tamper = Tampering(snc, slinks)
        landed_when_sent = []

        def watch(offset, payload):
            landed_when_sent.append((offset + len(payload), receiver.received(tid)))
            return payload
        tamper.change = watch
        sums = await send(tamper, subject, tid, blob, block, window=window, timeout_s=30)
    worst = max(end - landed for end, landed in landed_when_sent)
    assert worst <= window * chunk, (f"window {window}: {worst} bytes were out before the receiver landed them; "
                                     f"the window allows {window * chunk}")
    assert bytes(receiver.take(transfer_of(tid, blob, block, sums))) == blob


@pytest.mark.parametrize("via", VIAS)
async def test_a_lost_frame_is_a_typed_error_on_both_ends_and_the_next_transfer_works(servers, via) -> None:
    url, block = servers["1MiB"], 256 * KIB
    chunk = frame_payload_bytes(MIB, block)
    subject = f"test.kv.{uuid.uuid4().hex}"
    blob = blob_of(12, block, seed=6)
    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    async with party(url, via) as (rnc, rlinks), party(url, via) as (snc, slinks):
        await serve(rnc, rlinks, subject, receiver)
        lossy = Tampering(snc, slinks, lambda offset, payload: None if offset == chunk else payload)
        with pytest.raises(ProtocolError) as err:
            await send(lossy, subject, "lossy", blob, block, window=8, timeout_s=1.0)
        assert err.value.code == ErrorCode.TIMEOUT, f"a lost frame must time the send out, got {err.value}"
        with pytest.raises(ProtocolError) as err:
            receiver.take(transfer_of("lossy", blob, block, block_checksums(blob, block)))
        assert err.value.code == ErrorCode.BAD_FRAME and "bytes arrived" in err.value.message, err.value
        sums = await send(Tampering(snc, slinks), subject, "after", blob, block, window=8, timeout_s=30)
        assert bytes(receiver.take(transfer_of("after", blob, block, sums))) == blob


@pytest.mark.parametrize("via", VIAS)
async def test_a_corrupt_frame_never_reaches_the_taker(servers, via) -> None:
    url, block = servers["1MiB"], 256 * KIB
    chunk = frame_payload_bytes(MIB, block)
    subject = f"test.kv.{uuid.uuid4().hex}"
    blob = blob_of(12, block, seed=7)

    def flip(offset, payload):
        return payload[:100] + bytes([payload[100] ^ 1]) + payload[101:] if offset == 2 * chunk else payload

    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    async with party(url, via) as (rnc, rlinks), party(url, via) as (snc, slinks):
        await serve(rnc, rlinks, subject, receiver)
        sums = await send(Tampering(snc, slinks, flip), subject, "bent", blob, block, window=4, timeout_s=30)
        assert sums == block_checksums(blob, block), "the sender checksums what it was given"
        with pytest.raises(ProtocolError) as err:
            receiver.take(transfer_of("bent", blob, block, sums))
        bad_block = 2 * chunk // block
        assert err.value.code == ErrorCode.BAD_FRAME and f"blocks [{bad_block}]" in err.value.message, err.value


@pytest.mark.parametrize("via", VIAS)
async def test_nobody_listening_fails_the_send_at_once(servers, via) -> None:
    async with party(servers["8MiB"], via) as (nc, links):
        with pytest.raises(NoRespondersError):
            await send_kv(nc, f"test.kv.{uuid.uuid4().hex}", "t", bytes(64 * KIB), window=4, timeout_s=30,
                          block_bytes=16 * KIB, links=links)


@pytest.mark.parametrize("via", VIAS)
async def test_a_receiver_without_room_refuses_before_the_bytes_move(servers, via) -> None:
    subject = f"test.kv.{uuid.uuid4().hex}"
    receiver = KVReceiver(max_bytes_in_flight=MIB)
    async with party(servers["8MiB"], via) as (rnc, rlinks), party(servers["8MiB"], via) as (snc, slinks):
        await serve(rnc, rlinks, subject, receiver)
        with pytest.raises(ProtocolError) as err:
            await send_kv(snc, subject, "big", bytes(2 * MIB), window=4, timeout_s=30, block_bytes=MIB, links=slinks)
        assert err.value.code == ErrorCode.INVALID_REQUEST and "does not fit" in err.value.message, err.value


BAD_FRAMES = [
    (b"\x00", "bad_frame"),
    (pack_frame({"v": 7, "transfer_id": "x", "offset": 0, "total_bytes": 4}, b"abcd"), "unsupported_version"),
    (pack_frame({"v": SCHEMA_VERSION, "offset": 0}, b"abcd"), "bad_schema"),
    (pack_frame({"v": SCHEMA_VERSION, "transfer_id": "x", "offset": 2, "total_bytes": 4}, b"abcd"), "bad_frame"),
    (pack_frame({"v": SCHEMA_VERSION, "transfer_id": "x", "offset": 0, "total_bytes": 1 << 40}, b"abcd"),
     "invalid_request"),
]


@pytest.mark.parametrize("via", VIAS)
async def test_malformed_frames_get_typed_errors_and_hurt_no_transfer_in_flight(servers, via) -> None:
    url, block = servers["1MiB"], 256 * KIB
    subject = f"test.kv.{uuid.uuid4().hex}"
    blob = blob_of(32, block, seed=8)
    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    async with party(url, via) as (rnc, rlinks), party(url, via) as (snc, slinks), party(url, "nats-py") as (bad, _):
        await serve(rnc, rlinks, subject, receiver, delay_s=0.01)
        good = asyncio.ensure_future(send_kv(snc, subject, "good", blob, window=2, timeout_s=30, block_bytes=block,
                                             links=slinks))
        for frame, code in BAD_FRAMES:
            reply = decode((await bad.request(subject, frame, timeout=10)).data)
            assert isinstance(reply, ErrorReply) and reply.code.value == code, f"expected {code}, got {reply!r}"
        sums = await good
        assert bytes(receiver.take(transfer_of("good", blob, block, sums))) == blob, "the good transfer was hurt"


@pytest.fixture(scope="module")
def tls_pem(tmp_path_factory):
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv frames test CA")])

    def signed(subject, public_key, serial, *extensions):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
                   .serial_number(serial).not_valid_before(now).not_valid_after(now + datetime.timedelta(hours=2)))
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    ca = signed(ca_name, ca_key.public_key(), 1, (x509.BasicConstraints(ca=True, path_length=None), True))
    cert = signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]), key.public_key(), 2,
                  (x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False))
    paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


@pytest.fixture(scope="module", params=["plain", "tls"])
def secured(request, tmp_path_factory, tls_pem):
    """A server that requires identities (tandem's roles), over TLS or not."""
    ring = Keyring.generate()
    tls = f'tls {{ cert_file: "{tls_pem["cert"]}", key_file: "{tls_pem["key"]}" }}\n' if request.param == "tls" else ""
    server = natsserver.NatsServer.start(workdir=tmp_path_factory.mktemp("kv-auth") / "server", jetstream=False,
                                         auth_config=ring.server_config() + tls)
    context = ssl.create_default_context(cafile=str(tls_pem["ca"])) if tls else None
    url = server.url.replace("nats://", "tls://") if tls else server.url
    yield ring, url, context
    server.stop()


# (sender role, receiver role, the subject the receiver takes frames on: its own endpoint or inbox)
DIRECTIONS = [("prefill", "decode", "endpoint"), ("kvstore", "decode", "inbox"), ("decode", "kvstore", "endpoint"),
              ("kvstore", "prefill", "inbox")]


@pytest.mark.parametrize("sender_role,receiver_role,where", DIRECTIONS,
                         ids=[f"{s}-to-{r}-{w}" for s, r, w in DIRECTIONS])
async def test_bulk_connections_carry_the_services_identity_and_permissions(secured, sender_role, receiver_role,
                                                                             where) -> None:
    ring, url, tls = secured
    sender_opts = connect_options(ring.role_key(sender_role), f"{sender_role}-1", tls=tls)
    receiver_opts = connect_options(ring.role_key(receiver_role), f"{receiver_role}-1", tls=tls)
    block = 128 * KIB
    blob = blob_of(20, block, seed=9)
    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    async with party(url, "bulk", receiver_opts) as (rnc, rlinks), party(url, "bulk", sender_opts) as (snc, slinks):
        subject = (rnc.new_inbox() if where == "inbox" else
                   subjects.decode_kv(f"{receiver_role}-1") if receiver_role == "decode" else
                   subjects.kvstore_kv(f"{receiver_role}-1"))
        await serve(rnc, rlinks, subject, receiver)
        sums = await send_kv(snc, subject, "authed", blob, window=4, timeout_s=30, block_bytes=block, links=slinks)
        assert bytes(receiver.take(transfer_of("authed", blob, block, sums))) == blob
        with pytest.raises(ProtocolError) as err:  # another worker's frames: the role does not let it read them
            await rlinks.serve_kv(subjects.decode_kv("someone-else"), receiver)
        assert err.value.code == ErrorCode.WORKER_FAILURE and "could subscribe" in err.value.message, err.value


async def test_bulk_connections_come_back_after_the_server_restarts(tmp_path) -> None:
    server = natsserver.NatsServer.start(workdir=tmp_path / "server", jetstream=False)
    block, subject = 256 * KIB, "test.kv.restart"
    blob = blob_of(8, block, seed=10)
    receiver = KVReceiver(max_bytes_in_flight=64 * MIB)
    try:
        async with party(server.url, "bulk") as (rnc, rlinks), party(server.url, "bulk") as (snc, slinks):
            await serve(rnc, rlinks, subject, receiver)
            server.process.kill()
            server.process.wait()
            server.restart()
            deadline = time.monotonic() + 60
            while not (rlinks.open_connections == slinks.open_connections == 3 and rnc.is_connected
                       and snc.is_connected):
                assert time.monotonic() < deadline, "the connections did not come back within a minute"
                await asyncio.sleep(0.1)
            for attempt in range(100):  # the receiver's subscriptions are renewed right after its connections
                try:
                    sums = await send_kv(snc, subject, f"after-{attempt}", blob, window=4, timeout_s=30,
                                         block_bytes=block, links=slinks)
                    break
                except NoRespondersError:
                    await asyncio.sleep(0.1)
            assert bytes(receiver.take(transfer_of(f"after-{attempt}", blob, block, sums))) == blob
    finally:
        server.stop()


def test_credit_messages_are_versioned_msgpack_never_pickle() -> None:
    raw = msgpack.unpackb(encode_reply(KVCredit(transfer_id="t", received=5)))
    assert raw == {"v": SCHEMA_VERSION, "kind": "kv_credit", "transfer_id": "t", "received": 5}


@pytest.mark.parametrize("greeting", [b"", b"HTTP/1.1 200 OK\r\n"], ids=["silent", "not-nats"])
def test_a_bulk_connection_to_something_else_fails_typed_and_in_time(greeting) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.sendall(greeting)
    threading.Thread(target=accept, daemon=True).start()
    try:
        with pytest.raises(BulkConnectionError):
            BulkConnection(f"nats://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0)
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


async def test_links_that_cannot_present_the_identity_leave_frames_to_nats_py(servers) -> None:
    """Connect options a bulk connection does not speak (a creds file path, say) open none; the
    transfer then goes over nats-py whole, as without bulk connections."""
    url, block = servers["8MiB"], 64 * KIB
    links = await BulkLinks(lambda: url, options={"user_credentials": "/nowhere.creds"}, size=2).start()
    assert not links.usable and links.open_connections == 0
    subject, blob = f"test.kv.{uuid.uuid4().hex}", blob_of(4, block, seed=11)
    receiver = KVReceiver(max_bytes_in_flight=MIB)
    async with party(url, "nats-py") as (rnc, _), party(url, "nats-py") as (snc, _):
        await serve(rnc, None, subject, receiver)
        sums = await send_kv(snc, subject, "plain", blob, window=2, timeout_s=30, block_bytes=block, links=links)
        assert bytes(receiver.take(transfer_of("plain", blob, block, sums))) == blob
    await links.close()
