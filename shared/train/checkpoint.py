"""Trainer checkpoints: Hugging Face weights plus everything a bit-exact resume needs.

A checkpoint directory holds ``model.safetensors`` (or per-unit shards and an index, for models
over 2 GiB) with the fp32 masters under Hugging Face names, ``config.json`` (written last, so a
reader that sees it sees complete weights: :func:`tandem.shared.model.load_model` loads the
directory as is), ``optimizer.safetensors`` (Adam moments and step counters per unit, RNG states)
and ``trainer_state.json`` (step, data position, the job).

    save_checkpoint(path, state, step=100, job={...})
    info = restore_optimizer(path, state)   # after HostState.from_checkpoint(config, path, ...)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.shared.model.config import ModelLoadError
from tandem.shared.train.host_state import HostState

SINGLE_FILE_MAX_BYTES = 2 << 30
STATE_FILE = "trainer_state.json"


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    # Views into a larger flat buffer are copied out (safetensors refuses shared storage).
    owned = {k: v if v.untyped_storage().nbytes() == v.nbytes else v.clone() for k, v in tensors.items()}
    save_file(owned, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(path: str | os.PathLike, state: HostState, step: int, job: dict[str, Any]) -> Path:
    """Write the checkpoint of ``state`` after ``step`` steps into ``path`` (replacing what was there)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    opt: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        opt["rng.cuda"] = torch.cuda.get_rng_state()
    for unit in state.units:
        opt[f"{unit.name}.exp_avg"] = unit.exp_avg
        opt[f"{unit.name}.exp_avg_sq"] = unit.exp_avg_sq
        opt[f"{unit.name}.step"] = unit.step
    _save(opt, path / "optimizer.safetensors")
    _write_text(path / STATE_FILE, json.dumps({"step": step, "data_position": step, "job": job}, indent=2) + "\n")
    total = sum(u.master.numel() * 4 for u in state.units)
    if total <= SINGLE_FILE_MAX_BYTES:
        _save(state.state_dict(), path / "model.safetensors")
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
    else:
        weight_map: dict[str, str] = {}
        for index, unit in enumerate(state.units):
            shard = f"model-{index + 1:05d}-of-{len(state.units):05d}.safetensors"
            tensors = unit.master_views()
            _save(tensors, path / shard)
            weight_map.update(dict.fromkeys(tensors, shard))
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_text(path / "model.safetensors.index.json", json.dumps(index_json, indent=1) + "\n")
        (path / "model.safetensors").unlink(missing_ok=True)
    config = state.config.to_hf_dict() | {"torch_dtype": "float32"}
    _write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path


def has_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return ((path / STATE_FILE).is_file() and (path / "config.json").is_file()
            and (path / "optimizer.safetensors").is_file())


def restore_optimizer(path: str | os.PathLike, state: HostState) -> dict[str, Any]:
    """Load moments, step counters and RNG states into ``state``; return trainer_state.json."""
    path = Path(path)
    with safe_open(str(path / "optimizer.safetensors"), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for unit in state.units:
            for attr in ("exp_avg", "exp_avg_sq", "step"):
                key = f"{unit.name}.{attr}"
                if key not in keys:
                    raise ModelLoadError(f"{path} optimizer state lacks {key}")
                getattr(unit, attr).copy_(f.get_tensor(key))
        torch.set_rng_state(f.get_tensor("rng.torch"))
        if "rng.cuda" in keys and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("rng.cuda"))
    return json.loads((path / STATE_FILE).read_text())
