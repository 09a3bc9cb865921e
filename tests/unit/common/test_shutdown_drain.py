"""A service's stop drains: the first signal waits for what is in flight (bounded by
``--shutdown-timeout``), what is left then is abandoned with a typed error, a second signal cuts the
wait short, and an endpoint that admits requests is left at once (services/common/runtime.py)."""

from __future__ import annotations

import asyncio
import time

from fakebus import FakeBus, bus_settings, serving
from nats.errors import NoRespondersError

from tandem.services.common.runtime import EXIT_DRAINED, ServiceRuntime

SUBJECT = "tandem.v1.test.work"


class Slow(ServiceRuntime):
    """Each request on SUBJECT is handled for ``work_s`` in a task, as the router places one."""

    name = "slow"

    def __init__(self, settings, work_s: float) -> None:
        super().__init__(settings)
        self.work_s = work_s
        self.finished = 0
        self.abandoned = 0

    async def setup(self) -> None:
        await self.add_endpoint("work", SUBJECT, self.on_work)

    async def on_work(self, request) -> None:
        self.spawn(self.work(), "work")

    async def work(self) -> None:
        await asyncio.sleep(self.work_s)
        self.finished += 1

    async def abandon(self) -> int:
        self.abandoned = len(self._in_flight)
        for task in self._in_flight:  # as a worker's abandon ends its requests
            task.cancel()
        return self.abandoned


async def stop_and_time(service: Slow, bus: FakeBus, signals: int = 1) -> float:
    await bus.publish(SUBJECT, b"x")
    await bus.settle()
    start = time.monotonic()
    for _ in range(signals):
        service.request_stop()
    await asyncio.wait_for(service._stop.wait(), 10)
    return time.monotonic() - start


async def test_a_stop_waits_for_the_requests_in_flight_and_stops_admitting(tmp_path):
    bus = FakeBus()
    async with serving(Slow(bus_settings(tmp_path), work_s=0.5), bus) as service:
        await bus.publish(SUBJECT, b"x")
        await bus.settle()
        service.request_stop()
        await asyncio.sleep(0.1)
        try:
            await bus.request(SUBJECT, b"late", timeout=1)
        except NoRespondersError:
            pass
        else:
            raise AssertionError("a draining service still admits")
        await asyncio.wait_for(service._stop.wait(), 10)
        assert (service.finished, service.abandoned, service.exit_code) == (1, 0, EXIT_DRAINED)


async def test_what_outlasts_the_shutdown_timeout_is_abandoned(tmp_path):
    bus = FakeBus()
    async with serving(Slow(bus_settings(tmp_path, shutdown_timeout_s=0.3), work_s=30), bus) as service:
        took = await stop_and_time(service, bus)
        assert service.abandoned == 1 and service.finished == 0
        assert 0.3 <= took < 1.5, took


async def test_a_second_signal_ends_the_drain_at_once(tmp_path):
    bus = FakeBus()
    async with serving(Slow(bus_settings(tmp_path), work_s=30), bus) as service:
        took = await stop_and_time(service, bus, signals=2)
        assert service.abandoned == 1 and took < 1.0, took
