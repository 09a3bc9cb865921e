"""Trainer checkpoints: Hugging Face weights plus everything a bit-exact resume needs.

A checkpoint directory holds ``model.safetensors`` (or per-unit shards and an index, for models
over 2 GiB) with the masters under Hugging Face names (fp32, or bf16 for a job with bf16 masters),
``config.json`` (so :func:`tandem.shared.model.load_model` loads the directory as is),
``optimizer.safetensors`` (Adam moments, in the job's format, and step counters per unit, a bf16
master's Kahan compensation, RNG states) and ``trainer_state.json`` (step, data position, the job,
the state's format).

    save_checkpoint(path, state, step=100, job={...})
    info = restore_optimizer(path, state)   # after HostState.from_checkpoint(config, path, ...)

A save replaces the checkpoint in the directory as a whole, whenever the saving process dies (a
second Ctrl-C, SIGKILL, a full disk): every new file is written under a temporary name beside its
final one, then a commit record (``checkpoint.commit.json``, itself written whole) lists the
renames and removals that make them the checkpoint, then they are done and the record removed. Up to
the record, the directory still holds the previous checkpoint, whole; from it on, the new one is
complete on disk and :func:`finish_interrupted_save` (run by the next save and before a resume)
carries out what the record says. A directory never mixes the weights of one step with the
optimizer state of another. The directory keeps its identity (no rename of the folder itself: it
may be a mount point or the working directory), and files the checkpoint does not own (a README,
tokenizer files) stay. The cost: old and new files are both on disk until the commit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.shared.model.config import ModelLoadError
from tandem.shared.train.host_state import HostState

SINGLE_FILE_MAX_BYTES = 2 << 30
STATE_FILE = "trainer_state.json"
COMMIT_FILE = "checkpoint.commit.json"
PARTIAL = ".partial"  # the suffix of a file being written, not yet part of any checkpoint


def _partial(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # Views into a larger flat buffer are copied out (safetensors refuses shared storage).
    owned = {k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in tensors.items()}
    save_file(owned, str(path), metadata={"format": "pt"})


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader, or a process killed meanwhile, sees the old file
    or the new one, never a part."""
    tmp = _partial(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def _owned(path: Path) -> list[str]:
    """The names in ``path`` a checkpoint writes: the weights (one file, or shards and their index),
    the optimizer state, the trainer state, the config."""
    return [p.name for p in path.iterdir()
            if p.name in (STATE_FILE, "config.json", "optimizer.safetensors", "model.safetensors.index.json")
            or (p.name.startswith("model") and p.name.endswith(".safetensors"))]


def finish_interrupted_save(path: str | os.PathLike) -> bool:
    """Complete a save whose process died after its commit record was written (every new file
    was whole by then), and remove the partial files of one that died before; True when a save
    was completed here. Idempotent: the renames already done are skipped."""
    path = Path(path)
    if not path.is_dir():
        return False
    record = path / COMMIT_FILE
    completed = False
    if record.is_file():
        commit = json.loads(record.read_text())
        for name in commit["rename"]:
            if _partial(path / name).exists():
                os.replace(_partial(path / name), path / name)
        for name in commit["remove"]:
            (path / name).unlink(missing_ok=True)
        record.unlink()
        completed = True
    for leftover in path.rglob(f"*{PARTIAL}"):  # of a save that died before its commit record
        leftover.unlink(missing_ok=True)
    return completed


def save_checkpoint(path: str | os.PathLike, state: HostState, step: int, job: dict[str, Any],
                    extra: Mapping[str, Path | str] | None = None) -> Path:
    """Write the checkpoint of ``state`` after ``step`` steps into ``path``, replacing the one there
    as a whole (see the module: a save cut short leaves the previous checkpoint). ``extra``: more
    files committed with it (the tokenizer a served model needs), name relative to ``path`` ->
    a file to copy (a Path) or the text itself."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    finish_interrupted_save(path)
    written: list[str] = []
    for name, source in (extra or {}).items():
        target = _partial(path / name)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            shutil.copyfile(source, target)
        else:
            target.write_text(source, encoding="utf-8")
        written.append(name)

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        _save(tensors, _partial(path / name))
        written.append(name)

    def write(name: str, text: str) -> None:
        _partial(path / name).write_text(text)
        written.append(name)

    opt: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        opt["rng.cuda"] = torch.cuda.get_rng_state()
    for unit in state.units:
        opt.update({f"{unit.name}.{name}": tensor for name, tensor in unit.optimizer_tensors().items()})
    total = sum(u.master.nbytes for u in state.units)
    if total <= SINGLE_FILE_MAX_BYTES:
        save(state.state_dict(), "model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for index, unit in enumerate(state.units):
            shard = f"model-{index + 1:05d}-of-{len(state.units):05d}.safetensors"
            tensors = unit.master_views()
            save(tensors, shard)
            weight_map.update(dict.fromkeys(tensors, shard))
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write("model.safetensors.index.json", json.dumps(index_json, indent=1) + "\n")
    save(opt, "optimizer.safetensors")
    record = {"step": step, "data_position": step, "job": job,
              "state_format": {"master": state.format.master, "moments": state.format.moments}}
    write(STATE_FILE, json.dumps(record, indent=2) + "\n")
    config = state.config.to_hf_dict() | {"torch_dtype": "bfloat16" if state.format.bf16_master else "float32"}
    write("config.json", json.dumps(config, indent=2) + "\n")  # last: a fresh folder's loader waits for it
    commit_save(path, step, written, _owned(path))  # stale: the other weights layout's files, shards of another count
    return path


def partial_path(path: Path) -> Path:
    """Where a file of a save is written before its commit (removed if the save dies before it)."""
    return _partial(path)


def commit_save(path: Path, step: int, written: list[str], owned: list[str]) -> None:
    """Make ``written`` (names in ``path``, each whole under :func:`partial_path`) the checkpoint of
    ``step`` as one change: the commit record, then the renames and the removal of those of
    ``owned`` (what a checkpoint of this kind writes) not written this time (see the module)."""
    stale = sorted(set(owned) - set(written))
    _write_whole(path / COMMIT_FILE, json.dumps({"step": step, "rename": written, "remove": stale}) + "\n")
    finish_interrupted_save(path)


def has_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return ((path / STATE_FILE).is_file() and (path / "config.json").is_file()
            and (path / "optimizer.safetensors").is_file())


def restore_optimizer(path: str | os.PathLike, state: HostState) -> dict[str, Any]:
    """Load moments, step counters and RNG states into ``state``; return trainer_state.json. The
    state's format (state_format.py) must be the checkpoint's: its moments are not converted."""
    path = Path(path)
    info = json.loads((path / STATE_FILE).read_text())
    saved = info.get("state_format", {"master": "fp32", "moments": "fp32"})
    if (saved["master"], saved["moments"]) != (state.format.master, state.format.moments):
        raise ModelLoadError(f"{path} was trained with --master-weights {saved['master']} --adam-moments "
                             f"{saved['moments']}: resume it with those")
    with safe_open(str(path / "optimizer.safetensors"), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for unit in state.units:
            for attr, tensor in unit.optimizer_tensors().items():
                key = f"{unit.name}.{attr}"
                if key not in keys:
                    raise ModelLoadError(f"{path} optimizer state lacks {key}")
                tensor.copy_(f.get_tensor(key))
        torch.set_rng_state(f.get_tensor("rng.torch"))
        if "rng.cuda" in keys and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("rng.cuda"))
    return info
