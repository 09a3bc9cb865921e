"""The router places embedding requests (``tandem.v1.router.embed.<owner>``) on an in-process bus
(tests/fakebus.py): on a decode worker alone, even beside a live prefill worker, ranked by cached
prefix and load; the pooling resolved to the model's default; its refusals typed and naming their
field; and through the same admission queue as generation (a saturated fleet answers ``overloaded``).
The workers are played by the test."""

from __future__ import annotations

import pytest
from fakebus import FakeBus, bus_settings, serving, take_work

from tandem.services.router.service import Router, truncated
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ErrorReply
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.embedding import EmbedRequest, EmbedWork, PoolingParams
from tandem.shared.protocol.fleet import Heartbeat, RoutingDecision
from tandem.shared.protocol.kv import KVEvent
from tandem.shared.protocol.serving import GenerateAccepted, PrefillRequest

NS = "tiny/float32/test-layout/bs16"
BS = 16
PROMPT = [(7 * i + 3) % 250 for i in range(5 * BS)]  # 5 full blocks
OWNER = "UOWNERKEY"
CONTEXT = 128


def beat(service: str, instance_id: str, model: str, running: int = 0) -> bytes:
    return encode(Heartbeat(service=service, instance_id=instance_id, host="test", pid=1, model=model,
                            running=running, free_blocks=100, num_blocks=100, block_size=BS, max_num_seqs=2,
                            max_model_len=CONTEXT, kv_namespace=NS))


def embed(request_id: str = "e1", stream_subject: str | None = None, **fields) -> bytes:
    fields.setdefault("prompt_token_ids", PROMPT)
    return encode(EmbedRequest(request_id=request_id, stream_subject=stream_subject or f"_INBOX.{OWNER}.c.{request_id}",
                               **fields))


async def ask(bus: FakeBus, payload: bytes) -> GenerateAccepted | ErrorReply:
    await bus.settle()
    return decode((await bus.request(subjects.router_embed(OWNER), payload, timeout=10)).data)


async def take_embeddings(bus: FakeBus, instance_id: str, into: list[EmbedWork]) -> None:
    async def take(msg) -> None:
        work = decode(msg.data, EmbedWork)
        into.append(work)
        await msg.respond(encode(Ack(request_id=work.request_id)))

    await bus.subscribe(subjects.decode_embed(instance_id), cb=take)


@pytest.fixture
async def fleet(tmp_path):
    """A router with two decode workers (B running one sequence) and a prefill worker, all answering."""
    bus = FakeBus()
    settings = bus_settings(tmp_path, instance_id="router-e", router_max_queued_requests=0)
    async with serving(Router(settings), bus) as router:
        work: dict[str, list] = {"decode-a": [], "decode-b": [], "prefill-p": []}
        await take_embeddings(bus, "decode-a", work["decode-a"])
        await take_embeddings(bus, "decode-b", work["decode-b"])
        await take_work(bus, subjects.prefill("prefill-p"), PrefillRequest, work["prefill-p"])
        await bus.publish(subjects.heartbeat("decode", "decode-a"), beat("decode", "decode-a", router.meta.name))
        await bus.publish(subjects.heartbeat("decode", "decode-b"), beat("decode", "decode-b", router.meta.name, 1))
        await bus.publish(subjects.heartbeat("prefill", "prefill-p"), beat("prefill", "prefill-p", router.meta.name))
        yield bus, router, work
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


@pytest.mark.parametrize("cached_blocks", [0, 3], ids=["nothing-cached", "b-caches-3-blocks"])
async def test_an_embedding_goes_to_a_decode_worker_alone(fleet, cached_blocks: int) -> None:
    bus, router, work = fleet
    if cached_blocks:
        stored = prefix_hashes(PROMPT, BS)[:cached_blocks]
        await bus.publish(subjects.kv_events("decode", "decode-b"),
                          encode(KVEvent(source="decode-b", service="decode", namespace=NS, seq=0, stored=stored)))
    winner, loser = ("decode-b", "decode-a") if cached_blocks else ("decode-a", "decode-b")

    reply = await ask(bus, embed(pooling=PoolingParams(dimensions=8)))

    assert isinstance(reply, GenerateAccepted), reply
    assert (reply.decode_worker, reply.prefill_worker, reply.max_tokens) == (winner, None, 0)
    assert reply.prompt_token_ids == PROMPT
    (taken,) = work[winner]
    assert (taken.request_id, taken.prompt_token_ids, taken.model) == ("e1", PROMPT, router.meta.name)
    assert taken.pooling == PoolingParams(method=router.meta.default_pooling, dimensions=8), taken.pooling
    assert taken.stream_subject == f"_INBOX.{OWNER}.c.e1" and taken.arrival_time > 0
    assert not work[loser] and not work["prefill-p"], "an embedding is computed by one decode worker"
    (decision,) = [decode(m.data, RoutingDecision) for m in bus.messages_on(subjects.ROUTER_DECISIONS)]
    assert decision.decode_worker == winner and decision.prefill_worker is None
    assert decision.reason.startswith("embedding, last pooling"), decision.reason


@pytest.mark.parametrize(("keep", "expected"), [(None, PROMPT), (5, PROMPT[-5:]), (-1, PROMPT[-CONTEXT:])])
async def test_truncate_prompt_tokens_keeps_the_last_ones(fleet, keep, expected) -> None:
    bus, router, work = fleet
    long = PROMPT * 2  # 160 tokens: past the 128-token context unless cut
    reply = await ask(bus, embed(prompt_token_ids=long if keep == -1 else PROMPT, truncate_prompt_tokens=keep,
                                 pooling=PoolingParams(method="mean")))
    assert isinstance(reply, GenerateAccepted), reply
    (taken,) = work[reply.decode_worker]
    want = long[-CONTEXT:] if keep == -1 else expected
    assert taken.prompt_token_ids == want and reply.prompt_token_ids == want
    assert taken.pooling.method == "mean"


def test_truncated_without_a_bound_keeps_everything() -> None:
    assert truncated([1, 2, 3], None, 2) == [1, 2, 3] and truncated([1, 2, 3], 2, 9) == [2, 3]
    assert truncated([1, 2, 3], -1, 2) == [2, 3]


@pytest.mark.parametrize(("fields", "code", "param"), [
    (dict(pooling=PoolingParams(dimensions=257)), ErrorCode.INVALID_REQUEST, "dimensions"),
    (dict(prompt_token_ids=PROMPT * 2), ErrorCode.PROMPT_TOO_LONG, "prompt"),
    (dict(prompt_token_ids=[1, 2, 300]), ErrorCode.INVALID_REQUEST, "prompt"),
    (dict(model="another-model"), ErrorCode.UNKNOWN_MODEL, "model"),
    (dict(prompt="text too"), ErrorCode.INVALID_REQUEST, "prompt"),
    (dict(stream_subject="_INBOX.USOMEONEELSE.c.e1"), ErrorCode.INVALID_REQUEST, "stream_subject"),
], ids=["dimensions-past-hidden-size", "longer-than-the-context", "outside-vocabulary", "unknown-model",
        "prompt-and-token-ids", "someone-elses-stream"])
async def test_an_embedding_no_worker_can_serve_is_refused_naming_its_field(fleet, fields, code, param) -> None:
    bus, _, work = fleet
    reply = await ask(bus, embed(**fields))
    assert isinstance(reply, ErrorReply), reply
    assert (reply.code, reply.param) == (code, param), reply
    assert "\n" not in reply.message
    assert not any(work.values()), "a refused embedding reached a worker"


async def test_a_saturated_fleet_refuses_an_embedding_as_overloaded(fleet) -> None:
    """Both decode workers report their whole batch running and the queue holds nothing (0 queued
    requests): the embedding is refused at once, as generation would be."""
    bus, router, work = fleet
    for name in ("decode-a", "decode-b"):
        await bus.publish(subjects.heartbeat("decode", name), beat("decode", name, router.meta.name, running=4))
    reply = await ask(bus, embed())
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.OVERLOADED, reply
    assert not any(work.values())
