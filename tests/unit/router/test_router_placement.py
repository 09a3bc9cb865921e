"""The router service on an in-process bus (tests/fakebus.py): heartbeats and KV events in,
``GenerateRequest`` over request-reply, the work forwarded to the chosen worker's subject, a
``RoutingDecision`` out. The workers are played by the test: a heartbeat and an endpoint that takes
work (``Ack``) and keeps what it got."""

from __future__ import annotations

import pytest
from fakebus import FakeBus, bus_settings, serving, take_work

from tandem.services.router.service import Router
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack, ErrorCode, ErrorReply
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat, RoutingDecision
from tandem.shared.protocol.kv import KVEvent
from tandem.shared.protocol.serving import (
    DecodeRequest,
    GenerateAccepted,
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
)

NS = "tiny/float32/test-layout/bs16"  # the workers' KV namespace: the index compares blocks within it
BS = 16
PROMPT = [(7 * i + 3) % 250 for i in range(5 * BS)]  # 5 full blocks


class FakeWorker:
    """A prefill or decode worker as the router sees it: heartbeats, and its work endpoint."""

    def __init__(self, bus: FakeBus, service: str, instance_id: str, model: str, running: int = 0,
                 max_model_len: int = 2048) -> None:
        self.bus, self.service, self.instance_id = bus, service, instance_id
        self.beat_msg = Heartbeat(service=service, instance_id=instance_id, host="test", pid=1, model=model,
                                  running=running, free_blocks=100, num_blocks=100, block_size=BS,
                                  max_model_len=max_model_len, kv_namespace=NS)
        self.work: list[PrefillRequest | DecodeRequest] = []

    async def answer(self) -> FakeWorker:
        """Take work on this worker's subject (a worker whose process is gone never does this)."""
        subject, kind = ((subjects.prefill(self.instance_id), PrefillRequest) if self.service == "prefill"
                         else (subjects.decode_admit(self.instance_id), DecodeRequest))

        await take_work(self.bus, subject, kind, self.work)
        return self

    async def beat(self) -> None:
        await self.bus.publish(subjects.heartbeat(self.service, self.instance_id), encode(self.beat_msg))


@pytest.fixture
async def router(tmp_path):
    bus = FakeBus()
    async with serving(Router(bus_settings(tmp_path, instance_id="router-t")), bus) as service:
        yield bus, service
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


async def workers(bus: FakeBus, model: str, *specs: tuple[str, str, int],
                  answering: bool = True) -> dict[str, FakeWorker]:
    """``(service, instance id, running)`` each: heartbeats sent (and endpoints up unless not ``answering``)."""
    out = {}
    for service, instance_id, running in specs:
        worker = FakeWorker(bus, service, instance_id, model, running)
        if answering:
            await worker.answer()
        await worker.beat()
        out[instance_id] = worker
    return out


def generate(request_id: str = "r1", **fields) -> bytes:
    fields.setdefault("prompt_token_ids", PROMPT)
    return encode(GenerateRequest(request_id=request_id, params=SamplingParams(max_tokens=4, temperature=0.0),
                                  stream_subject=f"_INBOX.tandem.client.{request_id}", **fields))


async def place(bus: FakeBus, payload: bytes) -> GenerateAccepted | ErrorReply:
    await bus.settle()  # the router has taken in every heartbeat and KV event sent so far
    return decode((await bus.request(subjects.router_generate("tandem"), payload, timeout=10)).data)


def decisions(bus: FakeBus) -> list[RoutingDecision]:
    return [decode(m.data, RoutingDecision) for m in bus.messages_on(subjects.ROUTER_DECISIONS)]


@pytest.mark.parametrize("cached_blocks", [0, 3], ids=["nothing-cached", "b-caches-3-blocks"])
async def test_the_worker_caching_the_prefix_gets_the_request(router, cached_blocks: int) -> None:
    """A is idle, B runs one sequence: B wins only when its cached prefix saves more than its load
    costs (5 - 3 + 1 < 5 - 0 + 0); the prefill worker prefills and hands off to the winner."""
    bus, service = router
    fleet = await workers(bus, service.meta.name, ("decode", "decode-a", 0), ("decode", "decode-b", 1),
                          ("prefill", "prefill-p", 0))
    if cached_blocks:
        stored = prefix_hashes(PROMPT, BS)[:cached_blocks]
        event = KVEvent(source="decode-b", service="decode", namespace=NS, seq=0, stored=stored)
        await bus.publish(subjects.kv_events("decode", "decode-b"), encode(event))
    winner = "decode-b" if cached_blocks else "decode-a"

    reply = await place(bus, generate())

    assert isinstance(reply, GenerateAccepted), reply
    assert (reply.decode_worker, reply.prefill_worker) == (winner, "prefill-p")
    assert reply.prompt_token_ids == PROMPT
    (work,) = fleet["prefill-p"].work
    assert isinstance(work, PrefillRequest) and work.decode_worker == winner
    assert (work.spec.request_id, work.spec.prompt_token_ids, work.spec.model) == ("r1", PROMPT, service.meta.name)
    assert work.spec.stream_subject == "_INBOX.tandem.client.r1" and work.spec.params.max_tokens == 4
    assert not fleet["decode-a"].work and not fleet["decode-b"].work, "the prefill worker admits it at decode"
    (decision,) = decisions(bus)
    assert (decision.decode_worker, decision.prefill_worker) == (winner, "prefill-p")
    cached = {c.instance_id: c.cached_blocks for c in decision.candidates}
    assert cached == {"decode-a": 0, "decode-b": cached_blocks}
    assert decision.candidates[0].instance_id == winner, "candidates come cheapest first"


@pytest.mark.parametrize("prefill", ["none", "gone"])
async def test_without_a_live_prefill_worker_decode_prefills_locally(router, prefill: str) -> None:
    """No prefill worker, or one whose last heartbeats linger but which no longer answers (no
    responders on its subject): the decode worker gets the whole request and prefills it itself."""
    bus, service = router
    fleet = await workers(bus, service.meta.name, ("decode", "decode-a", 0), ("decode", "decode-b", 2))
    if prefill == "gone":
        await workers(bus, service.meta.name, ("prefill", "prefill-p", 0), answering=False)

    reply = await place(bus, generate())

    assert isinstance(reply, GenerateAccepted), reply
    assert (reply.decode_worker, reply.prefill_worker) == ("decode-a", None)
    (work,) = fleet["decode-a"].work
    assert isinstance(work, DecodeRequest) and work.spec.prompt_token_ids == PROMPT
    assert work.transfer is None and work.ring is None and work.output_token_ids == [], "nothing was prefilled"
    assert not fleet["decode-b"].work
    (decision,) = decisions(bus)
    why = {"none": "no prefill worker is alive", "gone": "no prefill worker answered"}[prefill]
    assert decision.prefill_worker is None and decision.reason == f"{why}: decode prefills locally", decision.reason
    assert "prefill-p" not in service.workers["prefill"], "a worker that does not answer is dropped"


@pytest.fixture
async def limited_router(tmp_path):
    bus = FakeBus()
    settings = bus_settings(tmp_path, instance_id="router-t", router_max_inflight_per_worker=3)
    async with serving(Router(settings), bus) as service:
        yield bus, service
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


@pytest.mark.parametrize("owed", [0, 3])
async def test_requests_a_prefill_worker_holds_count_against_their_decode_worker(limited_router, owed) -> None:
    """A is idle by its own heartbeat, but the prefill worker still holds ``owed`` requests for it
    (prefilling, or handing them off): with 3 it is full (3 in flight at most), so B gets the request."""
    bus, service = limited_router
    fleet = await workers(bus, service.meta.name, ("decode", "decode-a", 0), ("decode", "decode-b", 1),
                          ("prefill", "prefill-p", 0))
    prefill = fleet["prefill-p"]
    prefill.beat_msg = prefill.beat_msg.model_copy(update={"owed_requests": {"decode-a": owed} if owed else {}})
    await prefill.beat()

    reply = await place(bus, generate())

    assert isinstance(reply, GenerateAccepted), reply
    assert reply.decode_worker == ("decode-b" if owed else "decode-a"), reply


@pytest.mark.parametrize("excluded", [["decode-b"], ["decode-b", "prefill-p"], ["decode-a", "decode-b"]],
                         ids=["the-cached-decode-worker", "and-the-prefill-worker", "every-decode-worker"])
async def test_a_migrated_request_is_never_placed_on_a_worker_its_client_saw_die(router, excluded) -> None:
    """B caches the prompt and its heartbeats are fresh (the router has not noticed its death),
    but the client saw it die: the request goes elsewhere, or, none being left, is refused
    naming what it may not use (the client tries again until a replacement is up)."""
    bus, service = router
    await workers(bus, service.meta.name, ("decode", "decode-a", 0), ("decode", "decode-b", 0),
                  ("prefill", "prefill-p", 0))
    stored = prefix_hashes(PROMPT, BS)[:3]
    await bus.publish(subjects.kv_events("decode", "decode-b"),
                      encode(KVEvent(source="decode-b", service="decode", namespace=NS, seq=0, stored=stored)))

    await bus.settle()
    for pool in service.workers.values():  # the client saw them die: their last beats are a second old
        for name in excluded:
            if name in pool:
                pool.beat(name, pool.payload(name), at=pool.last(name) - 1.0)
    reply = await place(bus, generate(exclude_workers=excluded))

    if "decode-a" in excluded:
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.NO_WORKERS, reply
        assert "besides decode-a, decode-b" in reply.message, reply.message
        return
    assert isinstance(reply, GenerateAccepted), reply
    assert reply.decode_worker == "decode-a"
    assert reply.prefill_worker == (None if "prefill-p" in excluded else "prefill-p")


@pytest.mark.parametrize(("payload", "code"), [
    (generate(model="some-other-model"), ErrorCode.UNKNOWN_MODEL),
    (generate(prompt="text as well"), ErrorCode.INVALID_REQUEST),  # prompt and prompt_token_ids both
    (generate(prompt_token_ids=None), ErrorCode.INVALID_REQUEST),  # neither
    (generate(prompt_token_ids=None, prompt=""), ErrorCode.INVALID_REQUEST),  # empty
    (generate(prompt_token_ids=[5, 100_000]), ErrorCode.INVALID_REQUEST),  # outside the vocabulary
    (generate(prompt_token_ids=list(range(100)) * 21), ErrorCode.PROMPT_TOO_LONG),  # 2100 >= max_model_len 2048
    (encode(Ack(request_id="r1")), ErrorCode.BAD_SCHEMA),  # a message of another kind
    (b"\xc1 not msgpack", ErrorCode.BAD_FRAME),
], ids=["unknown-model", "prompt-and-ids", "no-prompt", "empty-prompt", "token-outside-vocab", "prompt-too-long",
        "wrong-kind", "not-msgpack"])
async def test_a_bad_request_gets_a_typed_error_and_the_router_goes_on(router, payload: bytes, code: ErrorCode) -> None:
    bus, service = router
    fleet = await workers(bus, service.meta.name, ("decode", "decode-a", 0), ("prefill", "prefill-p", 0))

    reply = await place(bus, payload)

    assert isinstance(reply, ErrorReply) and reply.code == code, reply
    assert not fleet["decode-a"].work and not fleet["prefill-p"].work and not decisions(bus)
    assert isinstance(await place(bus, generate("r2")), GenerateAccepted), "the next good request is placed"


@pytest.mark.parametrize(("params", "param", "says"), [
    (dict(max_tokens=None, min_tokens=5000), "min_tokens",
     "min_tokens is 5000, but the context (2048 tokens) leaves 1968 after the 80-token prompt: ask for at most 1968"),
    (dict(logit_bias=[(5, 1.0), ("vocab", -3.0)]), "logit_bias", "logit_bias names token id {vocab}, outside the "
                                                                 "vocabulary of {vocab} tokens"),
], ids=["min_tokens-past-the-granted-max", "logit_bias-outside-the-vocabulary"])
async def test_what_no_worker_could_serve_is_refused_naming_its_field(router, params, param, says) -> None:
    bus, service = router
    fleet = await workers(bus, service.meta.name, ("decode", "decode-a", 0), ("prefill", "prefill-p", 0))
    vocab = service.meta.config.vocab_size
    if "logit_bias" in params:
        params["logit_bias"] = [(vocab if token == "vocab" else token, bias) for token, bias in params["logit_bias"]]
    payload = encode(GenerateRequest(request_id="r1", prompt_token_ids=PROMPT, params=SamplingParams(**params),
                                     stream_subject="_INBOX.tandem.client.r1"))

    reply = await place(bus, payload)

    assert isinstance(reply, ErrorReply), reply
    assert (reply.code, reply.param, reply.message) == (ErrorCode.INVALID_REQUEST, param, says.format(vocab=vocab))
    assert not fleet["decode-a"].work and not fleet["prefill-p"].work


async def test_no_decode_worker_is_a_typed_error(router) -> None:
    bus, service = router
    await workers(bus, service.meta.name, ("prefill", "prefill-p", 0))
    reply = await place(bus, generate())
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.NO_WORKERS and reply.request_id == "r1"


@pytest.mark.parametrize("chars,in_thread", [(100, False), (40_000, True)])
async def test_a_long_prompt_is_tokenized_off_the_event_loop(router, monkeypatch, chars, in_thread):
    """Defect 5 of the trust-boundary trial: a 7.5M-character prompt, tokenized on the router's
    event loop, held every other request up for ~0.3 s before it was refused."""
    import threading

    _, service = router
    seen: list[bool] = []
    encode_text = service.meta.tokenizer.encode

    def recording(text: str) -> list[int]:
        seen.append(threading.current_thread() is not threading.main_thread())
        return encode_text(text)

    monkeypatch.setattr(service.meta.tokenizer, "encode", recording)
    msg = GenerateRequest(request_id="long", prompt="x" * chars, stream_subject="_INBOX.c.long")
    assert len(await service.tokenize(msg)) == chars
    assert seen == [in_thread], f"{chars} characters tokenized {'in a thread' if seen[0] else 'on the loop'}"
