"""The block pane's drawing of shared blocks (console/widgets.py, console/screens/blocks.py): a
shared cell shows its ref count, the legend the copy-on-write count, a sequence's block table
``×k`` after each block k tables hold, and a request's later outputs named ``request#i``."""

from __future__ import annotations

import pytest
from rich.text import Text

from tandem.console.screens.blocks import block_table_text, sequence_name
from tandem.console.widgets import block_grid, block_legend, packed
from tandem.shared.protocol.views import BlockSnapshot, SequenceBlocks

PROMPT = [0, 1]  # forked to three samples
TABLES = [PROMPT + [2], PROMPT + [3], PROMPT + [4]]


def snapshot(ref_counts: bool = True, refs: tuple[int, ...] = (3, 3, 1, 1, 1, 0, 0, 0)) -> BlockSnapshot:
    states = bytes(3 if r > 1 else 1 if r else 0 for r in refs)
    sequences = [SequenceBlocks(request_id="req", num_tokens=40, block_table=t, sample_index=i)
                 for i, t in enumerate(TABLES)]
    return BlockSnapshot(instance_id="d", num_blocks=len(refs), block_size=16, states=states,
                         ref_counts=bytes(refs) if ref_counts else b"", cow_copies=2, sequences=sequences)


@pytest.mark.parametrize(("refs", "expected"), [
    ((3, 3, 1, 1, 1, 0, 0, 0), "33███···"),
    ((2, 9, 10, 255, 1, 0, 0, 0), "29++█···"),
], ids=["three-samples", "digits-then-plus"])
def test_a_shared_cell_shows_how_many_tables_hold_it(refs, expected):
    assert block_grid(snapshot(refs=refs), 8, 1).plain == expected


def test_a_worker_sending_no_ref_counts_draws_shared_blocks_as_before():
    assert block_grid(snapshot(ref_counts=False), 8, 1).plain == "█████···"


def test_a_cell_of_several_blocks_shows_the_highest_ref_count_among_them():
    assert block_grid(snapshot(refs=(2, 1, 4, 1, 0, 0, 0, 0)), 2, 1).plain == "4·"  # 4 blocks per cell


def test_the_legend_counts_shared_blocks_and_copies_on_write():
    legend = block_legend(snapshot(), 40, 1).plain
    assert "2 shared 2" in legend and "(digit: tables holding it)" in legend and "copied on write 2" in legend
    assert all(len(line) <= 40 for line in legend.splitlines()), legend


def test_legend_entries_are_never_split_across_lines():
    text = packed([Text("aaa bbb"), Text("cc"), Text("dddd eeee")], 10).plain
    assert text.splitlines() == ["aaa bbb", "cc", "dddd eeee"]


def test_a_block_table_marks_the_blocks_other_tables_hold():
    snap = snapshot()
    text = block_table_text(snap.sequences[1], snap, "decode").plain
    assert text.splitlines()[0] == "req#1 · 40 tokens · 3 blocks of 16"
    assert "2 shared (×k: k block tables hold it)" in text
    assert text.splitlines()[-1].split() == ["0→0×3", "1→1×3", "2→3"], "its own block is unmarked"


def test_a_requests_later_outputs_are_named_by_their_index():
    assert [sequence_name(s) for s in snapshot().sequences] == ["req", "req#1", "req#2"]
