"""What every tandem service process shares: NATS connection, micro registration, heartbeats, shutdown.

A service subclasses :class:`ServiceRuntime`, adds endpoints in :meth:`setup` and returns its load
in :meth:`heartbeat`. ``$SRV.PING/INFO/STATS`` discovery comes from nats-py's micro API; every
instance also answers ``tandem.v1.<service>.<id>.alive`` for as long as its process is on the bus. Endpoint
handlers never let an exception escape: a bad message gets a typed :class:`ErrorReply` and the
service goes on with the next one. Run one with :func:`run_service` (what ``tandem serve`` does).

Shutdown drains. The first SIGTERM or SIGINT stops admitting and lets what is in flight finish
(:meth:`ServiceRuntime.drain`: a worker goes through the scale-down drain of
:mod:`tandem.services.common.drain`; any other service stops its endpoints, so a queue group sends
new requests to its peers, and waits for the requests it is handling), for at most
``--shutdown-timeout``; then :meth:`ServiceRuntime.abandon` ends what is left with a typed error
and the process exits with :data:`EXIT_DRAINED`. A second signal (or the first while a drain asked
over the bus is under way: the supervisor's way of saying its time is up) ends the drain at once;
a third exits on the spot. SIGHUP, which ``tandem up``'s children get when it dies, stops at once:
no one is left to drain for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

import nats
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from tandem.shared.auth.credentials import CredentialsError, connect_options, load_credentials, tls_context
from tandem.shared.infra.config import Settings
from tandem.shared.infra.log_limit import LimitedLog, flush_all
from tandem.shared.infra.metrics import MetricsPublisher, MetricsRegistry
from tandem.shared.infra.process import run_async
from tandem.shared.infra.version import VERSION
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode, error_reply
from tandem.shared.protocol.fleet import Heartbeat

Handler = Callable[[Request], Awaitable[None]]
SHUTDOWN_TIMEOUT_S = 5.0
BULK_PENDING_BYTES = 1 << 30
ABANDON_FLUSH_S = 2.0  # for the error replies of abandoned requests to go out before the connection drains
EXIT_DRAINED = 0  # stopped as asked: what was in flight finished or ended with a typed error
EXIT_LOST_BUS = 1  # the NATS connection closed for good: a supervisor should restart this service


class ServiceRuntime:
    """Base class of the router, prefill and decode services."""

    name = "service"
    description = ""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.instance_id = settings.resolved_instance_id(self.name)
        self.host = socket.gethostname()
        self.incarnation = uuid.uuid4().hex[:16]  # see Heartbeat.incarnation
        self.log = logging.getLogger(f"tandem.{self.name}")
        self.limited = LimitedLog(self.log)  # lines a bus message causes: at most one per kind and interval
        self.nc: nats.NATS | None = None
        self.started_at = time.time()
        self._service = None
        self._endpoints: list[EndpointConfig] = []  # added by setup, served once the service is announced
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()  # the drain's time is up: abandon what is left now
        self._stopping: asyncio.Task | None = None  # the drain a stop signal started
        self._serving = False  # setup done: tasks spawned from now on are requests in flight
        self._in_flight: set[asyncio.Task] = set()
        self.stop_signals = 0
        self.draining = False  # no new work taken (a worker's heartbeats say so)
        self.bus_options: dict = {}  # nats.connect's identity and TLS options, from the bus settings
        self.exit_code = EXIT_DRAINED  # EXIT_LOST_BUS: it ends because it lost the bus, not because it was asked to
        self.prom = MetricsRegistry()  # declare metrics here; served on --metrics-port, published on NATS

    # -- for subclasses -------------------------------------------------------------------------
    async def setup(self) -> None:
        """Add endpoints and subscriptions; called once connected."""

    async def teardown(self) -> None:
        """Release what setup acquired; called before the connection drains."""

    async def disconnected(self) -> None:
        """Release what setup acquired that serves alongside the connection (a KV channel's bulk
        connections); called once the connection has drained or closed."""

    def heartbeat(self) -> Heartbeat | None:
        """This instance's load, published every ``heartbeat_interval_s``; None publishes nothing."""
        return None

    async def drain(self) -> None:
        """Stop admitting and return once what is in flight has finished (the runtime bounds the
        wait by ``--shutdown-timeout``). Here: leave the micro endpoints (a queue group's peers
        take the new requests; with none left, clients get no responders at once, never a wait)
        and wait for the tasks handling requests. Workers drain as for a scale-down."""
        if self._service is not None and self.nc.is_connected:
            await asyncio.wait_for(self._service.stop(), SHUTDOWN_TIMEOUT_S)
        await self.wait_in_flight()

    async def abandon(self) -> int:
        """End what the drain could not finish with a typed error; returns how many requests that was."""
        return 0

    def metadata(self) -> dict[str, str]:
        return {"instance_id": self.instance_id, "host": self.host, "pid": str(os.getpid()),
                "metrics_url": self.prom.url}

    def metrics(self) -> dict:
        """This instance's counters and gauges, shown as each endpoint's ``data`` in ``$SRV.STATS``
        (``nats micro stats tandem-decode``); Prometheus figures are declared on ``self.prom``."""
        return {}

    # -- helpers ----------------------------------------------------------------------------------
    async def add_endpoint(self, name: str, subject: str, handler: Handler, queue_group: str | None = None,
                           bulk: bool = False) -> None:
        """Serve ``subject`` with ``handler``, replying a typed error for anything it raises.

        ``bulk`` endpoints take KV frames: several transfers of up to ``window x max_payload``
        bytes each may be in flight at once, more than a subscription buffers by default (64 MiB),
        and a subscription over its limit drops messages. They get a plain subscription with room
        for ``BULK_PENDING_BYTES`` instead of a micro endpoint (whose limits cannot be set), so
        they are missing from ``$SRV.STATS``."""
        async def guarded(request: Request) -> None:
            try:
                await handler(request)
            except Exception as exc:  # the service outlives any one bad message
                reply = error_reply(exc)
                self.limited.warning(f"{name} replies {reply.code.value}", "%s: replied %s (%s)", name,
                                     reply.code.value, reply.message)
                try:
                    await request.respond(encode(reply))
                except Exception:
                    self.log.exception("%s: could not send error reply", name)

        if bulk:  # nats.aio.msg.Msg offers the same .data and .respond as a micro Request
            await self.nc.subscribe(subject, queue=queue_group or "", cb=guarded,
                                    pending_bytes_limit=BULK_PENDING_BYTES)
            return
        config = EndpointConfig(name=name, subject=subject, handler=guarded, queue_group=queue_group)
        if self._service is None:
            self._endpoints.append(config)
        else:
            await self._service.add_endpoint(config)

    def spawn(self, coro: Awaitable[None], what: str, in_flight: bool = True) -> asyncio.Task:
        """Run ``coro`` in the background, keep a reference, log if it fails. Once the service
        serves, a task counts as work in flight that a drain waits for, unless ``in_flight`` is False."""

        async def wrapped() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("%s failed", what)

        task = asyncio.get_running_loop().create_task(wrapped())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self._serving and in_flight:
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
        return task

    async def wait_in_flight(self, timeout_s: float | None = None) -> None:
        """Until the tasks spawned since the service began serving have ended (ones spawned meanwhile too)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._in_flight:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            await asyncio.wait(set(self._in_flight), timeout=left)

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        await self.nc.publish(subject, payload, reply=reply)

    def request_stop(self) -> None:
        """SIGTERM / SIGINT: drain, then stop (see the module's docstring for the second and third)."""
        self.stop_signals += 1
        if self._stop.is_set() or self.stop_signals > 2:  # the operator wants out now
            os._exit(1)
        if not self._serving:  # still starting: nothing in flight to wait for
            self._stop.set()
        elif self._stopping is None:
            hurry = self.draining  # a drain asked over the bus is under way: a signal now says its time is up
            self._stopping = asyncio.get_running_loop().create_task(self._drain_then_stop())
            if hurry:
                self._hurry.set()
        else:
            self._hurry.set()

    def stop_at_once(self) -> None:
        """SIGHUP: what is in flight ends with a typed error now, then the service stops."""
        if not self._serving or self._stop.is_set():
            self._stop.set()
            return
        self._hurry.set()
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._drain_then_stop())

    def stop_drained(self) -> None:
        """Stop now: a drain finished (a scale-down's ``DrainRequest`` with ``exit``)."""
        self._stop.set()

    async def _drain_then_stop(self) -> None:
        timeout_s = self.settings.bus.shutdown_timeout_s
        drained = False
        if not self._hurry.is_set():
            self.log.info("%s %s draining for shutdown: no new requests; up to %.0fs for those in flight",
                          self.name, self.instance_id, timeout_s)
            draining = asyncio.ensure_future(self.drain())
            hurry = asyncio.ensure_future(self._hurry.wait())
            try:
                await asyncio.wait({draining, hurry}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                hurry.cancel()
            drained = draining.done() and not draining.cancelled() and draining.exception() is None
            if not draining.done():
                draining.cancel()
                await asyncio.gather(draining, return_exceptions=True)
        if drained:
            self.log.info("%s %s drained", self.name, self.instance_id)
        else:
            abandoned = await self.abandon()
            if abandoned:
                self.log.warning("%s %s: %d requests still in flight %s; ended them with an error", self.name,
                                 self.instance_id, abandoned,
                                 "when told to stop now" if self._hurry.is_set() else f"after {timeout_s:.0f}s")
            else:
                self.log.info("%s %s drained", self.name, self.instance_id)
            await self.wait_in_flight(ABANDON_FLUSH_S)
        self._stop.set()

    # -- lifecycle --------------------------------------------------------------------------------
    async def _connect(self) -> nats.NATS | None:
        """The NATS connection, or None when a stop was asked first (an unreachable server is retried
        forever, and SIGTERM must still end the process at once). A connection nats-py closes for
        good (it gave up reconnecting, or the server refused a publish) ends the process with exit
        code 1, so the supervisor restarts it: a service off the bus that lives on would look alive."""

        async def on_closed() -> None:
            if not self._stop.is_set():
                self.log.error("the NATS connection closed for good; exiting so this service is restarted")
                self.exit_code = EXIT_LOST_BUS
                self._stop.set()

        async def on_error(exc: Exception) -> None:
            self.log.warning("nats: %s: %s", type(exc).__name__, exc)

        connecting = asyncio.ensure_future(nats.connect(
            self.settings.bus.nats_url,
            **self.bus_options,
            name=f"tandem-{self.name}-{self.instance_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            pending_size=256 * 1024 * 1024,
            closed_cb=on_closed,
            error_cb=on_error,
        ))
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not connecting.done():
            # nats-py's connect loop waits with asyncio.wait_for, which on Python 3.11 can swallow
            # the cancel when a refused try ends at that instant, and then tries forever: the wait
            # is bounded, and the process exits regardless (run_service ends with os._exit).
            connecting.cancel()
            await asyncio.wait([connecting], timeout=2.0)
            return None
        return connecting.result()

    async def run(self) -> None:
        bus = self.settings.bus
        if not bus.nats_url:
            raise SystemExit(f"tandem serve {self.name}: --nats-url (or TANDEM_NATS_URL) is required")
        try:  # the identity is this instance's own: a role key signs a user named after its id
            creds = load_credentials(bus.nats_creds) if bus.nats_creds else None
            self.bus_options = connect_options(creds, self.instance_id,
                                               tls=tls_context(bus.tls_ca, bus.tls_cert, bus.tls_key))
        except CredentialsError as exc:
            raise SystemExit(f"tandem serve {self.name}: {exc}") from None
        self.nc = await self._connect()
        if self.nc is None:  # asked to stop before the server could be reached
            self.log.info("%s %s stopped before reaching NATS at %s", self.name, self.instance_id,
                          self.settings.bus.nats_url)
            return
        if self.settings.metrics.port >= 0:  # before registering: the URL goes into the micro metadata
            self.log.info("metrics at %s", self.prom.serve(self.settings.metrics.port, self.settings.metrics.host))
        # Setup first: an instance that answers $SRV.PING has every subscription in place (a router
        # hears the heartbeats it needs to place work), so a ping is a readiness check.
        await self.setup()
        self._service = await add_service(
            self.nc,
            ServiceConfig(
                name=f"tandem-{self.name}",
                version=VERSION,
                description=self.description,
                metadata=self.metadata(),
                stats_handler=lambda _endpoint: self.metrics(),
            ),
        )
        for config in self._endpoints:
            await self._service.add_endpoint(config)
        # Not a micro endpoint: those leave at the start of a drain, while this instance still
        # finishes what it took, and whoever waits on it must not take it for dead meanwhile.
        await self.nc.subscribe(subjects.alive(self.name, self.instance_id), cb=self._on_alive)
        beat = self.spawn(self._heartbeat_loop(), "heartbeat")
        self.metrics_publisher = MetricsPublisher(self.nc, self.prom, self.name, self.instance_id, self.host,
                                                  self.settings.metrics.interval_s)
        self.spawn(self.metrics_publisher.run(), "metrics publisher")
        self._serving = True
        self.log.info("%s %s ready on %s (pid %d)", self.name, self.instance_id, self.settings.bus.nats_url,
                      os.getpid())
        await self._stop.wait()
        self.log.info("%s %s stopping", self.name, self.instance_id)
        beat.cancel()
        await self._shutdown()
        self.log.info("%s %s stopped", self.name, self.instance_id)

    async def _shutdown(self) -> None:
        """Release local resources first (they never wait on the network), then leave the bus:
        drain when the server is there, close when it is not, never wait on it for long."""
        await self.teardown()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            if self.nc.is_connected:
                if self._service is not None:
                    await asyncio.wait_for(self._service.stop(), SHUTDOWN_TIMEOUT_S)
                await asyncio.wait_for(self.nc.drain(), SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # the server went away mid-drain: closing is all that is left
            self.log.warning("could not drain from NATS (%s); closing", type(exc).__name__)
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 2.0)
            except Exception:
                pass
        await self.disconnected()

    async def _on_alive(self, msg) -> None:
        if msg.reply:
            await msg.respond(b"ok")

    async def _heartbeat_loop(self) -> None:
        subject = subjects.heartbeat(self.name, self.instance_id)
        while True:
            beat = self.heartbeat()
            if beat is not None:
                await self.nc.publish(subject, encode(beat))
            flush_all()  # what rate-limited logs held back, once their interval is over
            await asyncio.sleep(self.settings.bus.heartbeat_interval_s)


async def _serve(service: ServiceRuntime) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.request_stop)
    loop.add_signal_handler(signal.SIGHUP, service.stop_at_once)
    await service.run()
    # Everything this process owns is released now. nats-py's reconnect tasks can ignore
    # cancellation when the server vanished during shutdown, which would hang the loop's own
    # clean-up; a service process has nothing left to do, so it leaves here.
    logging.shutdown()
    os._exit(service.exit_code)


def run_service(service: ServiceRuntime) -> None:
    """Run one service until SIGINT/SIGTERM, then stop cleanly and exit the process."""
    run_async(_serve(service))

