"""Snapshot tests of every console pane (pytest-textual-snapshot), on the fixed demo state.

The state comes from :func:`tandem.console.demo.demo_state` (no clock, no randomness) and the
terminal is 120x40, so each pane renders the same SVG every run; the accepted SVGs live in
``tests/__snapshots__/test_console_snapshots/``. After a deliberate change to a pane, look at the
report and accept the new pictures with
``python3 -m pytest -q tests/unit/console/test_console_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

import pytest

from tandem.console.app import ConsoleApp
from tandem.console.demo import demo_state

SIZE = (120, 40)


def demo_app() -> ConsoleApp:
    return ConsoleApp(state=demo_state())


@pytest.mark.parametrize("key", ["1", "2", "3", "4", "5"],
                         ids=["services", "blocks", "overlap", "scaling", "routing"])
def test_pane(snap_compare, key: str):
    assert snap_compare(demo_app(), press=[key], terminal_size=SIZE)


def test_blocks_pane_with_the_second_sequence_chosen(snap_compare):
    """Its blocks turn yellow in the grid; its table shows 4 prefix-cache blocks (shared: ×2) and 5 handed off."""
    assert snap_compare(demo_app(), press=["2", "tab", "down"], terminal_size=SIZE)


def test_blocks_pane_with_a_sample_of_a_forked_request_chosen(snap_compare):
    """req-0003#1, the second of three samples: its 16 prompt blocks show ×3 (the grid's cells 3),
    its own two blocks are unmarked; the legend counts 2 copies on write."""
    assert snap_compare(demo_app(), press=["2", "tab", "down", "down", "down"], terminal_size=SIZE)


def test_blocks_pane_of_a_worker_without_a_snapshot_yet(snap_compare):
    assert snap_compare(demo_app(), press=["2", "down"], terminal_size=SIZE)


def test_overlap_pane_zoomed_and_panned(snap_compare):
    assert snap_compare(demo_app(), press=["3", "plus", "plus", "right"], terminal_size=SIZE)


def test_help(snap_compare):
    assert snap_compare(demo_app(), press=["question_mark"], terminal_size=SIZE)


def test_drain_asks_for_confirmation(snap_compare):
    assert snap_compare(demo_app(), press=["d"], terminal_size=SIZE)
