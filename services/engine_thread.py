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
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.shared.engine import EngineRequest, LLMEngine, RequestOutput

log = logging.getLogger("tandem.engine")


@dataclass
class _Add:
    request: EngineRequest
    accepted: Future


@dataclass
class _Abort:
    request_id: str


class EngineThread:
    """Owns one :class:`LLMEngine`; every engine call happens on this thread."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_failure: Callable[[list[str], BaseException], None],
        on_kv_events: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._on_kv_events = on_kv_events
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: dict = engine.stats()
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    async def add(self, request: EngineRequest) -> None:
        """Queue a request; returns once the engine took it, raises ValueError if it refused it."""
        accepted: Future = Future()
        self._commands.put(_Add(request, accepted))
        await asyncio.wrap_future(accepted)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    def _apply(self, command: _Add | _Abort | None) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.request)
            except Exception as exc:
                command.accepted.set_exception(exc)
            else:
                self._live.add(command.request.request_id)
                command.accepted.set_result(None)
        elif isinstance(command, _Abort) and command.request_id in self._live:
            self.engine.abort(command.request_id)

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished()
            try:
                # Idle: block until work arrives. Busy: take what is queued, then step.
                self._apply(self._commands.get(block=not busy, timeout=None if not busy else 0))
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            if self._stopping.is_set() or not self.engine.has_unfinished():
                self.stats = self.engine.stats()
                continue
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
                self._loop.call_soon_threadsafe(self._on_failure, failed, exc)
                continue
            self.steps += 1
            for out in outputs:
                if out.finished:
                    self._live.discard(out.request_id)
            self.stats = self.engine.stats()
            if outputs:
                self._loop.call_soon_threadsafe(self._on_outputs, outputs)
            if self._on_kv_events is not None:
                stored, removed = self.engine.drain_kv_events()
                if stored or removed:
                    self._loop.call_soon_threadsafe(self._on_kv_events, stored, removed)
