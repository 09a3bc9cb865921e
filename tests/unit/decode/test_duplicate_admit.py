"""A second admit of a request already admitted (or still being admitted) is refused before its KV
is copied, and the first goes on to the end.

The decode service runs on the in-process bus (tests/fakebus.py) with its real engine on the tiny
model. The two admits arrive at once, so the second lands while the first is still reading its
KV: the case the old order (read the KV, then check the id) let through to a wasted copy.
"""

from __future__ import annotations

import asyncio

import pytest
from fakebus import FakeBus, bus_settings, serving

from tandem.services.decode.service import DecodeService
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import DecodeRequest, RequestSpec, SamplingParams, StreamChunk


@pytest.fixture
async def decode_worker(tmp_path, tiny):
    bus = FakeBus()
    settings = bus_settings(tmp_path, model=tiny.name, instance_id="decode-dup", num_blocks=64, kv_ring_mib=0,
                            max_model_len=128)
    async with serving(DecodeService(settings), bus) as service:
        yield bus, service
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


async def test_a_duplicate_admit_is_refused_before_its_kv_is_read(decode_worker, monkeypatch) -> None:
    bus, service = decode_worker
    reads: list[str] = []
    real = service.kv_receiver.take

    async def counting(msg):  # noqa: ANN001 - a DecodeRequest
        reads.append(msg.spec.request_id)
        return await real(msg)

    monkeypatch.setattr(service.kv_receiver, "take", counting)
    spec = RequestSpec(request_id="twice", prompt_token_ids=[70, 117, 122, 33], model=service.model_name,
                       params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       stream_subject="_INBOX.tandem.client.twice")
    stream = await bus.subscribe(spec.stream_subject)
    admit = encode(DecodeRequest(spec=spec))
    replies = await asyncio.gather(*(bus.request(subjects.decode_admit(service.instance_id), admit, timeout=10)
                                     for _ in range(2)))
    answers = [decode(r.data) for r in replies]
    acks = [a for a in answers if isinstance(a, Ack)]
    refused = [a for a in answers if isinstance(a, ErrorReply)]
    assert len(acks) == 1 and len(refused) == 1, answers
    assert refused[0].code is ErrorCode.INVALID_REQUEST and "already running here" in refused[0].message
    assert reads == ["twice"], f"the duplicate's KV was read too: {reads}"
    tokens: list[int] = []
    while True:
        msg = decode((await stream.next_msg(timeout=30)).data)
        if isinstance(msg, StreamChunk):
            tokens += msg.token_ids
            if msg.finish_reason is not None:
                assert msg.finish_reason == "length" and msg.error is None, msg
                break
    assert len(tokens) == 6, "the first admit runs to the end"
