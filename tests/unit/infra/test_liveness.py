"""The heartbeat tracker every fleet watcher keeps (shared/infra/liveness.py): alive within its window,
stale after it, a query's own window, restarts seen as a new incarnation, forgetting, refreshing."""

from __future__ import annotations

import pytest
from clock_support import ManualClock

from tandem.shared.infra.liveness import Liveness

WINDOW_S = 3.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def tracker(clock) -> Liveness[str]:
    return Liveness(WINDOW_S, clock=clock)


@pytest.mark.parametrize(("silent_s", "alive"), [(0.0, True), (WINDOW_S, True), (WINDOW_S + 0.01, False)])
def test_alive_within_the_window_and_stale_after_it(tracker, clock, silent_s, alive):
    tracker.beat("decode-a", "beat 1")
    clock.now += silent_s
    assert tracker.is_alive("decode-a") is alive
    assert tracker.is_stale("decode-a") is not alive
    assert tracker.alive() == ({"decode-a": "beat 1"} if alive else {})
    assert tracker.stale() == ([] if alive else ["decode-a"])


def test_an_instance_never_heard_of_is_neither_alive_nor_stale(tracker):
    assert not tracker.is_alive("nobody") and not tracker.is_stale("nobody")
    assert tracker.last("nobody") is None and tracker.payload("nobody") is None and tracker.get("nobody") is None
    assert "nobody" not in tracker and len(tracker) == 0 and not tracker.beaten_since("nobody", 0.0)


def test_a_query_may_judge_with_its_own_window(tracker, clock):
    tracker.beat("decode-a", "x")
    clock.now += 1.0
    assert tracker.is_alive("decode-a") and not tracker.is_alive("decode-a", window_s=0.5)
    assert tracker.is_stale("decode-a", window_s=0.5) and tracker.stale(window_s=0.5) == ["decode-a"]
    assert tracker.alive(window_s=0.5) == {} and tracker.alive(now=clock.now + 10) == {}


def test_the_last_beat_replaces_the_one_before(tracker, clock):
    assert tracker.beat("prefill-p", "first") is None, "an instance first heard of replaces nothing"
    clock.now += 2.0
    replaced = tracker.beat("prefill-p", "second")
    assert replaced is not None and replaced.payload == "first" and replaced.at == 100.0
    assert tracker.payload("prefill-p") == "second" and tracker.last("prefill-p") == 102.0
    clock.now += 2.0  # 4 s after the first beat, 2 s after the last
    assert tracker.is_alive("prefill-p")


def test_beaten_since(tracker, clock):
    tracker.beat("decode-a", "x")
    mark = clock.now
    assert not tracker.beaten_since("decode-a", mark)
    clock.now += 0.1
    tracker.beat("decode-a", "y")
    assert tracker.beaten_since("decode-a", mark)


def test_a_new_incarnation_is_dated_from_the_first_beat_naming_it(tracker, clock):
    tracker.beat("decode-a", "x", incarnation="first")
    clock.now += 1.0
    tracker.beat("decode-a", "x", incarnation="first")
    tracker.beat("decode-a", "x")  # a beat that names none keeps the one known
    assert (tracker.get("decode-a").incarnation, tracker.get("decode-a").incarnation_at) == ("first", 100.0)
    clock.now += 1.0
    tracker.beat("decode-a", "x", incarnation="second")  # restarted under the same instance id
    clock.now += 1.0
    tracker.beat("decode-a", "x", incarnation="second")
    assert (tracker.get("decode-a").incarnation, tracker.get("decode-a").incarnation_at) == ("second", 102.0)


def test_a_ping_is_a_sign_of_life_that_keeps_the_last_payload(tracker, clock):
    tracker.touch("router-r")  # heard from before any heartbeat
    assert tracker.is_alive("router-r") and tracker.payload("router-r") is None
    tracker.beat("router-r", "load 3", incarnation="one")
    clock.now += WINDOW_S + 1
    tracker.touch("router-r")
    assert tracker.is_alive("router-r") and tracker.payload("router-r") == "load 3"
    assert tracker.get("router-r").incarnation == "one"


def test_forget_and_forget_stale(tracker, clock):
    tracker.beat("decode-a", "a")
    clock.now += 2.0
    tracker.beat("decode-b", "b")
    tracker.beat("decode-c", "c")
    assert tracker.forget("decode-c").payload == "c" and tracker.forget("decode-c") is None
    clock.now += 2.0  # a: 4 s silent, b: 2 s
    gone = tracker.forget_stale()
    assert [(instance, last.payload) for instance, last in gone] == [("decode-a", "a")]
    assert list(tracker) == ["decode-b"] and tracker.payloads() == ["b"]
    assert tracker.forget_stale(window_s=10.0) == [] and len(tracker) == 1


def test_refresh_counts_everyone_as_just_heard(tracker, clock):
    """After the watcher's own outage, beats missed meanwhile say nothing about the instances."""
    tracker.beat("decode-a", "a", incarnation="one")
    clock.now += WINDOW_S * 3
    assert tracker.is_stale("decode-a")
    tracker.refresh()
    assert tracker.is_alive("decode-a") and tracker.payload("decode-a") == "a"
    assert tracker.get("decode-a").incarnation_at == 100.0, "a refresh is no restart"


@pytest.mark.parametrize("window_s", [-1.0, float("nan")])
def test_a_window_must_be_a_duration(window_s):
    with pytest.raises(ValueError, match="window"):
        Liveness(window_s)
