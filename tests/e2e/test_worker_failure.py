"""A worker that dies with a request in hand: with migration off (``max_migrations=0``) the client
gets WorkerFailureError within seconds, and the requests sent after a replacement worker is up
succeed. (With migration on, the request outlives the death: tests/e2e/test_migration.py.)"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from support import prompt_of

from tandem.client import WorkerFailureError, connect


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(prefill=0, decode=1)


@pytest.mark.slow  # 13 s: a system booted to be killed
async def test_killed_decode_worker_fails_its_requests_fast(system):
    name = system.instance("decode")
    async with connect(system.url, worker_timeout_s=1.5, max_migrations=0) as client:
        stream = client.generate(prompt_of(30), max_tokens=1900, temperature=0.0, ignore_eos=True)
        await stream.__anext__()
        system.processes[name].send_signal(signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailureError, match=name):
            async for _ in stream:
                pass
        assert time.monotonic() - start < 10, "the failure should surface long before the request timeout"

    system.restart(name)
    await asyncio.sleep(0.5)
    async with connect(system.url) as client:
        result = await client.complete(prompt_of(20), max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids) == 4
