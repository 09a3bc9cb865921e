"""Runs an engine's step loop in its own thread, so the event loop never runs model math.

The event loop hands requests and aborts over a queue and gets each step's outputs back through
``loop.call_soon_threadsafe``. Between two steps the thread takes every queued command, so new
sequences join the running batch at the next step (continuous batching). A failing step fails the
requests it held with a worker-failure error instead of killing the service.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.shared.engine.engine_view import EngineStats, EngineView
from tandem.shared.engine.sequence import EngineRequest, RequestOutput

log = logging.getLogger("tandem.engine")

ENGINE_SWITCH_INTERVAL_S = 0.0005


@dataclass
class _Add:
    request: EngineRequest
    accepted: Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[EngineView], object]
    done: Future


@dataclass
class _WhenIdle(_Call):
    """A call that waits until no request is in flight; requests added meanwhile wait for it."""


class EngineThread:
    """Owns one engine (an ``LLMEngine``, used only as an :class:`EngineView`); every engine call
    happens on this thread."""

    def __init__(
        self,
        engine: EngineView,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[list[str], BaseException], None],
        on_kv_events: Callable[[list[int], list[int]], None] | None = None,
        on_scheduled: Callable[[list[str], float], None] | None = None,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._on_kv_events = on_kv_events
        self._on_scheduled = on_scheduled  # (request ids first run by a step, unix time the step began)
        self._scheduled: set[str] = set()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: EngineStats = engine.stats()
        self.steps = 0
        self.busy_s = 0.0  # time inside engine.step(), for the busy-seconds metric
        self._when_idle: list[_WhenIdle] = []  # e.g. a weight reload: runs once in-flight requests finish
        self._deferred: list[_Add] = []  # requests that arrived while a _WhenIdle call waited

    def start(self) -> None:
        # The engine thread and the event loop share the GIL. A thread that wants it waits until the
        # holder blocks or the switch interval (5 ms by default, most of a decode step) runs out:
        # a shorter one bounds how long token streaming on the loop can hold up the next step.
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        self._thread.start()

    async def add(self, request: EngineRequest) -> None:
        """Queue a request; returns once the engine took it, raises ValueError if it refused it."""
        accepted: Future = Future()
        self._commands.put(_Add(request, accepted))
        await asyncio.wrap_future(accepted)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[EngineView], object]) -> object:
        """``fn(engine)`` run on the engine thread between two steps (a consistent view of its
        state, e.g. a block snapshot); returns its result or raises what it raised."""
        done: Future = Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def call_when_idle(self, fn: Callable[[EngineView], object]) -> object:
        """``fn(engine)`` once every request in flight has finished; new requests are held back until
        it has run (a weight reload: in-flight requests finish on the old weights, new ones use the new)."""
        done: Future = Future()
        self._commands.put(_WhenIdle(fn, done))
        return await asyncio.wrap_future(done)

    def _run_when_idle(self) -> None:
        calls, self._when_idle = self._when_idle, []
        for command in calls:
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as exc:
                command.done.set_exception(exc)
        if self._on_kv_events is not None:  # e.g. the prefix cache a reload dropped
            stored, removed = self.engine.drain_kv_events()
            if stored or removed:
                self._loop.call_soon_threadsafe(self._on_kv_events, stored, removed)
        deferred, self._deferred = self._deferred, []
        for command in deferred:
            self._apply(command)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    def _apply(self, command: _Add | _Abort | _Call | None) -> None:
        if isinstance(command, _WhenIdle):
            self._when_idle.append(command)
        elif isinstance(command, _Add) and self._when_idle:
            self._deferred.append(command)
        elif isinstance(command, _Add):
            try:
                self.engine.add_request(command.request)
            except Exception as exc:
                command.accepted.set_exception(exc)
            else:
                self._live.add(command.request.request_id)
                command.accepted.set_result(None)
        elif isinstance(command, _Abort) and command.request_id in self._live:
            self.engine.abort(command.request_id)
        elif isinstance(command, _Call):
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as exc:
                command.done.set_exception(exc)

    def _note_scheduled(self, outputs: list[RequestOutput], started: float) -> None:
        """Report requests this step ran for the first time (queue time ends when a step first runs them)."""
        ids = set(self.engine.running_request_ids()) | {out.request_id for out in outputs}
        new = [rid for rid in ids if rid in self._live and rid not in self._scheduled]
        if new:
            self._scheduled.update(new)
            self._loop.call_soon_threadsafe(self._on_scheduled, new, started)

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished() or bool(self._when_idle)
            try:
                # Idle: block until work arrives. Busy: take what is queued, then step.
                self._apply(self._commands.get(block=not busy, timeout=None if not busy else 0))
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if self._when_idle and not self.engine.has_unfinished():
                self._run_when_idle()
            if self._stopping.is_set() or not self.engine.has_unfinished():
                self.stats = self.engine.stats()
                continue
            started, t0 = time.time(), time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing %d requests", len(self._live))
                failed = sorted(self._live)
                for request_id in failed:
                    try:
                        self.engine.abort(request_id)
                    except Exception:
                        log.exception("abort of %s after a failed step failed", request_id)
                self._live.clear()
                self._scheduled.clear()
                self._loop.call_soon_threadsafe(self._on_failure, failed, exc)
                continue
            self.steps += 1
            self.busy_s += time.perf_counter() - t0
            if self._on_scheduled is not None and len(self._scheduled) < len(self._live):
                self._note_scheduled(outputs, started)
            for out in outputs:
                if out.ends_request:
                    self._live.discard(out.request_id)
                    self._scheduled.discard(out.request_id)
            self.stats = self.engine.stats()
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)
            if self._on_kv_events is not None:
                stored, removed = self.engine.drain_kv_events()
                if stored or removed:
                    self._loop.call_soon_threadsafe(self._on_kv_events, stored, removed)
