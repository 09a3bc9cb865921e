"""The prefill service on an in-process bus (tests/fakebus.py), with its real engine on the tiny
model: a ``PrefillRequest`` in; the first token out on the client's stream subject; the prompt's KV
as acknowledged NATS frames to the decode worker, then the ``DecodeRequest`` that admits it there.
The router, the client and the decode worker are played by the test. The bus's small
``max_payload`` makes every hand-off several frames."""

from __future__ import annotations

import asyncio

import pytest
import torch
from factories import make_engine, make_request, run
from fakebus import FakeBus, bus_settings, serving, wait_until

from tandem.services.prefill.service import PrefillService
from tandem.shared.kvtransfer.frames import block_checksums, unpack_frame
from tandem.shared.model.reference import reference_generate
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import DecodeRequest, PrefillRequest, RequestSpec, SamplingParams, StreamChunk
from tandem.shared.protocol.views import KVTransferEvent

BS = 16
MAX_PAYLOAD = 64 * 1024  # one tiny-model block is 64 KiB: frames of a bit less, several per hand-off
PROMPT = list(b"def walk(tree):\n    for child in tree.children:")  # 47 tokens: 2 full blocks and a partial one
DECODE = "decode-x"


class FakeDecode:
    """The decode worker's side of a hand-off: KV frames (acknowledged with ``ok`` as the decode
    service does) and the admitting ``DecodeRequest`` (answered with ``Ack``)."""

    def __init__(self, bus: FakeBus) -> None:
        self.bus = bus
        self.frames: list[bytes] = []
        self.admitted: asyncio.Future[DecodeRequest] = asyncio.get_running_loop().create_future()

    async def start(self) -> FakeDecode:
        async def on_frame(msg) -> None:
            self.frames.append(msg.data)
            await msg.respond(b"ok")

        async def on_admit(msg) -> None:
            admit = decode(msg.data, DecodeRequest)
            self.admitted.set_result(admit)
            await msg.respond(encode(Ack(request_id=admit.spec.request_id)))

        await self.bus.subscribe(subjects.decode_kv(DECODE), cb=on_frame)
        await self.bus.subscribe(subjects.decode_admit(DECODE), cb=on_admit)
        return self

    def reassemble(self, transfer_id: str, total: int) -> bytearray:
        blob, covered = bytearray(total), 0
        for frame in self.frames:
            header, payload = unpack_frame(frame)
            assert header["transfer_id"] == transfer_id and header["total_bytes"] == total
            blob[header["offset"] : header["offset"] + len(payload)] = payload
            covered += len(payload)
        assert covered == total, f"frames carried {covered} of {total} bytes"
        return blob


@pytest.fixture
async def prefill(tmp_path, tiny):
    bus = FakeBus(max_payload=MAX_PAYLOAD)
    # An empty data dir: the service loads the tiny model the ``tiny`` fixture holds.
    settings = bus_settings(tmp_path, model=tiny.name, instance_id="prefill-t", num_blocks=64, kv_window=2,
                            max_model_len=128)
    async with serving(PrefillService(settings), bus) as service:
        yield bus, service
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


def spec_for(service: PrefillService, request_id: str, prompt: list[int] = PROMPT, max_tokens: int = 8,
             **fields) -> RequestSpec:
    return RequestSpec(request_id=request_id, prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       stream_subject=f"_INBOX.tandem.client.{request_id}", model=service.model_name, **fields)


async def ask(bus: FakeBus, service: PrefillService, spec: RequestSpec) -> Ack | ErrorReply:
    work = PrefillRequest(spec=spec, decode_worker=DECODE)
    return decode((await bus.request(subjects.prefill(service.instance_id), encode(work), timeout=10)).data)


async def chunks(stream, n: int) -> list[StreamChunk]:
    return [decode((await stream.next_msg(timeout=30)).data, StreamChunk) for _ in range(n)]


async def idle(service: PrefillService) -> None:
    await wait_until(lambda: not service.busy() and service.heartbeat().free_blocks == service.engine_config.num_blocks,
                     what="the prefill worker to hold nothing")


async def test_first_token_to_the_client_and_checksummed_kv_frames_to_decode(prefill, tiny) -> None:
    bus, service = prefill
    dec = await FakeDecode(bus).start()
    spec = spec_for(service, "r1")
    stream = await bus.subscribe(spec.stream_subject)

    assert isinstance(await ask(bus, service, spec), Ack)
    (first,) = await chunks(stream, 1)
    admit = await asyncio.wait_for(dec.admitted, 30)

    expected, _ = reference_generate(tiny.model, PROMPT, 1)
    assert (first.request_id, first.index, first.token_ids) == ("r1", 0, list(expected))
    assert first.finish_reason is None and first.error is None, "the decode worker finishes the request"
    assert admit.spec == spec and admit.output_token_ids == first.token_ids
    assert admit.kv_namespace == service.kv_namespace and admit.ring is None and admit.first_token_time > 0
    transfer = admit.transfer
    assert transfer is not None and transfer.num_blocks == -(-len(PROMPT) // BS)
    assert len(dec.frames) > transfer.num_blocks, "the bus's max_payload should have split every block"
    blob = dec.reassemble(transfer.transfer_id, transfer.num_blocks * transfer.block_bytes)
    assert block_checksums(blob, transfer.block_bytes) == transfer.checksums, "frames differ from what was sent"

    # The frames hold the prompt's K/V: the same as a prefill on an engine of our own.
    own = run(make_engine(tiny, num_blocks=64), [make_request("own", PROMPT, 8, prefill_only=True)])["own"].kv
    sent = torch.frombuffer(blob, dtype=own.dtype).view(own.shape)

    def by_position(kv: torch.Tensor) -> torch.Tensor:  # [blocks, layers, 2, block, heads, dim] -> per token
        return kv.permute(0, 3, 1, 2, 4, 5).reshape(-1, *kv.shape[1:3], *kv.shape[4:])[: len(PROMPT)]

    torch.testing.assert_close(by_position(sent), by_position(own))
    await idle(service)  # the hand-off is over once the transfer is reported
    (event,) = [decode(m.data, KVTransferEvent) for m in bus.messages_on(subjects.KV_TRANSFERS)]
    assert (event.request_id, event.source, event.dest, event.path) == ("r1", service.instance_id, DECODE, "nats")
    assert (event.blocks, event.bytes) == (transfer.num_blocks, len(blob))
    await bus.settle()
    assert stream.pending_msgs == 0, "the prefill worker streams only the first token"


async def test_a_first_token_that_ends_the_request_is_not_handed_off(prefill) -> None:
    bus, service = prefill
    dec = await FakeDecode(bus).start()
    spec = spec_for(service, "one", max_tokens=1)
    stream = await bus.subscribe(spec.stream_subject)
    assert isinstance(await ask(bus, service, spec), Ack)
    (only,) = await chunks(stream, 1)
    assert len(only.token_ids) == 1 and only.finish_reason == "length"
    await idle(service)
    await bus.settle()
    assert not dec.frames and not dec.admitted.done(), "nothing goes to decode"


async def test_a_vanished_decode_worker_fails_the_request_on_its_stream(prefill) -> None:
    """No responders on the decode worker's KV subject: the client hears a typed error after its
    first token, and the prefill worker keeps nothing."""
    bus, service = prefill
    spec = spec_for(service, "lost")
    stream = await bus.subscribe(spec.stream_subject)
    assert isinstance(await ask(bus, service, spec), Ack)
    first, failed = await chunks(stream, 2)
    assert len(first.token_ids) == 1 and first.error is None
    assert failed.finish_reason == "error" and failed.error.code == ErrorCode.WORKER_FAILURE
    assert "NoResponders" in failed.error.message
    await idle(service)


@pytest.mark.parametrize(("change", "code"), [
    ({"model": "some-other-model"}, ErrorCode.UNKNOWN_MODEL),
    ({"prompt_token_ids": PROMPT * 3}, ErrorCode.PROMPT_TOO_LONG),  # 141 tokens, max_model_len 128
    ({"prompt_token_ids": [5, 300]}, ErrorCode.INVALID_REQUEST),  # outside the vocabulary
])
async def test_a_request_it_cannot_serve_is_refused_with_a_typed_error(prefill, change: dict, code: ErrorCode) -> None:
    bus, service = prefill
    spec = spec_for(service, "bad").model_copy(update=change)
    reply = await ask(bus, service, spec)
    assert isinstance(reply, ErrorReply) and reply.code == code, reply
    await idle(service)
    assert not bus.messages_on(spec.stream_subject)


async def test_prompt_logprobs_come_with_the_first_token_and_no_prefix_is_fetched(prefill, tiny) -> None:
    """A store holding the prompt's first blocks is not asked for them when the request wants
    prompt logprobs (each prompt token must be scored here); without them, it is."""
    from tandem.shared.model.reference import reference_logits

    bus, service = prefill
    dec = await FakeDecode(bus).start()
    asked: list[bytes] = []

    async def store(msg) -> None:  # a store that fails every fetch: the worker computes the prefix
        asked.append(msg.data)
        await msg.respond(b"")

    await bus.subscribe(subjects.kvstore_get("store-x"), cb=store)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    spec = spec_for(service, "scored").model_copy(update={"params": params})
    stream = await bus.subscribe(spec.stream_subject)
    work = PrefillRequest(spec=spec, decode_worker=DECODE, kvstore="store-x", kvstore_fetch_blocks=2,
                          kvstore_held_blocks=2)
    reply = decode((await bus.request(subjects.prefill(service.instance_id), encode(work), timeout=10)).data)
    assert isinstance(reply, Ack)
    (first,) = await chunks(stream, 1)
    await asyncio.wait_for(dec.admitted, 30)
    assert not asked, "the prefix must not come from the store"
    expected = torch.log_softmax(reference_logits(tiny.model, PROMPT), dim=-1)
    assert len(first.prompt_logprobs) == len(PROMPT) and first.prompt_logprobs[0] is None
    for position, entry in enumerate(first.prompt_logprobs[1:], start=1):
        assert entry.logprob == pytest.approx(expected[position - 1, PROMPT[position]].item(), abs=1e-4)
    await idle(service)

    plain = spec_for(service, "plain")
    work = work.model_copy(update={"spec": plain})
    await bus.subscribe(plain.stream_subject)
    dec.admitted = asyncio.get_running_loop().create_future()
    assert isinstance(decode((await bus.request(subjects.prefill(service.instance_id), encode(work),
                                                timeout=10)).data), Ack)
    await asyncio.wait_for(dec.admitted, 30)
    assert asked, "without prompt logprobs the store is asked"
    await idle(service)


async def test_a_migrated_request_streams_only_its_next_token_and_hands_off_every_token(prefill, tiny) -> None:
    """Resumed output tokens (a client migrating the request) are computed with the prompt: the client
    gets only the next token, at index len(resumed), and the decode worker the KV of prompt and
    resumed tokens with the resumed tokens and the new one."""
    bus, service = prefill
    dec = await FakeDecode(bus).start()
    expected = [int(t) for t in reference_generate(tiny.model, PROMPT, 6)[0]]
    resumed = expected[:5]
    spec = spec_for(service, "r-resumed", max_tokens=8, resume_output_token_ids=resumed)
    stream = await bus.subscribe(spec.stream_subject)

    assert isinstance(await ask(bus, service, spec), Ack)
    (first,) = await chunks(stream, 1)
    admit = await asyncio.wait_for(dec.admitted, 30)
    assert (first.index, first.token_ids) == (5, [expected[5]]), "the resumed tokens are not sent again"
    assert admit.output_token_ids == [*resumed, expected[5]]
    assert admit.transfer.num_blocks == -(-(len(PROMPT) + 5) // BS), "the KV of the resumed tokens goes along"
    await idle(service)
    await bus.settle()
