"""A service process and its bus connection: it never lives on off the bus, and it always stops when asked.

Defects 1 and 6 of the trust-boundary trial: a connection nats-py closed for good left the process
alive but deaf (the supervisor watches exits, so it was never replaced); a service pointed at an
unreachable server ignored SIGTERM while it retried the connection.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

from cli_support import TANDEM, service_env

from tandem.services.common.runtime import ServiceRuntime
from tandem.shared.infra.config import Settings


async def test_a_connection_closed_for_good_ends_the_service_with_code_1(nats_server):
    service = ServiceRuntime(Settings(bus={"nats_url": nats_server.url}, metrics={"port": -1}))
    running = asyncio.ensure_future(service.run())
    deadline = time.monotonic() + 10
    while service.nc is None or not service.nc.is_connected:
        assert time.monotonic() < deadline, "the service never connected"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    await service.nc.close()  # what nats-py does after the server's -ERR for a subject over its control line
    await asyncio.wait_for(running, 10)
    assert service.exit_code == 1, "a service that lost the bus for good must exit with an error, to be restarted"


async def test_a_stop_asked_by_the_supervisor_is_code_0(nats_server):
    service = ServiceRuntime(Settings(bus={"nats_url": nats_server.url}, metrics={"port": -1}))
    running = asyncio.ensure_future(service.run())
    while service.nc is None or not service.nc.is_connected:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    service.request_stop()
    await asyncio.wait_for(running, 15)
    assert service.exit_code == 0


def test_sigterm_stops_a_service_that_cannot_reach_its_server(tmp_path):
    proc = subprocess.Popen([*TANDEM, "serve", "router", "--nats-url", "nats://127.0.0.1:1"],
                            env=service_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(4)  # connecting (and failing to) by now
        assert proc.poll() is None, f"the router exited by itself: {proc.stdout.read()}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, f"exit code {code}"
