"""Bad input on every subject gets a typed error reply, and the service answers the next good request."""

from __future__ import annotations

import asyncio

import msgpack
import nats
import pytest
from support import BAD_PROMPT_TOKEN_IDS, BAD_SAMPLING, flushed, prompt_of, value_id, worker_beats

from tandem.client import connect
from tandem.shared.kvtransfer.frames import pack_frame
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION, ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.kv import KVTransfer
from tandem.shared.protocol.serving import (
    Cancel,
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    RequestSpec,
    SamplingParams,
)

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def system(start_system):
    args = ["--max-model-len", str(MAX_MODEL_LEN)]
    return start_system(prefill=1, decode=1, prefill_args=args, decode_args=args)


def valid_message(kind: str, system) -> dict:
    common = dict(request_id="bad-1", params=SamplingParams(max_tokens=4), stream_subject="_INBOX.nobody")
    if kind == "generate":
        return GenerateRequest(prompt="hello", **common).model_dump()
    spec = RequestSpec(prompt_token_ids=[1, 2, 3], model="tiny", **common)
    if kind == "prefill":
        return PrefillRequest(spec=spec, decode_worker=system.instance("decode")).model_dump()
    return DecodeRequest(spec=spec).model_dump()


def with_request(msg: dict, **changes) -> bytes:
    """``msg`` with fields of the request itself changed: a generate request's own, the spec of a
    prefill or decode request."""
    if "spec" in msg:
        return msgpack.packb({**msg, "spec": {**msg["spec"], **changes}})
    return msgpack.packb({**msg, **changes})


def request_part(msg: dict) -> dict:
    return msg.get("spec", msg)


def subject_for(kind: str, system) -> str:
    return {
        "generate": subjects.router_generate("nobody"),  # the owner of the requests' stream, _INBOX.nobody
        "prefill": subjects.prefill(system.instance("prefill")),
        "decode": subjects.decode_admit(system.instance("decode")),
    }[kind]


def garbage(_: dict) -> bytes:
    return b"\xc1\x00 definitely not msgpack"


def unknown_kind(msg: dict) -> bytes:
    return msgpack.packb({**msg, "kind": "teleport"})


def wrong_version(msg: dict) -> bytes:
    return msgpack.packb({**msg, "v": 99})


def not_a_map(_: dict) -> bytes:
    return msgpack.packb([1, 2, 3])


def with_params(**changes):
    def mutate(msg: dict) -> bytes:
        return with_request(msg, params={**request_part(msg)["params"], **changes})
    mutate.__name__ = "_".join(f"{k}={value_id(v)}" for k, v in changes.items())
    return mutate


def with_prompt_ids(ids: list[int]):
    def mutate(msg: dict) -> bytes:
        return with_request(msg, **({"prompt": None} if "prompt" in msg else {}), prompt_token_ids=ids)
    mutate.__name__ = f"prompt_token_ids={value_id(ids)}"
    return mutate


def too_long_prompt(msg: dict) -> bytes:
    if msg.get("prompt") is not None:
        return with_request(msg, prompt="x" * (MAX_MODEL_LEN + 10))
    return with_request(msg, prompt_token_ids=[65] * (MAX_MODEL_LEN + 10))


def unknown_model(msg: dict) -> bytes:
    return with_request(msg, model="no-such-model")


# Stream subjects a worker could not publish to: over nats-server's 4 KiB control line (that -ERR closed
# the worker's connection for good), with a space (BadSubjectError dropped every stream's chunks of
# that step), a wildcard, an empty token.
BAD_STREAM_SUBJECTS = ["_INBOX." + "x" * 5000, "_INBOX.a b", "_INBOX.>", "_INBOX.*.x", "_INBOX..x", "_INBOX.x."]


def with_stream_subject(subject: str):
    def mutate(msg: dict) -> bytes:
        return msgpack.packb({**msg, **({"spec": {**msg["spec"], "stream_subject": subject}} if "spec" in msg
                                        else {"stream_subject": subject})})
    mutate.__name__ = f"stream_subject={value_id(subject)[:24]}"
    return mutate


# (payload from a valid message, expected error code, text the reply's message must name)
CASES = [
    (garbage, "bad_frame", ""),
    (not_a_map, "bad_frame", ""),
    (unknown_kind, "bad_schema", ""),
    (wrong_version, "unsupported_version", ""),
    # Every sampling parameter and token id out of its bounds, each refused before any engine sees it.
    *[(with_params(**{name: value}), "invalid_request", name) for name, value in BAD_SAMPLING],
    *[(with_prompt_ids(ids), "invalid_request", "prompt_token_ids") for ids in BAD_PROMPT_TOKEN_IDS],
    # A valid token id (it fits int32) outside the model's vocabulary: the engine refuses it by name.
    (with_params(logit_bias=[[3, 1.0], [2**31 - 1, 1.0]]), "invalid_request", "logit_bias"),
    (too_long_prompt, "prompt_too_long", ""),
    (unknown_model, "unknown_model", ""),
    *[(with_stream_subject(subject), "invalid_request", "stream_subject") for subject in BAD_STREAM_SUBJECTS],
]


async def ask(url: str, subject: str, payload: bytes):
    nc = await nats.connect(url)
    try:
        return decode((await nc.request(subject, payload, timeout=10)).data)
    finally:
        await nc.close()


async def assert_still_serving(url: str) -> None:
    async with connect(url) as client:
        result = await client.complete(prompt_of(20), max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids) == 4, "the system stopped answering good requests after bad input"


@pytest.mark.parametrize("kind", ["generate", "prefill", "decode"])
@pytest.mark.parametrize("mutate,want,names", CASES, ids=[mutate.__name__ for mutate, _, _ in CASES])
async def test_bad_message_gets_typed_error(system, kind, mutate, want, names):
    reply = await ask(system.url, subject_for(kind, system), mutate(valid_message(kind, system)))
    assert isinstance(reply, ErrorReply), f"{kind}: expected an error reply, got {reply!r}"
    assert reply.code.value == want, f"{kind}: expected {want}, got {reply.code.value} ({reply.message})"
    assert names in reply.message, f"{kind}: the error should name {names!r}: {reply.message}"


@pytest.mark.parametrize("frame,code", [
    (b"\x00", "bad_frame"),
    (b"\x00\x00\x10\x00short", "bad_frame"),
    (pack_frame({"v": 7, "transfer_id": "t", "offset": 0, "total_bytes": 4}, b"abcd"), "unsupported_version"),
    (pack_frame({"v": SCHEMA_VERSION, "offset": 0}, b"abcd"), "bad_schema"),
    (pack_frame({"v": SCHEMA_VERSION, "transfer_id": "t", "offset": 2, "total_bytes": 4}, b"abcd"), "bad_frame"),
    (pack_frame({"v": SCHEMA_VERSION, "transfer_id": "huge", "offset": 0, "total_bytes": 1 << 40}, b"abcd"),
     "invalid_request"),
])
async def test_bad_kv_frame_gets_typed_error(system, frame, code):
    reply = await ask(system.url, subjects.decode_kv(system.instance("decode")), frame)
    assert isinstance(reply, ErrorReply) and reply.code.value == code, f"expected {code}, got {reply!r}"


async def test_admit_with_missing_corrupt_or_foreign_kv_is_refused(system):
    dec = system.instance("decode")
    own_layout = (await worker_beats(system.url))[dec].kv_namespace  # what the worker accepts
    msg = {**valid_message("decode", system), "kv_namespace": own_layout}
    foreign = KVTransfer(transfer_id="other-layout", num_blocks=1, block_bytes=4, checksums=[0])
    reply = await ask(system.url, subjects.decode_admit(dec),
                      encode(DecodeRequest(**{**msg, "transfer": foreign, "kv_namespace": "tiny/bfloat16/x"})))
    assert isinstance(reply, ErrorReply) and reply.code.value == "invalid_request" and "layout" in reply.message, reply
    transfer = KVTransfer(transfer_id="never-sent", num_blocks=1, block_bytes=4, checksums=[0])
    reply = await ask(system.url, subjects.decode_admit(dec), encode(DecodeRequest(**{**msg, "transfer": transfer})))
    assert isinstance(reply, ErrorReply) and reply.code.value == "invalid_request", reply
    # Frames arrive, but the checksum in the admit does not match them.
    nc = await nats.connect(system.url)
    await nc.request(subjects.decode_kv(dec),
                     pack_frame({"v": SCHEMA_VERSION, "transfer_id": "bent", "offset": 0, "total_bytes": 4}, b"abcd"),
                     timeout=5)
    await nc.close()
    transfer = KVTransfer(transfer_id="bent", num_blocks=1, block_bytes=4, checksums=[12345])
    reply = await ask(system.url, subjects.decode_admit(dec), encode(DecodeRequest(**{**msg, "transfer": transfer})))
    assert isinstance(reply, ErrorReply) and reply.code.value == "bad_frame", reply


async def test_a_bad_stream_subject_hurts_no_other_request(system):
    """Defects 1 and 2 of the trust-boundary trial: a 5 KiB stream subject once closed a worker's
    connection for good, a space in one dropped the chunks of every request in that step. Sent to the
    router and straight to both workers while eight good requests stream, each is refused, every good
    request completes, and both workers keep beating."""
    bad = [(kind, with_stream_subject(subject)(valid_message(kind, system)))
           for kind in ("generate", "prefill", "decode") for subject in ("_INBOX." + "x" * 5000, "_INBOX.a b")]

    async def good(i: int):
        async with connect(system.url) as client:
            return await client.complete(prompt_of(30, salt=i), max_tokens=24, temperature=0.0, ignore_eos=True)

    results = await asyncio.gather(*(good(i) for i in range(8)),
                                   *(ask(system.url, subject_for(kind, system), payload) for kind, payload in bad))
    assert all(len(r.token_ids) == 24 for r in results[:8]), "a good request lost chunks beside a bad subject"
    assert all(isinstance(r, ErrorReply) and r.code.value == "invalid_request" for r in results[8:]), results[8:]
    beats = await worker_beats(system.url, wait_s=1.0)
    assert {system.instance("prefill"), system.instance("decode")} <= set(beats), "a worker left the bus"


async def test_a_flood_of_bad_cancels_costs_each_worker_one_log_line(system):
    """The trial's 200 bad cancels wrote 603 WARNING lines (one per worker per cancel). A stream
    runs meanwhile, so the workers hold a request the cancels name (the kind of cancel that is
    logged): each worker writes at most one line for the flood, and the stream is unharmed."""
    logs = {name: system.logdir / f"{name}.log" for name in (system.instance("prefill"), system.instance("decode"))}
    def cancel_lines(path) -> int:  # not the count a flush writes once the interval is over
        return sum(line.count("ignored bad cancel") + line.count("ignored a cancel") for line in open(path))

    before = {name: cancel_lines(path) for name, path in logs.items()}
    nc = await nats.connect(system.url)
    async with connect(system.url) as client:
        stream = client.generate(prompt_of(20, salt=11), max_tokens=40, temperature=0.0, ignore_eos=True)
        tokens = list((await stream.__anext__()).token_ids)
        for i in range(100):  # undecodable ones, and well-formed ones naming the live request under another owner
            await nc.publish(subjects.cancel("flood"), b"\xc1 not msgpack")
            await nc.publish(subjects.cancel("flood"), encode(Cancel(request_id=stream.placement_id,
                                                                     stream_subject=f"_INBOX.flood.x{i}")))
        await flushed(nc)
        tokens += [t async for chunk in stream for t in chunk.token_ids]
    await nc.close()
    assert len(tokens) == 40, f"the stream ended after {len(tokens)} tokens beside the flood"
    written = {name: cancel_lines(path) - before[name] for name, path in logs.items()}
    assert all(n <= 1 for n in written.values()), f"200 bad cancels wrote {written} lines per worker"


async def test_services_still_answer_after_bad_input(system):
    await assert_still_serving(system.url)
