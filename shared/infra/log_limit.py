"""Log lines that input cannot multiply: at most one line per kind of event per interval.

A service logs one line per event, but some events come from messages anyone on the bus may send
(a bad cancel, a refused request, a corrupt frame): written as they come, a flood of them becomes a
flood of log lines (the trust trial's 200 bad cancels wrote 603 warnings). A :class:`LimitedLog`
writes the first line of a kind, counts the others of that kind for ``interval_s``, and says how
many it held back: on the kind's next line, or from :func:`flush_all` (which a service's heartbeat
loop calls) once the interval is over, so a burst that stops is still reported.

    log = LimitedLog(logging.getLogger("tandem.decode"))
    log.warning("bad cancel", "ignored a cancel of %s: %s", request_id, why)

Thread-safe: KV frames are checked on the bulk connections' threads.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

INTERVAL_S = 10.0

_live: weakref.WeakSet[LimitedLog] = weakref.WeakSet()
_live_lock = threading.Lock()


@dataclass
class _Kind:
    opened: float  # when the interval whose first line was written began
    held: int = 0  # lines of this kind held back since
    level: int = logging.WARNING


class LimitedLog:
    """``logger``'s lines, at most one per kind per ``interval_s``, each kind counting what it held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()
        with _live_lock:
            _live.add(self)

    def warning(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, kind, msg, *args)

    def info(self, kind: str, msg: str, *args: object) -> None:
        self.log(logging.INFO, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        """Write ``msg % args`` unless a line of ``kind`` was written less than ``interval_s`` ago
        (then count it); a line after held-back ones says how many there were."""
        if not self.logger.isEnabledFor(level):
            return
        now = self.clock()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen.opened < self.interval_s:
                seen.held += 1
                return
            held = seen.held if seen is not None else 0
            self._kinds[kind] = _Kind(now, 0, level)
        if held:
            msg += " (%d more like it in the last %.0f s not logged)"
            args = (*args, held, now - seen.opened)
        self.logger.log(level, msg, *args)

    def flush(self) -> None:
        """Say how many lines each kind held back in an interval that is over (and forget it)."""
        now = self.clock()
        with self._lock:
            done = [(kind, seen) for kind, seen in self._kinds.items() if now - seen.opened >= self.interval_s]
            for kind, _ in done:
                del self._kinds[kind]
        for kind, seen in done:
            if seen.held:
                self.logger.log(seen.level, "%s: %d more like it in the last %.0f s not logged", kind, seen.held,
                                now - seen.opened)


def flush_all() -> None:
    """:meth:`LimitedLog.flush` every live one (a service's heartbeat loop calls it)."""
    with _live_lock:
        logs = list(_live)
    for log in logs:
        log.flush()
