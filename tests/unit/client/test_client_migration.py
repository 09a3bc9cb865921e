"""``tandem.client``'s request migration on real messages through the session's nats-server, the
router and its workers played by the test (``scripted_router``): a stream ended by a worker
failure, or whose worker went silent, is placed again with the tokens delivered so far and goes
on with no gap and no duplicate; a late chunk of the placement given up on never enters it; the
migration limit ends it with the last reason; several outputs are not migrated; a cancel reaches
the placement streaming now. Plus the bookkeeping of :mod:`tandem.client.migration` on its own.

Run: ``python3 -m pytest -q tests/unit/client/test_client_migration.py``.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from scripted_router import ScriptedRouter, beat, chunk, entries, error_chunk

from tandem.client import ShuttingDownError, WorkerFailureError, connect
from tandem.client.migration import MAX_REQUEST_ID_CHARS, ResumeState, placement_request_id
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.serving import Cancel, GenerateAccepted, GenerateRequest, StreamChunk, TokenLogprobs


def resumed(request: GenerateRequest) -> int:
    return len(request.resume_output_token_ids)


def dies_after_two_tokens(request):
    """The first placement streams "hi" and fails; the next goes on from the tokens it was given."""
    if not resumed(request):
        return [chunk(request, 0, 0, [104]), chunk(request, 0, 1, [105]), error_chunk(request, "worker fell over")]
    start = resumed(request)
    return [chunk(request, 0, start, [106, 107]), chunk(request, 0, start + 2, [108], finish_reason="length")]


async def test_a_stream_ended_by_a_worker_failure_goes_on_where_it_stopped(scripted):
    client, router = await scripted(dies_after_two_tokens)
    result = await client.complete("abc", max_tokens=5, temperature=0.7, seed=3)
    assert (result.text, result.token_ids, result.finish_reason) == ("hijkl", [104, 105, 106, 107, 108], "length")
    assert result.migrations == 1 and result.request_id == router.requests[0].request_id
    first, again = router.requests
    assert again.resume_output_token_ids == [104, 105]
    assert again.request_id != first.request_id and again.stream_subject != first.stream_subject, \
        "a placement after a migration has its own id and stream"
    assert again.prompt is None and again.prompt_token_ids == list(b"abc"), "the accepted token ids, not retokenized"
    assert (again.params.max_tokens, again.params.seed, again.params.temperature) == (5, 3, 0.7)


def stops_after_two_tokens(request):
    """The first placement's worker reaches its shutdown deadline after "hi"; another takes the rest."""
    if not resumed(request):
        return [chunk(request, 0, 0, [104]), chunk(request, 0, 1, [105]),
                error_chunk(request, "decode worker d stopped before this request finished", ErrorCode.SHUTTING_DOWN)]
    return [chunk(request, 0, 2, [106], finish_reason="length")]


async def test_a_worker_stopped_past_its_deadline_hands_its_streams_to_another(scripted):
    """A scale-down past its drain deadline loses nothing: the stream goes on elsewhere."""
    client, router = await scripted(stops_after_two_tokens)
    result = await client.complete("abc", max_tokens=3)
    assert result.token_ids == [104, 105, 106] and result.migrations == 1
    assert router.requests[1].resume_output_token_ids == [104, 105]


async def test_shutting_down_with_no_router_left_fails_at_once_not_after_the_timeout(scripted):
    """The whole deployment stopping: nobody takes the request on, so the caller hears why at once."""
    client, router = await scripted(stops_after_two_tokens, request_timeout_s=60)
    stream = client.generate("abc", max_tokens=3)
    tokens = []
    started = None
    with pytest.raises(ShuttingDownError, match="stopped before this request finished") as caught:
        async for part in stream:
            tokens += part.token_ids
            if len(tokens) == 1:
                await router.nc.close()  # the router goes before the worker's error arrives
                started = asyncio.get_running_loop().time()
    took = asyncio.get_running_loop().time() - started
    assert took < 5, f"{took:.1f}s: no waiting for the 60 s timeout when the deployment stops"
    assert "no other worker took it on" in str(caught.value)


async def test_a_late_chunk_of_the_placement_given_up_on_is_not_delivered(scripted):
    def late_duplicate(request):
        if not resumed(request):
            # The error, then a chunk a slow worker sends after all: it must not enter the stream.
            return [chunk(request, 0, 0, [104]), error_chunk(request, "hand-off failed"), 0.1,
                    chunk(request, 0, 1, [120])]
        return [0.4, chunk(request, 0, 1, [105], finish_reason="length")]

    client, _ = await scripted(late_duplicate)
    result = await client.complete("abc", max_tokens=2)
    assert result.token_ids == [104, 105] and result.text == "hi"


async def test_a_silent_worker_is_migrated_from_without_any_error_from_it(scripted):
    def goes_silent(request):
        if not resumed(request):
            return [chunk(request, 0, 0, [104]), 3.0, chunk(request, 0, 1, [120])]  # too late: given up on
        return [chunk(request, 0, 1, [105]), chunk(request, 0, 2, [106], finish_reason="length")]

    # The scripted decode worker never beats: silent from the start, found so after 0.5 s without output.
    client, router = await scripted(goes_silent, worker_timeout_s=0.5)
    result = await client.complete("abc", max_tokens=3)
    assert result.token_ids == [104, 105, 106] and result.migrations == 1
    assert router.requests[1].resume_output_token_ids == [104]
    assert router.requests[1].exclude_workers == ["decode-scripted"], "the router is told which worker died"


async def test_a_worker_restarted_under_the_same_id_is_migrated_from_though_its_name_is_alive(scripted):
    """A supervisor brings a killed worker back under its instance id before its silence is noticed:
    beats under that id come again, but from a process that never held the request."""
    def restarts(request):
        if not resumed(request):
            return [beat("first"), chunk(request, 0, 0, [104]), beat("second"), 3.0, chunk(request, 0, 1, [120])]
        return [chunk(request, 0, 1, [105]), chunk(request, 0, 2, [106], finish_reason="length")]

    client, router = await scripted(restarts, worker_timeout_s=30)
    router.decode_incarnation = "first"
    stream = client.stream("abc", max_tokens=3)
    async with stream:
        token_ids = [t for c in [c async for c in stream] for t in c.token_ids]
    assert token_ids == [104, 105, 106] and stream.migrations == 1
    assert stream.resume.reasons == ["worker decode-scripted restarted (its new process does not hold the request)"], \
        "found by the new incarnation in its beats, not by a timeout or an alive check"
    assert router.requests[1].resume_output_token_ids == [104]


async def test_a_placement_on_a_process_newer_than_the_last_beat_is_not_taken_for_dead(scripted):
    """The router may place a request on a restarted worker before this client saw its new beats:
    an older incarnation in the client's view says nothing against the newer one."""
    def script(request):
        if request.prompt == "one":
            return [beat("first"), chunk(request, 0, 0, [104], finish_reason="length")]
        # The client looks (0.5 s without output) while its view still says "first"; then the new beat.
        return [0.55, beat("second"), 0.2, chunk(request, 0, 0, [104]),
                chunk(request, 0, 1, [105], finish_reason="length")]

    client, router = await scripted(script, worker_timeout_s=30)
    router.decode_incarnation = "first"
    assert (await client.complete("one", max_tokens=1)).token_ids == [104]
    router.decode_incarnation = "second"
    result = await client.complete("two", max_tokens=2)
    assert result.token_ids == [104, 105] and result.migrations == 0, "the new process was taken for dead"


async def test_the_migration_limit_ends_the_request_with_the_last_reason(scripted):
    def always_fails(request):
        return [chunk(request, 0, resumed(request), [97 + resumed(request)]),
                error_chunk(request, f"failure {resumed(request) + 1}")]

    client, router = await scripted(always_fails, max_migrations=2)
    seen = []
    with pytest.raises(WorkerFailureError, match=r"migrated 2 times; last: worker_failure: failure 3"):
        async for piece in client.generate("abc", max_tokens=8):
            seen.extend(piece.token_ids)
    assert seen == [97, 98, 99], "each placement's token delivered once, in order"
    assert [r.resume_output_token_ids for r in router.requests] == [[], [97], [97, 98]]


async def test_without_migrations_a_worker_failure_ends_the_request_as_before(scripted):
    client, router = await scripted(dies_after_two_tokens, max_migrations=0)
    with pytest.raises(WorkerFailureError, match="worker fell over"):
        await client.complete("abc", max_tokens=5)
    assert len(router.requests) == 1


async def test_several_outputs_are_not_migrated(scripted):
    def failing(request):
        return [chunk(request, 0, 0, [97]), chunk(request, 1, 0, [98]), error_chunk(request, "the model fell over")]

    client, router = await scripted(failing)
    with pytest.raises(WorkerFailureError, match="the model fell over"):
        await client.complete("abc", n=2, max_tokens=4)
    assert len(router.requests) == 1


async def test_logprobs_after_a_migration_count_the_resumed_tokens(scripted):
    prompt_entries = [None, TokenLogprobs(logprob=-0.5, top=[])]

    def with_logprobs(request):
        if not resumed(request):
            return [chunk(request, 0, 0, [104], logprobs=entries(-0.25), prompt_logprobs=prompt_entries),
                    error_chunk(request, "gone")]
        # The new placement computes the prompt again (its prompt logprobs too) and counts only its own tokens.
        return [chunk(request, 0, 1, [105], logprobs=entries(-0.5), prompt_logprobs=prompt_entries),
                chunk(request, 0, 2, [106], finish_reason="length", logprobs=entries(-1.0), cumulative_logprob=-1.5)]

    client, _ = await scripted(with_logprobs)
    chunks = [c async for c in client.generate("ab", max_tokens=3, logprobs=0, prompt_logprobs=0)]
    assert [c.prompt_logprobs for c in chunks] == [prompt_entries, None, None], "prompt logprobs delivered once"
    assert chunks[-1].cumulative_logprob == -1.75, "the resumed token's logprob is part of the sum"


async def test_a_cancel_reaches_the_placement_streaming_now(scripted, nats_server):
    def slow_after_migration(request):
        if not resumed(request):
            return [chunk(request, 0, 0, [104]), error_chunk(request, "gone")]
        return [chunk(request, 0, 1, [105]), 5.0, chunk(request, 0, 2, [106], finish_reason="length")]

    watcher = await nats.connect(nats_server.url)
    cancels: list[Cancel] = []

    async def on_cancel(msg) -> None:
        cancels.append(decode(msg.data, Cancel))

    await watcher.subscribe(subjects.CANCEL_ALL, cb=on_cancel)
    try:
        client, router = await scripted(slow_after_migration)
        async for piece in client.generate("abc", max_tokens=3):
            if piece.token_ids == [105]:
                break
        for _ in range(50):
            if cancels:
                break
            await asyncio.sleep(0.02)
        current = router.requests[1]
        assert [(c.request_id, c.stream_subject) for c in cancels] == [(current.request_id, current.stream_subject)]
    finally:
        await watcher.close()


async def test_a_request_finding_no_router_is_sent_again_for_about_a_second(nats_server):
    routers: list[ScriptedRouter] = []

    async def router_later() -> None:
        await asyncio.sleep(0.4)
        routers.append(await ScriptedRouter.start(
            nats_server.url, lambda r: [chunk(r, 0, 0, [104], finish_reason="length")]))

    async with connect(nats_server.url) as client:
        task = asyncio.create_task(router_later())
        try:
            result = await client.complete("abc", max_tokens=1)
        finally:
            await task
            for router in routers:
                await router.close()
    assert result.token_ids == [104]


# -- the bookkeeping alone ---------------------------------------------------------------------
def a_request(**fields) -> GenerateRequest:
    return GenerateRequest(request_id="r1", prompt="abc", stream_subject="_INBOX.k.c.r1", **fields)


def test_placement_ids_are_valid_request_ids_and_distinct():
    long_id = "x" * MAX_REQUEST_ID_CHARS
    ids = [placement_request_id(long_id, k) for k in range(4)]
    assert ids[0] == long_id and len(set(ids)) == 4
    for placement_id in ids[1:]:  # each one validates as a request id and stream subject token
        GenerateRequest(request_id=placement_id, prompt="a", stream_subject=f"_INBOX.k.c.{placement_id}")
    assert placement_request_id("abc", 2) == "abc~p2"


def test_a_resumed_request_keeps_the_prompt_ids_and_the_grant():
    state = ResumeState(max_migrations=3)
    state.deliver(StreamChunk(request_id="r1", index=0, token_ids=[5, 6], text="x"))
    state.migrate("worker d stopped sending heartbeats")
    accepted = GenerateAccepted(request_id="r1", prompt_token_ids=[1, 2, 3], prefill_worker=None,
                                decode_worker="d", max_tokens=40)
    again = state.resumed_request(a_request(params={"max_tokens": None, "seed": 9}), accepted, "r1~p1",
                                  "_INBOX.k.c.r1~p1")
    assert (again.request_id, again.stream_subject, again.prompt, again.prompt_token_ids) == \
        ("r1~p1", "_INBOX.k.c.r1~p1", None, [1, 2, 3])
    assert (again.resume_output_token_ids, again.params.max_tokens, again.params.seed) == ([5, 6], 40, 9)
    unplaced = state.resumed_request(a_request(), None, "r1~p2", "_INBOX.k.c.r1~p2")
    assert unplaced.prompt == "abc" and unplaced.resume_output_token_ids == [5, 6]


def test_the_limit_counts_migrations():
    state = ResumeState(max_migrations=1)
    assert not state.limit_reached()
    state.migrate("first")
    assert state.limit_reached() and state.limit_message("second") == "migrated 1 times; last: second"
