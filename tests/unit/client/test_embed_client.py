"""``Client.embed`` against a scripted router on a real nats-server (tests/scripted_router.py): the
inputs split and checked before anything is sent, one request each, the vectors back in order as
``array('f')``, a worker failure placed again under a placement id of its own (up to the limit),
and a refused input ending the call with its typed error and cancelling the others."""

from __future__ import annotations

import asyncio
from array import array

import pytest
from scripted_router import embedding_result, error_chunk, prompt_ids

from tandem.client import Embedding, InvalidRequestError, WorkerFailureError
from tandem.client.embedding import split_inputs
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.embedding import EmbedRequest
from tandem.shared.protocol.serving import Cancel


def echo(request: EmbedRequest):
    """Each input's vector: its token ids as floats (a stand-in the test can recognise)."""
    return [embedding_result(request, [float(t) for t in prompt_ids(request)])]


async def test_every_input_gets_its_vector_in_order(scripted):
    client, router = await scripted(echo)
    got = await client.embed(["ab", [7, 8, 9], "c"], pooling="mean", dimensions=3, priority=-2)
    assert [e.index for e in got] == [0, 1, 2]
    assert [list(e.vector) for e in got] == [[97.0, 98.0], [7.0, 8.0, 9.0], [99.0]]
    assert all(isinstance(e, Embedding) and isinstance(e.vector, array) and e.vector.typecode == "f" for e in got)
    assert [e.prompt_tokens for e in got] == [2, 3, 1] and {e.pooling for e in got} == {"mean"}
    assert {e.decode_worker for e in got} == {"decode-scripted"} and {e.migrations for e in got} == {0}
    sent = sorted(router.requests, key=lambda r: r.request_id)
    assert [(r.pooling.method, r.pooling.dimensions, r.priority) for r in sent] == [("mean", 3, -2)] * 3
    assert sent[0].prompt == "ab" and sent[1].prompt_token_ids == [7, 8, 9]
    assert all(r.stream_subject.startswith(client.inbox_prefix) for r in sent)


async def test_a_worker_failure_places_the_input_again(scripted):
    def fails_first(request: EmbedRequest):
        if "~p" not in request.request_id:
            return [error_chunk(request, "the engine step failed")]
        return echo(request)

    client, router = await scripted(fails_first)
    (got,) = await client.embed([1, 2])
    assert list(got.vector) == [1.0, 2.0] and got.migrations == 1
    first, second = router.requests
    assert second.request_id == f"{first.request_id}~p1" and second.stream_subject.endswith("~p1")


async def test_the_migration_limit_ends_the_input_with_the_last_reason(scripted):
    client, router = await scripted(lambda request: [error_chunk(request, "boom")], max_migrations=2)
    with pytest.raises(WorkerFailureError, match="migrated 2 times; last: worker_failure: boom"):
        await client.embed("x")
    assert len(router.requests) == 3


async def test_a_refused_input_ends_the_call_and_cancels_the_others(scripted):
    def script(request: EmbedRequest):
        if request.prompt == "bad":
            return [error_chunk(request, "token id 999 is outside the vocabulary", ErrorCode.INVALID_REQUEST)]
        return [5.0, *echo(request)]  # the others would take 5 s

    client, router = await scripted(script)
    cancels: list[Cancel] = []

    async def on_cancel(msg) -> None:
        cancels.append(decode(msg.data, Cancel))

    await router.nc.subscribe(subjects.CANCEL_ALL, cb=on_cancel)
    started = asyncio.get_running_loop().time()
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await client.embed(["fine", "bad", "also fine"])
    assert asyncio.get_running_loop().time() - started < 3, "the call waited for the other inputs"
    for _ in range(50):
        if len(cancels) >= 2:
            break
        await asyncio.sleep(0.05)
    others = {r.request_id for r in router.requests if r.prompt != "bad"}
    assert others <= {c.request_id for c in cancels}, "the other inputs were not cancelled on their workers"


@pytest.mark.parametrize(("inputs", "fields", "param"), [
    ([], {}, "prompt"),
    ("", {}, "prompt"),
    (["a", ""], {}, "prompt"),
    (["a", [1, "b"]], {}, "prompt"),
    (3.5, {}, "prompt"),
    ("a", {"pooling": "cls"}, "pooling"),
    ("a", {"dimensions": 0}, "dimensions"),
    ("a", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ([[-1]], {}, "prompt_token_ids"),
], ids=["none", "empty-string", "an-empty-input", "mixed-list", "a-float", "pooling", "dimensions", "truncation",
        "negative-token"])
async def test_bad_inputs_are_refused_before_anything_is_sent(scripted, inputs, fields, param):
    client, router = await scripted(echo)
    with pytest.raises(InvalidRequestError) as refused:
        await client.embed(inputs, **fields)
    assert refused.value.param == param, refused.value
    assert not router.requests


def test_a_list_of_token_ids_is_one_input_and_a_list_of_lists_several():
    assert split_inputs([1, 2, 3]) == [[1, 2, 3]]
    assert split_inputs([[1, 2], [3]]) == [[1, 2], [3]]
    assert split_inputs(["a", [1]]) == ["a", [1]]
    assert split_inputs("abc") == ["abc"]
