"""A ``RequestStream``'s life on real messages through the session's nats-server, the router played
by the test (``scripted_router``): a stream left by ``break`` while its caller still holds it, or
dropped unread, cancels its request at once; a chunk on its subject that names another request is
dropped and counted, never delivered.

Run: ``python3 -m pytest -q tests/unit/client/test_stream_lifetime.py``.
"""

from __future__ import annotations

import asyncio
import gc

import nats
import pytest
from scripted_router import chunk

from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.serving import Cancel, StreamChunk


def slow_stream(request):
    """A token, then a long pause: the request runs on until it is cancelled."""
    return [chunk(request, 0, 0, [104]), 30.0, chunk(request, 0, 1, [105], finish_reason="length")]


@pytest.fixture
async def cancels(nats_server):
    """Every cancel published on the bus, as it arrives."""
    watcher = await nats.connect(nats_server.url)
    seen: list[Cancel] = []

    async def on_cancel(msg) -> None:
        seen.append(decode(msg.data, Cancel))

    await watcher.subscribe(subjects.CANCEL_ALL, cb=on_cancel)
    yield seen
    await watcher.close()


async def first_cancel(seen: list[Cancel], within_s: float = 2.0) -> Cancel | None:
    for _ in range(int(within_s / 0.02)):
        if seen:
            return seen[0]
        await asyncio.sleep(0.02)
    return None


async def test_break_out_of_a_held_stream_cancels_its_request(scripted, cancels):
    """The trial's case: ``gen`` still refers to the stream after the loop, so the stream itself is
    never collected; leaving the loop must still cancel."""
    client, router = await scripted(slow_stream)
    gen = client.generate("abc", max_tokens=2)
    async for _chunk in gen:
        break
    cancel = await first_cancel(cancels)
    assert cancel is not None, "break left the request running on the workers"
    assert (cancel.request_id, cancel.stream_subject) == (router.requests[0].request_id, gen.request.stream_subject)
    assert gen is not None  # held to the end


async def test_a_stream_dropped_unfinished_cancels_its_request(scripted, cancels):
    client, router = await scripted(slow_stream)
    stream = client.generate("abc", max_tokens=2)
    await stream.__anext__()
    del stream
    gc.collect()
    cancel = await first_cancel(cancels)
    assert cancel is not None and cancel.request_id == router.requests[0].request_id, "a dropped stream ran on"


async def test_a_stream_read_to_its_end_sends_no_cancel(scripted, cancels):
    client, _ = await scripted(lambda r: [chunk(r, 0, 0, [104]), chunk(r, 0, 1, [105], finish_reason="length")])
    gen = client.generate("abc", max_tokens=2)
    tokens = [t async for c in gen for t in c.token_ids]
    assert tokens == [104, 105]
    assert await first_cancel(cancels, within_s=0.3) is None, "a finished request was cancelled"


async def test_a_chunk_naming_another_request_is_dropped_and_counted(scripted):
    def with_a_stranger(request):
        stranger = StreamChunk(request_id="someone-else", index=0, token_ids=[66], text="B",
                               finish_reason="length")
        return [stranger, chunk(request, 0, 0, [104]), chunk(request, 0, 1, [105], finish_reason="length")]

    client, _ = await scripted(with_a_stranger)
    result = await client.complete("abc", max_tokens=2)
    assert (result.token_ids, result.finish_reason) == ([104, 105], "length"), "another request's chunk got in"
    assert client.foreign_chunks == 1, f"{client.foreign_chunks} foreign chunks counted"
