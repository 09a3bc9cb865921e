"""A missing router, or a router with no worker behind it, gives a typed NoWorkersError."""

from __future__ import annotations

import pytest

from tandem.client import NoWorkersError, connect


async def test_no_router_says_no_workers(nats_server):
    # Runs before this module starts any service, so nothing answers the router subject.
    async with connect(nats_server.url, request_timeout_s=5) as client:
        with pytest.raises(NoWorkersError, match="no router"):
            await client.complete("hello", max_tokens=4)


async def test_router_without_workers_says_no_workers(start_system):
    system = start_system(prefill=0, decode=0)
    async with connect(system.url, request_timeout_s=5) as client:
        with pytest.raises(NoWorkersError, match="no decode worker"):
            await client.complete("hello", max_tokens=4)
