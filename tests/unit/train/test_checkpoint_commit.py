"""A checkpoint save cut short at any point leaves a whole checkpoint: the previous one, or the new
one once its commit record is written (shared/train/checkpoint.py). Never the weights of one step
beside the optimizer state or the step counter of another, which a resume would take as one state.

Each save is cut at every file write and every rename it makes in turn (a ``KeyboardInterrupt``
there, as a second Ctrl-C would raise), then the folder is read back as a resume reads it.

Run: ``python -m pytest -q tests/unit/train/test_checkpoint_commit.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tandem.shared.train import checkpoint
from tandem.shared.train.checkpoint import (
    COMMIT_FILE,
    STATE_FILE,
    finish_interrupted_save,
    has_checkpoint,
    save_checkpoint,
)
from tandem.shared.train.host_state import HostState
from tandem.shared.train.presets import resolve_model

OLD_STEP, NEW_STEP = 2, 4


@pytest.fixture(scope="module")
def state() -> HostState:
    config, _, _ = resolve_model("tiny")
    return HostState.random(config, seed=0, work_dtype=torch.float32, pin=False)


def marked(state: HostState, step: int) -> HostState:
    """``state`` with every master, moment and step counter set to ``step``, so a file tells which save wrote it."""
    for unit in state.units:
        for tensor in (unit.master, unit.exp_avg, unit.exp_avg_sq, unit.step):
            tensor.fill_(step)
    return state


def steps_on_disk(path: Path) -> dict[str, set[int]]:
    """Which step each part of the checkpoint in ``path`` is of: the trainer state, the weights
    (every tensor of every weights file the folder names), the optimizer's moments."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: set[int] = set()
    for name in files:
        with safe_open(str(path / name), framework="pt", device="cpu") as f:
            weights |= {int(f.get_tensor(key).unique().item()) for key in f.keys()}
    with safe_open(str(path / "optimizer.safetensors"), framework="pt", device="cpu") as f:
        moments = {int(f.get_tensor(key).unique().item()) for key in f.keys() if key.endswith(".exp_avg")}
    return {"trainer_state": {json.loads((path / STATE_FILE).read_text())["step"]}, "weights": weights,
            "moments": moments}


class CutShort(KeyboardInterrupt):
    pass


def cut_at(monkeypatch: pytest.MonkeyPatch, stop_at: int | None) -> list[str]:
    """Make the save's ``stop_at``-th write or rename (from 0) raise instead; returns what it did."""
    done: list[str] = []

    def counted(kind: str, real):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            what = f"{kind} {Path(str(args[1])).name}"  # save_file(tensors, file), os.replace(source, target)
            if stop_at is not None and len(done) == stop_at:
                raise CutShort(what)
            done.append(what)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(checkpoint.os, "replace", counted("rename", checkpoint.os.replace))
    monkeypatch.setattr(checkpoint, "save_file", counted("write", checkpoint.save_file))
    return done


SLOW = pytest.mark.slow


# slow: each save is cut at every write and rename; the two layouts alone run by default
@pytest.mark.parametrize(("old_shards", "new_shards"), [(False, False), pytest.param(True, True, marks=SLOW),
                                                        pytest.param(False, True, marks=SLOW), (True, False)],
                         ids=["one-file", "shards", "one-file-then-shards", "shards-then-one-file"])
def test_a_save_cut_short_anywhere_leaves_one_whole_checkpoint(tmp_path, monkeypatch, state, old_shards: bool,
                                                               new_shards: bool):
    def save(step: int, shards: bool) -> None:
        with monkeypatch.context() as patch:
            # 0 bytes: every model is "over the limit", so each unit gets a shard of its own
            patch.setattr(checkpoint, "SINGLE_FILE_MAX_BYTES", 0 if shards else 2 << 30)
            save_checkpoint(path, marked(state, step), step, {"steps": 10})

    path = tmp_path / "never-cut"
    save(OLD_STEP, old_shards)
    with monkeypatch.context() as patch:
        steps = cut_at(patch, None)
        save(NEW_STEP, new_shards)
    assert steps_on_disk(path) == {part: {NEW_STEP} for part in ("trainer_state", "weights", "moments")}
    assert len(steps) > 4, f"a save writes its files and renames them: {steps}"

    for stop_at in range(len(steps)):
        path = tmp_path / f"cut-{stop_at}"
        save(OLD_STEP, old_shards)
        with monkeypatch.context() as patch:
            cut_at(patch, stop_at)
            with pytest.raises(CutShort):
                save(NEW_STEP, new_shards)
        committed = (path / COMMIT_FILE).exists()
        finish_interrupted_save(path)  # what the next save or a resume does first
        on_disk = steps_on_disk(path)
        kept = {step for found in on_disk.values() for step in found}
        assert len(kept) == 1, f"cut at {steps[stop_at]!r}: the folder mixes steps {on_disk}"
        assert kept == {NEW_STEP if committed else OLD_STEP}, \
            f"cut at {steps[stop_at]!r} ({'after' if committed else 'before'} the commit record): holds step {kept}"
        assert has_checkpoint(path), f"cut at {steps[stop_at]!r}: no checkpoint left"
        assert not list(path.rglob(f"*{checkpoint.PARTIAL}")) and not (path / COMMIT_FILE).exists(), \
            f"cut at {steps[stop_at]!r}: left {sorted(p.name for p in path.iterdir())}"
        layouts = {(path / "model.safetensors").exists(), (path / "model.safetensors.index.json").exists()}
        assert layouts == {True, False}, f"cut at {steps[stop_at]!r}: both weights layouts or none: " \
                                         f"{sorted(p.name for p in path.iterdir())}"


def test_files_the_checkpoint_does_not_own_stay_and_extras_are_committed_with_it(tmp_path, state):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "README.md").write_text("notes")
    source = tmp_path / "tokenizer.json"
    source.write_text('{"version": "1.0"}')
    save_checkpoint(path, marked(state, 1), 1, {}, extra={"tokenizer.json": source,
                                                          "templates/chat.jinja": "{{ messages }}"})
    assert (path / "README.md").read_text() == "notes"
    assert (path / "tokenizer.json").read_text() == source.read_text()
    assert (path / "templates" / "chat.jinja").read_text() == "{{ messages }}"
