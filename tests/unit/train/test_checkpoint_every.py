"""When a run saves checkpoints: every ``checkpoint_every`` steps, after a step once
``checkpoint_every_s`` passed since the last save (``tandem train``'s default, ``--checkpoint-every
30m``), and at the end; with neither, only at the end.

Run: ``python -m pytest -q tests/unit/train/test_checkpoint_every.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.shared.protocol.training import TrainJob
from tandem.shared.train.loop import TrainLoop

STEPS = 4


@pytest.mark.parametrize(("every_steps", "every_s", "saved_at"), [
    (0, 0.0, [STEPS]),
    (2, 0.0, [2, STEPS]),
    (0, 1e-9, [1, 2, 3, STEPS]),  # any time at all has passed after each step
    (0, 3600.0, [STEPS]),
], ids=["only-at-the-end", "steps", "time-passed", "time-not-yet"])
def test_checkpoints_are_saved_by_steps_by_time_and_at_the_end(tmp_path: Path, every_steps: int, every_s: float,
                                                              saved_at: list[int]):
    job = TrainJob(model="tiny", dataset="random", steps=STEPS, batch_size=1, seq_len=16, device="cpu",
                   checkpoint_every=every_steps, output_dir=str(tmp_path / "out"))
    saved: list[int] = []

    def on_checkpoint(path: Path, step: int) -> None:
        assert json.loads((path / "trainer_state.json").read_text())["step"] == step
        saved.append(step)

    TrainLoop(job, "every", tmp_path).run(on_checkpoint=on_checkpoint, checkpoint_every_s=every_s)
    assert saved == saved_at
