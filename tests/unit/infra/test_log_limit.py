"""Log lines input cannot multiply (shared/infra/log_limit.py): one line per kind per interval, and
a count of what was held back, on the kind's next line or from the flush after the interval."""

from __future__ import annotations

import logging

import pytest
from clock_support import ManualClock

from tandem.shared.infra.log_limit import LimitedLog, flush_all


@pytest.fixture
def limited(caplog):
    caplog.set_level(logging.INFO, logger="test.limited")
    clock = ManualClock()
    return LimitedLog(logging.getLogger("test.limited"), interval_s=10.0, clock=clock), clock, caplog


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.limited"]


def test_a_burst_of_one_kind_writes_one_line_then_its_count(limited):
    log, clock, caplog = limited
    for i in range(200):
        log.warning("bad cancel", "ignored a cancel of r%d", i)
    assert lines(caplog) == ["ignored a cancel of r0"], "a burst wrote more than its first line"
    clock.now += 10.0
    log.warning("bad cancel", "ignored a cancel of r%d", 200)
    assert lines(caplog)[1] == "ignored a cancel of r200 (199 more like it in the last 10 s not logged)"


def test_kinds_are_limited_apart(limited):
    log, _, caplog = limited
    for _ in range(3):
        log.warning("bad cancel", "cancel")
        log.info("bad frame", "frame")
    assert lines(caplog) == ["cancel", "frame"]


def test_a_burst_that_stops_is_reported_by_the_flush(limited):
    log, clock, caplog = limited
    for _ in range(5):
        log.warning("bad cancel", "cancel")
    flush_all()
    assert lines(caplog) == ["cancel"], "flushed before its interval was over"
    clock.now += 11.0
    flush_all()
    assert lines(caplog) == ["cancel", "bad cancel: 4 more like it in the last 11 s not logged"]
    flush_all()
    assert len(lines(caplog)) == 2, "a count was reported twice"


def test_a_disabled_level_costs_nothing(limited, caplog):
    log, _, _ = limited
    caplog.set_level(logging.ERROR, logger="test.limited")
    log.warning("bad cancel", "cancel")
    assert lines(caplog) == [] and not log._kinds
