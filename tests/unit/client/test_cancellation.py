"""A stream's wait for its next chunk gives way to cancellation (Ctrl-C of ``tandem generate``)."""

import asyncio

import pytest

from tandem.client.stream import EMPTY, get_within


async def test_a_cancel_landing_while_a_chunk_is_ready_is_not_swallowed():
    """Python 3.11's ``asyncio.wait_for`` returns the ready item and drops the cancel; every one of
    200 tries did, here. The stream's wait must stop on each."""
    queue: asyncio.Queue = asyncio.Queue()
    ignored = 0
    for _ in range(50):
        async def consume_forever():
            while True:
                await get_within(queue, 1.0)

        task = asyncio.ensure_future(consume_forever())
        await asyncio.sleep(0)  # the task now waits on the queue
        queue.put_nowait(b"chunk")
        task.cancel()
        await asyncio.sleep(0.01)
        if not task.done():
            ignored += 1
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert ignored == 0, f"{ignored} of 50 cancels were swallowed by the wait for the next chunk"


async def test_the_wait_gives_the_item_or_says_empty():
    queue: asyncio.Queue = asyncio.Queue()
    assert await get_within(queue, 0.01) is EMPTY
    queue.put_nowait(1)
    assert await get_within(queue, 0.0) == 1, "a ready item comes back even with no time left"
