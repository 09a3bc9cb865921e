"""A hand-moved monotonic clock for the tests of code that takes a ``clock`` callable: each test
states the times it judges at (``clock.now += 2.5``)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
