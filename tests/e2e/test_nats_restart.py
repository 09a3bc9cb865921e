"""Chaos: kill -9 of the nats-server with 16 streams in flight, then the server back on its port
with its JetStream store (as ``tandem up``'s supervisor restarts it). The services reconnect by
themselves; every client stream waits for its connection, is placed again after the tokens it
had (chunks published while the server was down are gone), and completes token-exact against an
undisturbed run of the same requests.

Run: ``python3 -m pytest -q -m slow tests/e2e/test_nats_restart.py -s``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from chaos_support import Record, consume, mixed_workload, report, until

from tandem.client import connect
from tandem.shared.infra.natsserver import NatsServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAMS = 16


@pytest.fixture(scope="module")
def nats_server():
    """This module's own server (the session's is shared by every other test): this one gets killed."""
    server = NatsServer.start()
    yield server
    server.stop()


async def test_kill_and_restart_of_the_nats_server_mid_stream(nats_server, start_system):
    system = start_system(prefill=1, decode=1)
    workload = mixed_workload(STREAMS, max_tokens=240)
    expected = [Record() for _ in workload]
    async with connect(system.url) as client:
        await asyncio.gather(*(consume(client, request, record) for request, record in zip(workload, expected)))
    assert all(r.error is None for r in expected), [r.error for r in expected if r.error]

    records = [Record() for _ in workload]
    async with connect(system.url, request_timeout_s=120, reconnect_s=30) as client:
        tasks = [asyncio.create_task(consume(client, request, record)) for request, record in zip(workload, records)]
        await until(lambda: all(len(r.token_ids) >= 16 or r.finish_reason or r.error for r in records), 120,
                    "every stream to be under way")
        killed_at = time.monotonic()
        nats_server.process.kill()
        nats_server.process.wait()
        await asyncio.sleep(0.5)  # about what tandem up takes to notice and start it again
        await asyncio.to_thread(nats_server.restart)
        await asyncio.gather(*tasks)
    figures = report("kill -9 and restart of the nats-server", records, expected, killed_at)
    system.check_alive()  # every service reconnected: none exited
    assert figures["failed"] == 0, [r.error for r in records if r.error]
    assert figures["exact"] == STREAMS, [i for i, (r, e) in enumerate(zip(records, expected))
                                         if r.token_ids != e.token_ids]
    assert figures["migrated"] >= 1, "streams under way when the server died must have been placed again"
