"""Whether a service instance is still alive: from its heartbeats (:class:`Liveness`), and whether its
process is still on the bus (:func:`on_bus`).

Heartbeats. Every service publishes one every ``heartbeat_interval_s`` on ``tandem.v1.heartbeat.>``.
Whoever watches the fleet (the router, the planner, a draining decode worker, the client library,
``tandem up``'s supervisor) keeps a :class:`Liveness`: each instance's last heartbeat and when it came,
by the watcher's own monotonic clock (never the sender's, which may be another host's). An instance
is *alive* while its last beat is at most ``window_s`` old and *stale* after; the window is the
tracker's (``worker_timeout_s`` from the settings for most), and a query may pass a window of its
own where a caller asks a shorter question ("has it beaten within the last heartbeat?"). The
tracker drops nobody by itself: its owner forgets an instance it knows gone, or sweeps the stale ones.

Bus presence. An instance's alive subject (``subjects.alive``) has a responder while its process is
connected: nats-server drops a connection's subscriptions the moment the connection closes, so a
killed process shows as "no responders" at once, while its heartbeats only go stale. A slow or
failed answer proves nothing (the instance may be busy, or the asker's own connection in trouble),
so only no responders counts as gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from tandem.shared.protocol import subjects

P = TypeVar("P")


@dataclass(frozen=True)
class Beat(Generic[P]):
    """An instance's last sign of life."""

    payload: P | None  # what its last heartbeat carried (None: heard from only otherwise, see Liveness.touch)
    at: float  # when it came, on the tracker's clock
    # The process its beats last named (Heartbeat.incarnation; "" not said), and when a beat first
    # named it: a restart under the same instance id shows as a new incarnation from that time on.
    incarnation: str = ""
    incarnation_at: float = 0.0


class Liveness(Generic[P]):
    """Instances known from their heartbeats: the last one of each (its payload, its arrival time,
    its incarnation), and which are alive or stale given a window (``window_s`` unless a query
    passes its own). ``clock``: the time source of arrivals and of "now" (monotonic seconds)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s >= 0:
            raise ValueError(f"a liveness window must be >= 0 seconds, not {window_s!r}")
        self.window_s = window_s
        self.clock = clock
        self._beats: dict[str, Beat[P]] = {}

    # -- recording ---------------------------------------------------------------------------------
    def beat(self, instance: str, payload: P | None = None, *, incarnation: str = "",
             at: float | None = None) -> Beat[P] | None:
        """Record a heartbeat of ``instance`` carrying ``payload``, arrived ``at`` (default: now);
        ``incarnation``: the process it names ("" keeps the one known). Returns the record it
        replaces, None for an instance first heard of."""
        now = self.clock() if at is None else at
        previous = self._beats.get(instance)
        if previous is not None and (not incarnation or incarnation == previous.incarnation):
            named, named_at = previous.incarnation, previous.incarnation_at
        else:
            named, named_at = incarnation, (now if incarnation else 0.0)
        self._beats[instance] = Beat(payload, now, named, named_at)
        return previous

    def touch(self, instance: str, at: float | None = None) -> None:
        """A sign of life that is no heartbeat (an answered ping): the instance counts as heard
        ``at`` (default: now), its last payload and incarnation kept."""
        now = self.clock() if at is None else at
        previous = self._beats.get(instance)
        if previous is None:
            self._beats[instance] = Beat(None, now)
        else:
            self._beats[instance] = Beat(previous.payload, now, previous.incarnation, previous.incarnation_at)

    def refresh(self, at: float | None = None) -> None:
        """Every known instance counts as heard ``at`` (default: now): after the watcher's own
        outage (its connection, or the server, was down), beats missed meanwhile say nothing."""
        now = self.clock() if at is None else at
        self._beats = {i: Beat(b.payload, now, b.incarnation, b.incarnation_at) for i, b in self._beats.items()}

    def forget(self, instance: str) -> Beat[P] | None:
        """Drop ``instance`` (known gone); returns its last record, None when it was not known."""
        return self._beats.pop(instance, None)

    def forget_stale(self, window_s: float | None = None, now: float | None = None) -> list[tuple[str, Beat[P]]]:
        """Drop every instance stale for ``window_s`` (default: the tracker's); returns them with
        their last records, oldest beat first."""
        gone = [(i, b) for i, b in self._beats.items() if self._stale(b, window_s, now)]
        for instance, _ in gone:
            del self._beats[instance]
        return sorted(gone, key=lambda item: item[1].at)

    # -- asking ------------------------------------------------------------------------------------
    def get(self, instance: str) -> Beat[P] | None:
        return self._beats.get(instance)

    def payload(self, instance: str) -> P | None:
        """What ``instance``'s last heartbeat carried (None: not known, or heard from only otherwise)."""
        found = self._beats.get(instance)
        return found.payload if found is not None else None

    def last(self, instance: str) -> float | None:
        """When ``instance`` was last heard from; None when it never was (or was forgotten)."""
        found = self._beats.get(instance)
        return found.at if found is not None else None

    def is_alive(self, instance: str, window_s: float | None = None, now: float | None = None) -> bool:
        """Known, and heard from within ``window_s`` (default: the tracker's). Never heard of: False."""
        found = self._beats.get(instance)
        return found is not None and not self._stale(found, window_s, now)

    def is_stale(self, instance: str, window_s: float | None = None, now: float | None = None) -> bool:
        """Known, and silent for longer than ``window_s`` (default: the tracker's). Never heard of: False."""
        found = self._beats.get(instance)
        return found is not None and self._stale(found, window_s, now)

    def alive(self, window_s: float | None = None, now: float | None = None) -> dict[str, P | None]:
        """The instances alive now (see :meth:`is_alive`), each with its last payload."""
        return {i: b.payload for i, b in self._beats.items() if not self._stale(b, window_s, now)}

    def stale(self, window_s: float | None = None, now: float | None = None) -> list[str]:
        """The known instances silent for longer than ``window_s`` (default: the tracker's)."""
        return [i for i, b in self._beats.items() if self._stale(b, window_s, now)]

    def beaten_since(self, instance: str, since: float) -> bool:
        """Whether ``instance`` was heard from after ``since`` (a time on the tracker's clock)."""
        found = self._beats.get(instance)
        return found is not None and found.at > since

    def payloads(self) -> list[P | None]:
        """Every known instance's last payload, alive or stale, in the order they were first heard of."""
        return [b.payload for b in self._beats.values()]

    def _stale(self, beat: Beat[P], window_s: float | None, now: float | None) -> bool:
        now = self.clock() if now is None else now
        return now - beat.at > (self.window_s if window_s is None else window_s)

    def __contains__(self, instance: object) -> bool:
        return instance in self._beats

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._beats))

    def __len__(self) -> int:
        return len(self._beats)


async def on_bus(nc: nats.NATS, service: str, instance_id: str, timeout_s: float) -> bool:
    """False only when the instance's alive subject has no responders."""
    try:
        await nc.request(subjects.alive(service, instance_id), b"", timeout=timeout_s)
    except NoRespondersError:
        return False
    except NatsError:
        return True
    return True
