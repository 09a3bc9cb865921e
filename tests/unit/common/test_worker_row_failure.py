"""A request the engine ends alone (its own part of a step raised) gets a typed error on its own
stream; the requests batched with it stream their tokens to the end and the worker goes on serving.

The decode service runs on the in-process bus (tests/fakebus.py) with its real engine on the tiny
model, prefilling locally. The failure is injected where an abuse trial found it: one request's
``top_k`` overflowing while the batch's sampling tensors are built (the edge refuses such values
now, so a marker value that passes validation stands for it and the real conversion is handed
``2**63`` in its place).
"""

from __future__ import annotations

import asyncio

import pytest
from factories import make_engine, make_prompts, make_request, run
from fakebus import FakeBus, bus_settings, serving, wait_until

import tandem.shared.engine.sampling as sampling
from tandem.services.decode.service import DecodeService
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.serving import DecodeRequest, RequestSpec, SamplingParams, StreamChunk

POISON_TOP_K = 4242
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BAD = SamplingParams(max_tokens=8, temperature=1.0, top_k=POISON_TOP_K, seed=1, ignore_eos=True)


@pytest.fixture
async def decode_worker(tmp_path, tiny):
    bus = FakeBus()
    settings = bus_settings(tmp_path, model=tiny.name, instance_id="decode-t", num_blocks=64, kv_ring_mib=0,
                            max_model_len=128)
    async with serving(DecodeService(settings), bus) as service:
        yield bus, service
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


@pytest.fixture
def poisoned_top_k(monkeypatch) -> None:
    real = sampling.host_values_to

    def convert(device, values, dtype):
        return real(device, [2**63 if v == POISON_TOP_K else v for v in values], dtype)

    monkeypatch.setattr(sampling, "host_values_to", convert)


async def generate(bus: FakeBus, service: DecodeService, request_id: str, prompt: list[int],
                   params: SamplingParams) -> list[StreamChunk]:
    """Admit a request to prefill locally; the chunks of its stream up to the one that ends it."""
    spec = RequestSpec(request_id=request_id, prompt_token_ids=prompt, params=params,
                       stream_subject=f"_INBOX.tandem.client.{request_id}", model=service.model_name)
    stream = await bus.subscribe(spec.stream_subject)
    reply = decode((await bus.request(subjects.decode_admit(service.instance_id),
                                      encode(DecodeRequest(spec=spec)), timeout=10)).data)
    assert isinstance(reply, Ack), reply
    chunks: list[StreamChunk] = []
    while not chunks or chunks[-1].finish_reason is None:
        msg = decode((await stream.next_msg(timeout=30)).data)
        if isinstance(msg, StreamChunk):  # probes ask whether anyone listens
            chunks.append(msg)
    return chunks


async def test_the_failing_request_alone_gets_a_worker_failure(decode_worker, tiny, poisoned_top_k) -> None:
    bus, service = decode_worker
    prompts = make_prompts()
    good = {f"g{i}": prompts[i] for i in (1, 4, 5)}
    expected = run(make_engine(tiny), [make_request(rid, p, params=GREEDY) for rid, p in good.items()])

    # Admitted together, so they share the engine's steps with the bad request.
    streams = await asyncio.gather(generate(bus, service, "bad", prompts[6], BAD),
                                   *(generate(bus, service, rid, p, GREEDY) for rid, p in good.items()))
    bad, *goods = streams
    end = bad[-1]
    assert end.finish_reason == "error" and end.error is not None, end
    assert end.error.code is ErrorCode.WORKER_FAILURE and end.error.request_id == "bad"
    assert "Overflow" in end.error.message
    for request_id, chunks in zip(good, goods):
        assert [t for c in chunks for t in c.token_ids] == expected[request_id].tokens, f"{request_id}: tokens differ"
        assert chunks[-1].finish_reason == "length" and all(c.error is None for c in chunks)

    await wait_until(lambda: not service.busy() and service.heartbeat().free_blocks == service.engine_config.num_blocks,
                     what="the worker to hold nothing")
    later = await generate(bus, service, "later", prompts[1], GREEDY)
    assert [t for c in later for t in c.token_ids] == expected["g1"].tokens, "the worker stopped serving"
