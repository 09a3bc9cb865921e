"""Where the console's data comes from: :class:`NatsSource` reads a running tandem over NATS.

It fills a :class:`ConsoleState` and never touches a widget, so the panes can be tested with a
state built by hand (:class:`Source`, the base class, does nothing: the snapshot tests use it).
What it does, all in the app's event loop:

- connects (retrying every 2 s, the error kept in ``state.connection_error`` for the status bar);
  while the connection is lost, the rows of live things (services, KV-stores, block tables) are
  cleared, since nothing vouches for them;
- started without a URL but with a data dir (``tandem console`` finding the ``tandem up`` on this
  machine), it follows that ``up``'s state file (:func:`tandem.client.runstate.find_running`, read every
  2 s): a restarted ``up`` (new pid, new URL) means a new connection and a state started afresh,
  none running means waiting for one; with an explicit ``--nats-url`` it keeps to that URL;
- every 2 s: ``$SRV.STATS`` discovery of every service instance, each KV-store's stats
  (``tandem.v1.kvstore.<id>.stats``), a latency sample, and the planner's stream history once;
- every second: the selected worker's :class:`BlockSnapshot` (``tandem.v1.<service>.<id>.blocks``);
- subscriptions: routing decisions, scaling decisions, KV transfers, trainer steps and timelines,
  metrics snapshots, and the workers' heartbeats (their LoRA adapter slots and resident adapters).

Actions (after the operator confirmed them in the UI): :meth:`drain` and :meth:`scale`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from tandem.client.discovery import gather_replies
from tandem.client.runstate import find_running
from tandem.console.state import ConsoleState, service_row
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import (
    DrainRequest,
    Heartbeat,
    MetricsSnapshot,
    RoutingDecision,
    ScaleRequest,
    ScalingDecision,
)
from tandem.shared.protocol.training import TrainStepMetrics, TrainTimeline
from tandem.shared.protocol.views import BlockSnapshot, KVTransferEvent

log = logging.getLogger("tandem.console")
DISCOVERY_S = 2.0
BLOCKS_S = 1.0
FOLLOW_S = 2.0  # how often a console that follows a `tandem up` reads its state file
REPLY_WAIT_S = 0.4  # how long a discovery round collects $SRV.STATS replies
HISTORY = 50  # scaling decisions read back from the planner's stream


class Source:
    """A data source that does nothing: the state stays as given (snapshot tests, screenshots)."""

    state: ConsoleState

    async def start(self, state: ConsoleState) -> None:
        self.state = state

    async def stop(self) -> None:
        """Release the connection; safe to call twice."""

    async def drain(self, service: str, instance_id: str) -> str:
        return f"would drain {service} {instance_id} (no server in this view)"

    async def scale(self, prefill: int | None, decode: int | None, reason: str) -> str:
        return f"would ask for prefill={prefill} decode={decode} (no server in this view)"


class NatsSource(Source):
    """Reads a tandem system over NATS into the state: the one at ``url``, or (``url`` None) the
    ``tandem up`` running on the data dir ``follow``, whichever that is at the time."""

    def __init__(self, url: str | None, follow: Path | str | None = None,
                 options: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.url = url
        self.options = options or (lambda _url: {})  # nats.connect's identity and TLS for a URL
        self.follow = Path(follow) if follow is not None and not url else None
        self.nc: nats.NATS | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self, state: ConsoleState) -> None:
        self.state = state
        state.url = self.url
        if self.url:
            self._tasks.append(asyncio.create_task(self._session(self.url)))
        elif self.follow is not None:
            state.follow = str(self.follow)
            self._tasks.append(asyncio.create_task(self._follow()))
        else:
            state.connection = "no-url"
            state.changed()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # -- connection -------------------------------------------------------------------------------
    async def _follow(self) -> None:
        """Connect to whatever ``tandem up`` the state file names, and again when that changes."""
        current: tuple[int, str] | None | bool = False  # False: nothing read yet
        session: asyncio.Task | None = None
        try:
            while True:
                found = find_running(self.follow)
                wanted = (found.pid, found.nats_url) if found else None
                if wanted != current:
                    if session is not None:
                        session.cancel()
                        await asyncio.gather(session, return_exceptions=True)
                        session = None
                    self.url = wanted[1] if wanted else None
                    self.state.reset(self.url)  # what the old system said is not this one's
                    current = wanted
                    if wanted:
                        log.info("following tandem up pid %d at %s", *wanted)
                        session = asyncio.create_task(self._session(wanted[1]))
                    else:
                        self.state.connection = "no-url"
                        self.state.changed()
                await asyncio.sleep(FOLLOW_S)
        finally:
            if session is not None:
                session.cancel()
                await asyncio.gather(session, return_exceptions=True)

    async def _session(self, url: str) -> None:
        """One connection to ``url`` (retried forever), its subscriptions and polls, until cancelled."""
        st = self.state

        async def on_error(exc: Exception) -> None:
            if not (self.nc and self.nc.is_connected):
                st.connection, st.connection_error = "unreachable", f"{type(exc).__name__}: {exc}"
                st.changed()

        async def on_disconnect() -> None:
            st.connection = "unreachable"
            st.connection_error = st.connection_error or "connection lost"
            st.forget_live()
            st.changed()

        async def on_reconnect() -> None:
            st.connection, st.connection_error = "connected", ""
            st.changed()

        # Made first and connected after, so that a cancelled first attempt (a follower switching to a
        # new URL while this one is unreachable) still has a client to close.
        try:
            options = self.options(url)
        except ValueError as exc:  # a credentials or TLS file that cannot be used: say so on screen
            st.connection, st.connection_error = "unreachable", str(exc)
            st.changed()
            return
        nc = self.nc = NATS()
        blocks: asyncio.Task | None = None
        try:
            await nc.connect(url, name="tandem-console", connect_timeout=2, max_reconnect_attempts=-1,
                             reconnect_time_wait=2, allow_reconnect=True, error_cb=on_error,
                             disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, **options)
            await on_reconnect()
            for subject, handler in ((subjects.ROUTER_DECISIONS, self._on_routing),
                                     (subjects.PLANNER_DECISIONS, self._on_decision),
                                     (subjects.KV_TRANSFERS, self._on_transfer),
                                     (subjects.TRAINER_STEPS_ALL, self._on_step),
                                     (subjects.TRAINER_TIMELINE_ALL, self._on_timeline),
                                     (subjects.METRICS_ALL, self._on_metrics),
                                     (subjects.HEARTBEAT_ALL, self._on_heartbeat)):
                await nc.subscribe(subject, cb=self._guard(handler))
            blocks = asyncio.create_task(self._blocks_loop())
            while True:
                try:
                    if nc.is_connected:
                        await self._discover()
                except Exception as exc:  # the connection went mid-round: the next round tries again
                    log.info("discovery round failed: %s", exc)
                await asyncio.sleep(DISCOVERY_S)
        finally:
            if blocks is not None:
                blocks.cancel()
                await asyncio.gather(blocks, return_exceptions=True)
            if not nc.is_closed:
                try:
                    await asyncio.wait_for(nc.close(), 2.0)
                except Exception:  # a client that never connected may not close cleanly: it is gone either way
                    pass

    def _guard(self, handler):
        async def guarded(msg) -> None:
            try:
                handler(msg.data)
            except Exception as exc:  # a bad message is dropped, the console goes on
                log.warning("dropped a message on %s: %s", msg.subject, exc)
        return guarded

    # -- periodic reads ---------------------------------------------------------------------------
    async def _discover(self) -> None:
        st = self.state
        replies = await self._gather("$SRV.STATS")
        st.now = time.time()
        rows = [service_row(r, st.now, st.metrics) for r in replies if str(r.get("name", "")).startswith("tandem-")]
        st.services = sorted(rows, key=lambda r: (r.service, r.instance_id))
        st.discovered = True
        for store in st.instances("kvstore"):
            try:
                reply = await self.nc.request(subjects.kvstore_stats(store.instance_id), b"", timeout=1.0)
                st.kvstores[store.instance_id] = msgpack.unpackb(reply.data, raw=False)
            except Exception as exc:
                log.info("kvstore %s stats: %s", store.instance_id, exc)
        live = {s.instance_id for s in st.services}
        st.kvstores = {k: v for k, v in st.kvstores.items() if k in live}
        st.adapters = {k: v for k, v in st.adapters.items() if k in live}
        st.sample_latency()
        if not st.planner_stream:
            await self._read_planner_history()
        st.changed()

    async def _gather(self, subject: str) -> list[dict]:
        return await gather_replies(self.nc, subject, REPLY_WAIT_S)

    async def _read_planner_history(self) -> None:
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(subjects.PLANNER_STREAM)
        except Exception:
            self.state.planner_stream = False
            return
        self.state.planner_stream = True
        last = info.state.last_seq
        for seq in range(max(info.state.first_seq, last - HISTORY + 1), last + 1):
            try:
                self._on_decision((await js.get_msg(subjects.PLANNER_STREAM, seq=seq)).data)
            except Exception as exc:  # deleted or not a decision: skip it
                log.info("planner stream message %d: %s", seq, exc)

    async def _blocks_loop(self) -> None:
        st = self.state
        while True:
            await asyncio.sleep(BLOCKS_S)
            if st.selected_worker is None or not self.nc.is_connected:
                continue
            service, instance = st.selected_worker
            try:
                reply = await self.nc.request(subjects.blocks(service, instance), b"", timeout=2.0)
                snapshot = decode(reply.data)
                if not isinstance(snapshot, BlockSnapshot):
                    raise ValueError(f"replied {snapshot.kind}: {getattr(snapshot, 'message', '')}")
                st.blocks[instance] = snapshot
                st.blocks_error = ""
            except NoRespondersError:
                st.blocks_error = f"{service} {instance} does not answer on {subjects.blocks(service, instance)}"
            except Exception as exc:
                st.blocks_error = f"{service} {instance}: {type(exc).__name__} {exc}"
            st.changed()

    # -- subscriptions ----------------------------------------------------------------------------
    def _on_routing(self, data: bytes) -> None:
        self.state.routing.append(decode(data, RoutingDecision))
        self.state.changed()

    def _on_decision(self, data: bytes) -> None:
        self.state.add_decision(decode(data, ScalingDecision))

    def _on_transfer(self, data: bytes) -> None:
        self.state.add_transfer(decode(data, KVTransferEvent))

    def _on_step(self, data: bytes) -> None:
        self.state.train_step = decode(data, TrainStepMetrics)
        self.state.changed()

    def _on_timeline(self, data: bytes) -> None:
        self.state.timeline = decode(data, TrainTimeline)
        self.state.changed()

    def _on_metrics(self, data: bytes) -> None:
        self.state.add_metrics(decode(data, MetricsSnapshot))

    def _on_heartbeat(self, data: bytes) -> None:
        self.state.add_heartbeat(decode(data, Heartbeat))

    # -- actions ----------------------------------------------------------------------------------
    async def _ask(self, subject: str, message, who: str) -> str:
        if self.nc is None or not self.nc.is_connected:
            return "not connected to NATS"
        try:
            reply = decode((await self.nc.request(subject, encode(message), timeout=5.0)).data)
        except NoRespondersError:
            return f"{who} is not listening on {subject}"
        except NatsTimeoutError:
            return f"{who} did not answer within 5 s"
        except Exception as exc:
            return f"{who}: {type(exc).__name__} {exc}"
        if isinstance(reply, ErrorReply):
            return f"{who} refused: {reply.code.value}: {reply.message}"
        return f"{who} accepted ({reply.kind})"

    async def drain(self, service: str, instance_id: str) -> str:
        return await self._ask(subjects.drain(service, instance_id), DrainRequest(), f"{service} {instance_id}")

    async def scale(self, prefill: int | None, decode: int | None, reason: str) -> str:
        request = ScaleRequest(prefill=prefill, decode=decode, reason=reason or "operator, from tandem console")
        return await self._ask(subjects.PLANNER_SCALE, request, "the planner")
