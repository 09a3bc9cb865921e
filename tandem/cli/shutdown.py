"""``tandem up``'s draining stop: what its first Ctrl-C or SIGTERM does before the processes go.

In order, one log line per step:

1. the routers stop admitting: SIGTERM, on which a router leaves its endpoints (a new request gets a
   typed ``no_workers`` error, "no router is running", at once) and finishes the placements under way;
2. every prefill and decode worker drains as for a scale-down (:meth:`Scaler.drain
   <tandem.cli.scaling.Scaler.drain>`: a ``DrainRequest`` with ``exit``, the path of
   :mod:`tandem.services.common.drain`): it finishes its streams and hand-offs, then exits with
   ``EXIT_DRAINED``;
3. a worker still busy when ``--shutdown-timeout`` runs out gets SIGTERM, which tells a draining
   worker its time is up: it ends each request it still holds with a typed ``worker_failure`` error
   on its stream and exits (SIGKILL :data:`KILL_AFTER_S` later if it does not).

Then :meth:`Supervisor.stop <tandem.cli.supervisor.Supervisor.stop>` stops the services that hold no
requests (frontend, planner, KV-stores) and the nats-server last. Meanwhile a dead nats-server is
still restarted; a second signal (:attr:`Supervisor.stop_now`) ends the waiting at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import nats

from tandem.cli.supervisor import ENGINE_SERVICES

if TYPE_CHECKING:
    from tandem.cli.scaling import Scaler
    from tandem.cli.supervisor import Child

log = logging.getLogger("tandem.cli.up")

POLL_S = 0.1
ROUTER_STOP_S = 5.0  # a router only finishes placements (milliseconds each) before it exits
KILL_AFTER_S = 5.0  # a worker told its time is up ends its requests and exits well within this
BEATS_SETTLE_S = 0.05  # for the heartbeats that came with the drains' Acks to be read


async def drain_system(scaler: Scaler, nc: nats.NATS) -> None:
    """Steps 1 to 3 of the module's docstring; returns early on a second stop signal."""
    sup = scaler.sup
    timeout_s = sup.settings.bus.shutdown_timeout_s
    started = time.monotonic()
    deadline = started + timeout_s
    routers = alive(sup.children, ("router",))
    for router in routers:
        scaler.terminate(router)
    log.info("shutdown: %d router(s) take no new requests and finish the placements under way", len(routers))
    await wait_gone(scaler, routers, min(deadline, time.monotonic() + ROUTER_STOP_S))

    workers = alive(sup.children, ENGINE_SERVICES)
    log.info("shutdown: draining %d workers", len(workers))
    asked = [worker for worker in workers if not worker.leaving]
    results = await asyncio.gather(*(scaler.drain(nc, worker) for worker in asked), return_exceptions=True)
    for worker, result in zip(asked, results):
        if isinstance(result, Exception):  # the bus is away: a worker's SIGTERM is the same drain
            log.info("shutdown: could not ask %s %s to drain (%s); SIGTERM instead", worker.service,
                     worker.instance_id, type(result).__name__)
            scaler.terminate(worker)
    # A worker sends a heartbeat with its load as it begins draining, before its Ack: the count is fresh.
    await asyncio.sleep(BEATS_SETTLE_S)
    print(f"tandem up: draining: {scaler.in_flight()} requests in flight, up to {timeout_s:g}s for them to finish "
          "(Ctrl-C again stops at once)", flush=True)
    await wait_gone(scaler, workers, deadline)
    if sup.stop_now:
        return
    busy = alive(workers)
    if busy:
        log.warning("shutdown: %d workers still busy after %gs: their requests end with an error", len(busy),
                    timeout_s)
        for worker in busy:
            scaler.terminate(worker, kill_after_s=KILL_AFTER_S)
        await wait_gone(scaler, busy, time.monotonic() + KILL_AFTER_S)
        for worker in alive(busy):
            log.warning("%s %s did not stop; killing it", worker.service, worker.instance_id)
            worker.process.kill()
    else:
        log.info("shutdown: every worker drained in %.1fs", time.monotonic() - started)


def alive(children: list[Child], services: tuple[str, ...] | None = None) -> list[Child]:
    return [c for c in children if c.process.poll() is None and (services is None or c.service in services)]


async def wait_gone(scaler: Scaler, children: list[Child], deadline: float) -> None:
    """Until ``children`` have all exited, ``deadline`` passes or a second signal comes; the
    nats-server is kept up meanwhile (the drains need it)."""
    while alive(children) and time.monotonic() < deadline and not scaler.sup.stop_now:
        scaler.sup.ensure_server()
        await asyncio.sleep(POLL_S)
