"""The router's admission queue: requests wait here, not in the workers' queues, while every decode
worker is saturated; past the queue's bounds they are refused at once with ``overloaded``.

Saturation, from what the router knows (each decode worker's last heartbeat plus what this router
placed on it since, which no heartbeat has counted yet):

    in_flight = running + waiting + placed_unseen
    saturated = waiting > 0  or  in_flight >= limit

``limit`` is ``--router-max-inflight-per-worker``, or (0, the default) twice the worker's own
``max_num_seqs`` from its heartbeat: one batch running and at most one more waiting behind it, which
the worker starts the moment a slot frees (the router hears of a free slot only at the next
heartbeat, and a request it places then still has to be prefilled: without that buffer the slot
would idle meanwhile). Beyond it a request would only wait in the worker's scheduler, where no
other worker can take it and no bound refuses it. And a worker that reports requests waiting is
saturated whatever its count: it is out of slots or KV blocks, so its buffer is refilled only once
it has drained. A worker that says no ``max_num_seqs`` (0) and has no setting is bounded only by
its waiting count.
Requests a prefill worker still holds are counted for one heartbeat interval after placement (as
the router's load term always was), so a backlog on a prefill worker is not seen here.

The queue is FCFS by ``(priority, arrival)``: lower priority values first, as vLLM's priority
scheduling. Its head blocks the rest (a request never overtakes one that arrived before it at the
same or a better priority). A request is refused with ``overloaded`` when the queue already holds
``max_requests`` requests or ``max_prompt_tokens`` prompt tokens, or when it has waited
``max_wait_s`` (so a client hears ``overloaded`` before its own timeout). A request cancelled by
its client while queued leaves the queue. One queue per router process, on its event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.shared.protocol.base import ErrorCode, ProtocolError


@dataclass(frozen=True)
class WorkerLoad:
    """One decode worker's load as the router sees it."""

    running: int
    waiting: int
    placed_unseen: int  # placed by this router since its last heartbeat counted them, or owed it by prefill workers
    max_num_seqs: int  # from its heartbeat; 0: not said

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting + self.placed_unseen


BATCHES_IN_FLIGHT = 2  # the default limit, in the worker's batches: one running, one waiting behind it


def has_room(load: WorkerLoad, max_inflight: int) -> bool:
    """Whether the worker can take one more request now. ``max_inflight``: the setting (0:
    ``BATCHES_IN_FLIGHT`` times the worker's own ``max_num_seqs``; both 0: no bound but its waiting
    count)."""
    if load.waiting > 0:
        return False
    limit = max_inflight or BATCHES_IN_FLIGHT * load.max_num_seqs
    return limit == 0 or load.in_flight < limit


class QueuedRequestCancelled(Exception):
    """The client cancelled a request while it waited in the queue: nobody waits for its reply."""


def overloaded(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.OVERLOADED, message)


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    key: str = field(compare=False)
    prompt_tokens: int = field(compare=False)
    enqueued: float = field(compare=False)
    future: asyncio.Future = field(compare=False)
    expiry: asyncio.TimerHandle | None = field(default=None, compare=False)


class AdmissionQueue:
    """Bounded, FCFS-by-priority waiting room in front of placement.

    ``room()`` says whether some decode worker has room now; the router calls :meth:`pump` whenever
    that may have changed (a heartbeat, a placement that failed or ended). ``observe_wait`` gets the
    seconds each request spent here, whatever its outcome."""

    def __init__(self, max_requests: int, max_prompt_tokens: int, max_wait_s: float, room: Callable[[], bool],
                 observe_wait: Callable[[float], None] = lambda _s: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_requests = max_requests
        self.max_prompt_tokens = max_prompt_tokens
        self.max_wait_s = max_wait_s
        self.room = room
        self.observe_wait = observe_wait
        self.clock = clock
        self._heap: list[_Waiter] = []
        self._by_key: dict[str, _Waiter] = {}
        self._seq = 0
        self.prompt_tokens = 0  # of the requests queued now
        # A request woken but not yet placed: its worker's load does not show it yet, so the next
        # one waits until it did (see admit).
        self._granting = False
        self.refused = 0  # requests refused with overloaded, full or waited too long

    @property
    def depth(self) -> int:
        return len(self._by_key)

    async def admit(self, key: str, prompt_tokens: int, priority: int = 0) -> float:
        """Return once the request may be placed, with the seconds it waited (0.0: at once). Raises
        ``overloaded`` (:class:`ProtocolError`) when the queue is full or the wait ran out, and
        :class:`QueuedRequestCancelled` when :meth:`cancel` named ``key`` meanwhile.

        The caller must record its placement on a worker before it next awaits: the next queued
        request is woken only after that, so it sees the load this one added."""
        if not self._by_key and not self._granting and self.room():
            self.observe_wait(0.0)
            return 0.0
        if key in self._by_key:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"request {key.split()[0]} is already queued", "request_id")
        if self.depth >= self.max_requests:
            self.refused += 1
            raise overloaded(f"every decode worker is busy and the router's queue is full ({self.depth} requests "
                             "waiting); retry later")
        if self.prompt_tokens + prompt_tokens > self.max_prompt_tokens:
            self.refused += 1
            raise overloaded(f"every decode worker is busy and the router's queue holds {self.prompt_tokens} prompt "
                             f"tokens (at most {self.max_prompt_tokens}); retry later")
        loop = asyncio.get_running_loop()
        self._seq += 1
        waiter = _Waiter(priority, self._seq, key, prompt_tokens, self.clock(), loop.create_future())
        waiter.expiry = loop.call_later(self.max_wait_s, self._expire, waiter)
        heapq.heappush(self._heap, waiter)
        self._by_key[key] = waiter
        self.prompt_tokens += prompt_tokens
        self.pump()  # room may have come while nothing pumped (the head may be this one)
        try:
            waited = await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():  # woken, then cancelled: pass the turn on
                loop.call_soon(self._granted)
            self._leave(waiter)
            raise
        # Runs after this task's next await, by when the caller has reserved its worker.
        loop.call_soon(self._granted)
        return waited

    def pump(self) -> None:
        """Wake the queue's head if some worker has room. One at a time: see :meth:`admit`."""
        if self._granting:
            return
        while self._heap:
            head = self._heap[0]
            if head.future.done():  # expired or cancelled: already gone from the counts
                heapq.heappop(self._heap)
                continue
            if not self.room():
                return
            heapq.heappop(self._heap)
            self._leave(head)
            self._granting = True
            head.future.set_result(self.clock() - head.enqueued)
            return

    def cancel(self, key: str) -> bool:
        """The client cancelled ``key``: if it is queued, it leaves the queue. True when it was."""
        waiter = self._by_key.get(key)
        if waiter is None or waiter.future.done():
            return False
        self._leave(waiter)
        waiter.future.set_exception(QueuedRequestCancelled(key))
        return True

    def fail_all(self, error: Exception) -> None:
        """End every queued request with ``error`` (no decode worker is left to wait for)."""
        for waiter in list(self._by_key.values()):
            if not waiter.future.done():
                self._leave(waiter)
                waiter.future.set_exception(error)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._leave(waiter)
        self.refused += 1
        waiter.future.set_exception(overloaded(
            f"every decode worker stayed busy for the {self.max_wait_s:g} s this request may wait in the router's "
            "queue; retry later"))

    def _leave(self, waiter: _Waiter) -> None:
        """Take ``waiter`` out of the counts (its heap entry goes when it reaches the top)."""
        if self._by_key.get(waiter.key) is not waiter:
            return
        del self._by_key[waiter.key]
        self.prompt_tokens -= waiter.prompt_tokens
        if waiter.expiry is not None:
            waiter.expiry.cancel()
        self.observe_wait(self.clock() - waiter.enqueued)

    def _granted(self) -> None:
        self._granting = False
        self.pump()
