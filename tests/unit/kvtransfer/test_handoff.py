"""A prefill -> decode KV hand-off through :mod:`tandem.shared.kvtransfer.handoff`, with real rings in
/dev/shm and real frames over the session's nats-server: the sender picks the ring when the decode
worker's ring is on this host, on, large enough and has room within ``wait_s``, and frames otherwise
(over nats-py or the channel's bulk connections); the receiver turns either descriptor into the
blocks that were sent, gives back a refused admit's slots and frames, reclaims slots whose admit
never came, and refuses KV of another layout or another worker's ring with a typed error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys

import nats
import pytest
import torch
from support import flushed

from tandem.shared.infra.config import BusSettings, KVRingSettings
from tandem.shared.kvtransfer import handoff
from tandem.shared.kvtransfer.channel import KVChannel
from tandem.shared.kvtransfer.handoff import Destination, HandoffReceiver, HandoffSender
from tandem.shared.kvtransfer.ring import ShmRing, host_id
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.kv import KVTransfer, RingSlots
from tandem.shared.protocol.serving import DecodeRequest, RequestSpec, SamplingParams

KV_SHAPE = (2, 2, 16, 2, 32)  # one block: layers, K/V, tokens, heads, head dim; 16 KiB in float32
BLOCK_BYTES = 16 * 1024
NAMESPACE = "tiny@test/float32/16"
RING = KVRingSettings(mib=1, slot_kib=4, wait_s=0.05, copies=2)  # 1 MiB: 64 blocks
RING_BLOCKS = (1 << 20) // BLOCK_BYTES
VIAS = ["nats-py", "bulk"]


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *KV_SHAPE), generator=torch.Generator().manual_seed(seed))


def admit_for(sent: RingSlots | KVTransfer, request_id: str = "r1", namespace: str = NAMESPACE) -> DecodeRequest:
    spec = RequestSpec(request_id=request_id, prompt_token_ids=[1, 2, 3], model="tiny",
                       params=SamplingParams(max_tokens=4), stream_subject=f"_INBOX.test.{request_id}")
    wire = {"ring": sent} if isinstance(sent, RingSlots) else {"transfer": sent}
    return DecodeRequest(spec=spec, kv_namespace=namespace, **wire)


@contextlib.asynccontextmanager
async def channel_on(url: str, via: str):
    nc = await nats.connect(url)
    channel = await KVChannel.open(nc, BusSettings(kv_connections=2 if via == "bulk" else 0, request_timeout_s=10),
                                   options={}, name="tandem-test")
    assert (channel.links is not None) == (via == "bulk"), "bulk connections open only when asked for"
    try:
        yield channel
    finally:
        await channel.close()
        await nc.close()


@pytest.fixture
async def pair(nats_server, request):
    """``(sender, receiver, destination)``: a decode worker's receiver with a ring (``ring`` settings,
    RING unless the test parametrizes ``pair``) and a prefill worker's sender, each on a channel of its
    own (over bulk connections when ``via`` is "bulk")."""
    via, ring = getattr(request, "param", ("nats-py", RING))
    async with channel_on(nats_server.url, via) as out, channel_on(nats_server.url, via) as into:
        receiver = HandoffReceiver("decode-t/0", kv_namespace=NAMESPACE, kv_shape=KV_SHAPE, dtype=torch.float32,
                                   device=torch.device("cpu"), frames_blocks=2 * RING_BLOCKS, step_blocks=1, ring=ring)
        sender = HandoffSender(out, ring)
        subject = subjects.decode_kv("decode-t")
        await receiver.serve(into, subject)
        await flushed(into.nc)  # at the server before the sender's probe, which comes on another connection
        try:
            yield sender, receiver, Destination("decode-t", subject, receiver.ring_name, receiver.host)
        finally:
            sender.close()
            receiver.close()


async def test_the_ring_carries_a_same_host_hand_off(pair) -> None:
    sender, receiver, to = pair
    assert to.ring.startswith("tandem-kv-") and to.ring.endswith("-decode_t_0"), \
        "the ring is labelled with the worker id, in the characters a label allows"
    kv = blocks(5)
    sent = await sender.send(kv, to, "r1")
    assert isinstance(sent, RingSlots) and sent.ring == to.ring and sent.length == 5 * BLOCK_BYTES
    got = await receiver.take(admit_for(sent))
    assert torch.equal(got, kv), "the ring changed the blocks"
    assert receiver.transfers == {"ring": 1, "nats": 0}
    assert receiver.ring.free_slots() == receiver.ring.num_slots, "taking the blocks frees their slots"


@pytest.mark.parametrize("pair", [(via, RING) for via in VIAS], ids=VIAS, indirect=True)
@pytest.mark.parametrize("why", ["another host", "no ring advertised", "ring gone", "larger than the ring"])
async def test_frames_carry_what_the_ring_cannot(pair, why: str) -> None:
    sender, receiver, to = pair
    kv = blocks(RING_BLOCKS + 1 if why == "larger than the ring" else 3, seed=1)
    if why == "another host":
        to = Destination(to.worker, to.subject, to.ring, host="some-other-host")
    elif why == "no ring advertised":
        to = Destination(to.worker, to.subject)
    elif why == "ring gone":
        gone = ShmRing.create("gone", slot_bytes=4096, num_slots=4)
        gone.close()
        to = Destination(to.worker, to.subject, gone.name, to.host)
    sent = await sender.send(kv, to, "r1")
    assert isinstance(sent, KVTransfer), f"{why}: the hand-off should have gone as frames"
    assert (sent.num_blocks, sent.block_bytes, len(sent.checksums)) == (kv.shape[0], BLOCK_BYTES, kv.shape[0])
    assert torch.equal(await receiver.take(admit_for(sent)), kv), "the frames changed the blocks"
    assert receiver.transfers == {"ring": 0, "nats": 1}
    assert receiver.frames.bytes_in_flight == 0, "a taken transfer is forgotten"


@pytest.mark.parametrize("pair", [("nats-py", KVRingSettings(mib=0))], indirect=True)
async def test_a_worker_with_the_ring_off_advertises_none_and_sends_frames(pair) -> None:
    sender, receiver, to = pair
    assert receiver.ring is None and to.ring == ""
    kv = blocks(2, seed=2)
    ringed = Destination(to.worker, to.subject, "tandem-kv-1-0123abcd", host_id())  # the sender's ring is off too
    sent = await sender.send(kv, ringed, "r1")
    assert isinstance(sent, KVTransfer)
    assert torch.equal(await receiver.take(admit_for(sent)), kv)


async def test_a_full_ring_waits_then_falls_back_to_frames(pair, caplog) -> None:
    sender, receiver, to = pair
    hog = await sender.send(blocks(RING_BLOCKS, seed=3), to, "hog")  # fills every slot; its admit never comes
    assert isinstance(hog, RingSlots) and receiver.ring.free_slots() == 0
    kv = blocks(2, seed=4)
    with caplog.at_level(logging.WARNING, logger="tandem.handoff"):
        sent = await sender.send(kv, to, "r2")
    assert isinstance(sent, KVTransfer), "no room within wait_s: frames"
    assert f"KV ring {to.ring} still full after {RING.wait_s:.1f} s; r2 goes as NATS frames" in caplog.text
    assert torch.equal(await receiver.take(admit_for(sent, "r2")), kv)

    receiver.discard(admit_for(hog, "hog"))  # room again: the next hand-off takes the ring
    again = await sender.send(kv, to, "r3")
    assert isinstance(again, RingSlots)
    assert torch.equal(await receiver.take(admit_for(again, "r3")), kv)


async def test_room_that_turns_up_within_the_wait_is_used(pair) -> None:
    sender, receiver, to = pair
    sender.ring_settings = KVRingSettings(mib=1, slot_kib=4, wait_s=10.0, copies=2)
    hog = await sender.send(blocks(RING_BLOCKS, seed=5), to, "hog")
    sending = asyncio.ensure_future(sender.send(blocks(2, seed=6), to, "r2"))
    await asyncio.sleep(0.05)
    assert not sending.done(), "the hand-off should wait for room"
    await receiver.take(admit_for(hog, "hog"))  # the ring empties as the earlier admit is taken
    assert isinstance(await asyncio.wait_for(sending, 5), RingSlots)


async def test_discard_gives_back_ring_slots_and_frames(pair) -> None:
    sender, receiver, to = pair
    ringed = await sender.send(blocks(4, seed=7), to, "r1")
    assert receiver.ring.free_slots() < receiver.ring.num_slots
    receiver.discard(admit_for(ringed))
    assert receiver.ring.free_slots() == receiver.ring.num_slots, "a refused admit's slots go back at once"

    framed = await sender.send(blocks(4, seed=8), Destination(to.worker, to.subject), "r2")
    assert receiver.frames.bytes_in_flight == 4 * BLOCK_BYTES
    receiver.discard(admit_for(framed, "r2"))
    assert receiver.frames.bytes_in_flight == 0, "a refused admit's frames are forgotten"
    receiver.discard(admit_for(framed, "r2"))  # twice: nothing left to give back, and no error
    with pytest.raises(ProtocolError) as refused:
        await receiver.take(admit_for(ringed))
    assert refused.value.code is ErrorCode.BAD_FRAME, "discarded slots cannot be taken any more"


@pytest.mark.parametrize("foreign", ["another ring", "another layout"])
async def test_take_refuses_another_workers_ring_and_another_layout(pair, foreign: str) -> None:
    sender, receiver, to = pair
    sent = await sender.send(blocks(2, seed=9), to, "r1")
    if foreign == "another ring":
        other = ShmRing.create("other", slot_bytes=4096, num_slots=4)
        admit = admit_for(sent.model_copy(update={"ring": other.name}))
        other.close()
        message = "is not this worker's"
    else:
        admit = admit_for(sent, namespace="other-model@x/bfloat16/16")
        message = "cannot enter"
    with pytest.raises(ProtocolError) as refused:
        await receiver.take(admit)
    assert refused.value.code is ErrorCode.INVALID_REQUEST and message in refused.value.message
    assert receiver.transfers == {"ring": 0, "nats": 0}


async def test_blocks_of_another_size_are_refused(pair) -> None:
    sender, receiver, to = pair
    odd = torch.randn(3, 1000)  # 4000-byte "blocks": not a whole number of the receiver's
    sent = await sender.send(odd, to, "r1")
    with pytest.raises(ProtocolError) as refused:
        await receiver.take(admit_for(sent))
    assert refused.value.code is ErrorCode.INVALID_REQUEST and "whole number" in refused.value.message


async def test_an_admit_without_kv_takes_nothing(pair) -> None:
    _, receiver, _ = pair
    spec = RequestSpec(request_id="local", prompt_token_ids=[1], model="tiny", params=SamplingParams(max_tokens=1),
                       stream_subject="_INBOX.test.local")
    assert await receiver.take(DecodeRequest(spec=spec)) is None


async def test_slots_whose_admit_never_came_are_reclaimed(pair, monkeypatch) -> None:
    sender, receiver, to = pair
    monkeypatch.setattr(handoff, "RING_STALE_S", 0.0)
    await sender.send(blocks(4, seed=10), to, "lost")
    reclaiming = asyncio.ensure_future(receiver.reclaim_every(0.01))
    try:
        for _ in range(200):
            if receiver.ring.free_slots() == receiver.ring.num_slots:
                break
            await asyncio.sleep(0.01)
        assert receiver.ring.free_slots() == receiver.ring.num_slots, "the lost admit's slots stayed taken"
    finally:
        reclaiming.cancel()


async def test_a_channel_on_a_connection_other_than_nats_py_opens_no_bulk_connections() -> None:
    from fakebus import FakeBus

    channel = await KVChannel.open(FakeBus(), BusSettings(kv_connections=4), options={}, name="t")
    assert channel.links is None
    await channel.close()


def test_the_service_base_loads_no_kv_transport() -> None:
    """Every service derives from ServiceRuntime; only those that move KV load the transport."""
    probe = "import json, sys; import tandem.services.common.runtime; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = [m for m in json.loads(done.stdout) if m.startswith("tandem.shared.kvtransfer")]
    assert not loaded, f"tandem.services.common.runtime loads {loaded}"
