"""``tandem train``'s stop signals and ``--checkpoint-every``, in process: the first SIGINT or SIGTERM
while training asks for a stop at the next step boundary, one before training began or a second one
stops at once; ``--checkpoint-every`` takes steps or a time and defaults to a time.

(The whole of it, a real ``tandem train`` stopped and resumed: tests/e2e/test_train_cli.py.)

Run: ``python3 -m pytest -q tests/unit/cli/test_train_stop.py``.
"""

from __future__ import annotations

import argparse
import signal

import pytest

from tandem.cli.train import (
    CHECKPOINT_EVERY,
    CheckpointEvery,
    StopAtOnce,
    StopSignals,
    add_train_parser,
    build_job,
    checkpoint_every,
    checkpoint_interval,
    exit_status,
)


@pytest.fixture
def stops():
    with StopSignals() as installed:
        yield installed


def test_the_first_signal_in_training_asks_for_a_stop_and_the_second_stops_at_once(stops):
    assert signal.getsignal(signal.SIGTERM) == stops.on_signal
    stops.training()
    stops.on_signal(signal.SIGTERM, None)
    assert stops.stop_requested() and stops.signum == signal.SIGTERM
    with pytest.raises(StopAtOnce) as again:
        stops.on_signal(signal.SIGINT, None)
    assert again.value.signum == signal.SIGINT
    stops.on_signal(signal.SIGINT, None)  # a third: the stop at once under way is not cut short


def test_a_signal_before_training_began_stops_at_once(stops):
    with pytest.raises(StopAtOnce):
        stops.on_signal(signal.SIGINT, None)


def test_the_handlers_are_put_back_and_an_ignored_sigint_stays_ignored():
    before = signal.getsignal(signal.SIGTERM)
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "a background command's SIGINT was taken"
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        signal.signal(signal.SIGINT, previous_int)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_exit_status_is_the_shells_for_the_signal(signum: int, status: int):
    assert exit_status(signum) == status


@pytest.mark.parametrize(("text", "expected"), [
    ("500", CheckpointEvery(steps=500)),
    ("0", CheckpointEvery()),
    ("90s", CheckpointEvery(seconds=90)),
    ("30m", CheckpointEvery(seconds=1800)),
    ("1.5h", CheckpointEvery(seconds=5400)),
])
def test_checkpoint_every_takes_steps_or_a_time(text: str, expected: CheckpointEvery):
    assert checkpoint_every(text) == expected


@pytest.mark.parametrize("text", ["5x", "1.5", "-3", "m", ""])
def test_checkpoint_every_refuses_anything_else(text: str):
    with pytest.raises(argparse.ArgumentTypeError, match="N steps or a time"):
        checkpoint_every(text)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(), lambda p: None)
    return parser.parse_args(["train", *flags])


def test_checkpoints_come_every_30_minutes_unless_given(tmp_path):
    assert CHECKPOINT_EVERY == "30m"
    args = parse()
    assert checkpoint_interval(args) == CheckpointEvery(seconds=1800)
    assert build_job(args, tmp_path).checkpoint_every == 0, "a time is no step count"
    assert build_job(parse("--checkpoint-every", "25"), tmp_path).checkpoint_every == 25
    assert checkpoint_interval(parse("--checkpoint-every", "0")) == CheckpointEvery()
