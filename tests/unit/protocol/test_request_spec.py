"""One request spec, carried whole: the router builds it once, prefill forwards it unchanged to
decode, and each worker's engine request comes from it. And the client refuses, before sending
anything, every value out of the protocol's bounds (the bus tests are in ``test_bad_input.py``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from support import BAD_PROMPT_TOKEN_IDS, BAD_SAMPLING, value_id

from tandem.client import Client, InvalidRequestError
from tandem.services.common.worker import engine_request
from tandem.services.prefill.service import handoff_request
from tandem.services.router.service import decode_request, prefill_request, request_spec
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import DecodeRequest, GenerateRequest, PrefillRequest, RequestSpec, SamplingParams

BLOCK_SIZE = 16
PROMPT = list(range(40, 80))  # 2 full blocks and a partial one
PARAMS = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, seed=5, stop=["\n\n"],
                        stop_token_ids=[3, 2**31 - 1])
DECODE_BEAT = Heartbeat(service="decode", instance_id="decode-a", host="h", pid=1, model="tiny",
                        host_id="host-1", kv_ring="ring-a")


def generate_request() -> GenerateRequest:
    return GenerateRequest(request_id="r-1", prompt="ignored: the router tokenized it", params=PARAMS,
                           stream_subject="_INBOX.tandem.c.r-1")


def over_the_bus(message):
    """What the receiver gets: the message encoded and decoded as the services do."""
    return decode(encode(message), type(message))


def test_spec_reaches_decode_unchanged_through_prefill() -> None:
    spec = request_spec(generate_request(), PROMPT, "tiny", accepted_at=1700000000.25, max_model_len=2048)
    assert (spec.request_id, spec.prompt_token_ids, spec.params, spec.model) == ("r-1", PROMPT, PARAMS, "tiny")
    assert spec.stream_subject == "_INBOX.tandem.c.r-1" and spec.arrival_time == 1700000000.25

    prefill = over_the_bus(prefill_request(spec, DECODE_BEAT, store="kvstore-a", fetch=1, held=1))
    assert isinstance(prefill, PrefillRequest) and prefill.spec == spec, "the prefill worker got another spec"
    assert (prefill.decode_worker, prefill.decode_ring, prefill.decode_host) == ("decode-a", "ring-a", "host-1")
    assert (prefill.kvstore, prefill.kvstore_fetch_blocks, prefill.kvstore_held_blocks) == ("kvstore-a", 1, 1)

    admit = over_the_bus(handoff_request(prefill, [17], "tiny/ns", BLOCK_SIZE, first_token_time=1700000000.5))
    assert isinstance(admit, DecodeRequest) and admit.spec == prefill.spec == spec, \
        f"the spec changed on its way from prefill to decode: {admit.spec!r} != {spec!r}"
    assert admit.output_token_ids == [17] and admit.first_token_time == 1700000000.5
    assert admit.kv_namespace == "tiny/ns" and admit.kvstore == "kvstore-a"
    assert admit.kvstore_held_blocks == len(PROMPT) // BLOCK_SIZE, "prefill offers the prompt's full blocks itself"


@pytest.mark.parametrize("asked,context,granted", [(None, 2048, 2048 - len(PROMPT)), (5, 2048, 5),
                                                   (2048 - len(PROMPT), 2048, 2048 - len(PROMPT))])
def test_spec_grants_max_tokens_within_the_context(asked: int | None, context: int, granted: int) -> None:
    msg = generate_request().model_copy(update={"params": PARAMS.model_copy(update={"max_tokens": asked})})
    spec = request_spec(msg, PROMPT, "tiny", 1.0, context)
    assert spec.params.max_tokens == granted, f"asked {asked} with a {context}-token context"


@pytest.mark.parametrize("asked,context,code,param", [(2048 - len(PROMPT) + 1, 2048, "invalid_request", "max_tokens"),
                                                      (1, len(PROMPT), "prompt_too_long", "prompt"),
                                                      (None, len(PROMPT), "prompt_too_long", "prompt")])
def test_spec_refuses_what_the_context_cannot_hold(asked, context: int, code: str, param: str) -> None:
    """vLLM refuses a max_tokens beyond what the context leaves; it is never silently cut."""
    msg = generate_request().model_copy(update={"params": PARAMS.model_copy(update={"max_tokens": asked})})
    with pytest.raises(ProtocolError) as caught:
        request_spec(msg, PROMPT, "tiny", 1.0, context)
    assert (caught.value.code.value, caught.value.param) == (code, param), caught.value.message
    if param == "max_tokens":
        assert f"at most {context - len(PROMPT)}" in caught.value.message, "the message should say what fits"


@pytest.mark.parametrize("min_tokens,refused", [(2048 - len(PROMPT), False), (2048 - len(PROMPT) + 1, True)])
def test_spec_refuses_min_tokens_past_the_max_tokens_it_grants(min_tokens: int, refused: bool) -> None:
    """An unset max_tokens becomes what the context leaves; a min_tokens above that is refused
    naming min_tokens (the granted pair would fail SamplingParams' own check on every worker)."""
    params = SamplingParams(max_tokens=None, min_tokens=min_tokens)
    msg = generate_request().model_copy(update={"params": params})
    if not refused:
        spec = request_spec(msg, PROMPT, "tiny", 1.0, 2048)
        assert over_the_bus(decode_request(spec, store="", fetch=0, held=0)).spec == spec, "a spec every worker decodes"
        return
    with pytest.raises(ProtocolError) as caught:
        request_spec(msg, PROMPT, "tiny", 1.0, 2048)
    assert (caught.value.code.value, caught.value.param) == ("invalid_request", "min_tokens")
    assert f"at most {2048 - len(PROMPT)}" in caught.value.message


@pytest.mark.parametrize("bias,refused", [([(0, 1.0), (258, -1.0)], False), ([(259, 1.0)], True), ([], False)])
def test_logit_bias_past_the_vocabulary_is_refused(bias, refused: bool) -> None:
    from tandem.services.router.service import check_logit_bias

    params = SamplingParams(logit_bias=bias)
    if not refused:
        check_logit_bias(params, 259)
        return
    with pytest.raises(ProtocolError) as caught:
        check_logit_bias(params, 259)
    assert (caught.value.code.value, caught.value.param) == ("invalid_request", "logit_bias")


def test_spec_reaches_a_decode_worker_prefilling_alone() -> None:
    spec = request_spec(generate_request(), PROMPT, "tiny", accepted_at=12.0, max_model_len=2048)
    admit = over_the_bus(decode_request(spec, store="kvstore-a", fetch=2, held=2))
    assert admit.spec == spec and admit.output_token_ids == [] and admit.transfer is None and admit.ring is None
    assert (admit.kvstore, admit.kvstore_fetch_blocks, admit.kvstore_held_blocks) == ("kvstore-a", 2, 2)


@pytest.mark.parametrize("hop", ["prefill", "decode"])
def test_engine_request_is_the_spec(hop: str) -> None:
    spec = request_spec(generate_request(), PROMPT, "tiny", 1.0, 2048)
    work = (engine_request(spec, prefill_only=True) if hop == "prefill"
            else engine_request(spec, output_token_ids=[17], export_on_finish=True))
    assert work.request_id == spec.request_id and work.prompt_token_ids == spec.prompt_token_ids
    assert work.params is spec.params, "the engine takes the spec's sampling parameters as they are"
    assert work.prompt_token_ids is not spec.prompt_token_ids, "the engine must not share the message's list"
    assert (work.prefill_only, work.output_token_ids, work.export_on_finish) == (
        (True, [], False) if hop == "prefill" else (False, [17], True))


def test_a_migrated_request_carries_its_resumed_tokens_to_every_engine_request() -> None:
    msg = generate_request().model_copy(update={"resume_output_token_ids": [7, 8, 9]})
    spec = request_spec(msg, PROMPT, "tiny", 1.0, 2048)
    assert spec.resume_output_token_ids == [7, 8, 9] and spec.params.max_tokens == PARAMS.max_tokens, \
        "max_tokens counts the resumed tokens: the grant does not change"
    prefill = over_the_bus(prefill_request(spec, DECODE_BEAT, store="", fetch=0, held=0))
    assert engine_request(prefill.spec, prefill_only=True).output_token_ids == [7, 8, 9]
    local = over_the_bus(decode_request(spec, store="", fetch=0, held=0))
    assert engine_request(local.spec, output_token_ids=local.output_token_ids).output_token_ids == [7, 8, 9]
    handed_off = engine_request(spec, output_token_ids=[7, 8, 9, 17])
    assert handed_off.output_token_ids == [7, 8, 9, 17], "a hand-off's tokens begin with the resumed ones"


@pytest.mark.parametrize("resumed,refused", [(8, False), (9, True), (12, True)])
def test_a_migrated_request_with_nothing_left_to_generate_is_refused(resumed: int, refused: bool) -> None:
    msg = generate_request().model_copy(update={"resume_output_token_ids": list(range(resumed))})
    if refused:
        with pytest.raises(ProtocolError, match="already has all its 9 output tokens") as caught:
            request_spec(msg, PROMPT, "tiny", 1.0, 2048)
        assert caught.value.param == "resume_output_token_ids"
    else:
        assert len(request_spec(msg, PROMPT, "tiny", 1.0, 2048).resume_output_token_ids) == resumed


class NoBus:
    """Stands in for the NATS connection: any use of it means the client sent something."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the client used NATS ({name}) for a request it should have refused")


# Beyond what msgpack carries: these used to raise OverflowError inside the client's encode.
UNENCODABLE_SAMPLING = [("stop_token_ids", [2**70]), ("seed", 2**64), ("max_tokens", 2**70), ("top_k", 2**64)]
CLIENT_SAMPLING = BAD_SAMPLING + UNENCODABLE_SAMPLING


@pytest.mark.parametrize("name,value", CLIENT_SAMPLING, ids=[f"{n}={value_id(v)}" for n, v in CLIENT_SAMPLING])
async def test_client_refuses_bad_sampling_before_sending(name: str, value: object) -> None:
    client = Client(NoBus())
    with pytest.raises(InvalidRequestError, match=f"invalid sampling parameters: {name}") as caught:
        await client.complete("hello", request_id="bad-params", **{name: value})
    assert caught.value.request_id == "bad-params", "the error should carry the request id"


@pytest.mark.parametrize("ids", [*BAD_PROMPT_TOKEN_IDS, [2**64], [1, 2**70]], ids=value_id)
async def test_client_refuses_bad_prompt_token_ids_before_sending(ids: list[int]) -> None:
    client = Client(NoBus())
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        async for _ in client.generate(ids, max_tokens=4):
            pass


@pytest.mark.parametrize("request_id", ["x" * 129, "a.b", "a*", "a>", "a b", "tab\tid", "lone\ud800", 2**64, ""],
                         ids=["overlong", "dot", "star", "gt", "space", "tab", "lone-surrogate", "int-2**64", "empty"])
async def test_client_refuses_a_request_id_unfit_for_its_subject_before_sending(request_id: str) -> None:
    """The id is one token of the client's stream subject: a dot, a wildcard or whitespace there
    would subscribe to other streams or to none."""
    with pytest.raises(InvalidRequestError, match="request_id"):
        await Client(NoBus()).complete("hello", request_id=request_id)


@pytest.mark.parametrize("subject", ["_INBOX." + "x" * 300, "_INBOX.a b", "_INBOX.>", "_INBOX.*", "_INBOX..x",
                                     "_INBOX.x.", ".x", "", "_INBOX.\ud800", "_INBOX", "reply",
                                     "tandem.v1.heartbeat.decode.d-1", "tandem.v1.decode.d-1.drain", "x._INBOX.y"],
                         ids=["overlong", "space", "gt", "star", "empty-token", "trailing-dot", "leading-dot",
                              "empty", "lone-surrogate", "bare-inbox", "not-an-inbox", "a-heartbeat", "a-drain",
                              "inbox-inside"])
def test_a_stream_subject_workers_could_not_publish_to_is_refused(subject: str) -> None:
    """A worker publishes each request's tokens to its stream subject: one it cannot publish to once
    closed the worker's connection for good (over 4 KiB) or dropped every other stream's chunks (a space);
    one not an inbox would have the worker publish on a service's subject in its own name."""
    with pytest.raises(ValueError, match="stream_subject"):
        GenerateRequest(request_id="r-1", prompt="x", stream_subject=subject)


@pytest.mark.parametrize("subject", ["_INBOX.tandem.abc.r-1", "_INBOX.UABC.c1.r-1", "_INBOX.b-c.d_e.f:g"])
def test_ordinary_stream_subjects_pass(subject: str) -> None:
    assert GenerateRequest(request_id="r-1", prompt="x", stream_subject=subject).stream_subject == subject


@pytest.mark.parametrize("field", ["v", "kind", "request_id"])
def test_an_error_quotes_a_huge_bad_value_only_in_part(field: str) -> None:
    """Found by the bus fuzz: an error that quoted an 8 MiB value whole was itself over the server's
    max_payload, so the sender got no reply at all."""
    import msgpack

    from tandem.shared.protocol.base import MAX_ERROR_CHARS
    from tandem.shared.protocol.codec import error_reply

    raw = {**generate_request().model_dump(), field: "q" * (8 << 20)}
    with pytest.raises(ProtocolError) as caught:
        decode(msgpack.packb(raw))
    reply = error_reply(caught.value, "r-1")
    assert len(encode(reply)) < 2 * MAX_ERROR_CHARS, f"a {len(encode(reply))}-byte error reply"


@pytest.mark.parametrize("name", ["a b", "a.b", "x*", "y>", "tab\there", "n" * 129])
def test_a_worker_named_by_a_peer_must_be_one_subject_token(name: str) -> None:
    """The prefill worker publishes to ``tandem.v1.decode.<decode_worker>.admit`` and the store's
    subjects: a name with whitespace or a wildcard made nats-server close its connection."""
    spec = RequestSpec(request_id="r", prompt_token_ids=[1], params=SamplingParams(max_tokens=1),
                       stream_subject="_INBOX.c.r", model="tiny")
    with pytest.raises(ValidationError):
        PrefillRequest(spec=spec, decode_worker=name)
    with pytest.raises(ValidationError):
        PrefillRequest(spec=spec, decode_worker="decode-1", kvstore=name)
    with pytest.raises(ValidationError):
        DecodeRequest(spec=spec, kvstore=name)
