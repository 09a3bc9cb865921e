"""LoRA run checkpoints: the adapter in PEFT's format, plus what a bit-exact resume needs.

The run's output directory holds one checkpoint, replaced as a whole by each save (the commit
protocol of checkpoint.py: a save cut short leaves the previous one):

- ``adapter_config.json`` + ``adapter_model.safetensors``: the adapter as PEFT writes it
  (``peft_format.save_adapter``; fp32 masters), so ``PeftModel.from_pretrained(base, DIR)``,
  ``peft_format.load_adapter`` and tandem's serving read the directory as it is;
- ``optimizer.safetensors``: the adapter's AdamW moments (flat, in ``lora.adapter_layout``'s
  order), its step count and the RNG states;
- ``trainer_state.json``: the step, the data position (the step: batches depend only on it and
  the seed) and the job.

No ``config.json`` and no model weights: the base is the job's model, unchanged. A directory never
holds a LoRA checkpoint and a full one (loop.py refuses either kind of run on the other's folder:
their files overlap).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.shared.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, load_adapter, save_adapter
from tandem.shared.model.config import ModelConfig
from tandem.shared.train.checkpoint import STATE_FILE, commit_save, finish_interrupted_save, partial_path
from tandem.shared.train.lora import TrainedAdapter

OPTIMIZER_FILE = "optimizer.safetensors"
OWNED = (WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE, CONFIG_FILE)  # in commit order: the config last
STAGING = ".adapter-staging"  # save_adapter writes here, then its files become the save's partial files


def has_adapter_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return all((path / name).is_file() for name in OWNED)


def save_adapter_checkpoint(path: str | os.PathLike, adapter: TrainedAdapter, step: int,
                            job: dict[str, Any]) -> Path:
    """Write the checkpoint of ``adapter`` after ``step`` steps into ``path``, replacing the one there
    as a whole (see the module)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    finish_interrupted_save(path)
    staging = path / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # of a save that died before its commit
    save_adapter(staging, adapter.weights())
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        os.replace(staging / name, partial_path(path / name))
    staging.rmdir()
    state = {"rng.torch": torch.get_rng_state(), "adapter.exp_avg": adapter.exp_avg.cpu(),
             "adapter.exp_avg_sq": adapter.exp_avg_sq.cpu(), "adapter.step": adapter.step.cpu()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(state, str(partial_path(path / OPTIMIZER_FILE)), metadata={"format": "pt"})
    trainer_state = {"step": step, "data_position": step, "job": job}
    partial_path(path / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
    commit_save(path, step, list(OWNED), list(OWNED))
    return path


def restore_adapter(path: str | os.PathLike, cfg: ModelConfig, adapter: TrainedAdapter) -> dict[str, Any]:
    """Load the checkpoint in ``path`` into ``adapter`` (masters, moments, step) and the RNG states;
    return trainer_state.json. :class:`AdapterError` (one line) when it is not an adapter of this
    job's rank, alpha and targets on ``cfg``'s model."""
    path = Path(path)
    saved = load_adapter(path, cfg)
    want = adapter.config
    if (saved.config.rank, saved.config.alpha, saved.config.targets) != (want.rank, want.alpha, want.targets):
        raise AdapterError(f"{path} holds a rank-{saved.config.rank} adapter (alpha {saved.config.alpha:g}) of "
                           f"{','.join(saved.config.targets)}; resume with those --lora-rank, --lora-alpha and "
                           f"--lora-targets, or give another --output-dir")
    adapter.load_(saved)
    with safe_open(str(path / OPTIMIZER_FILE), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        for attr in ("exp_avg", "exp_avg_sq", "step"):
            key = f"adapter.{attr}"
            target = getattr(adapter, attr)
            tensor = f.get_tensor(key) if key in keys else None
            if tensor is None or tensor.shape != target.shape:
                raise AdapterError(f"{path / OPTIMIZER_FILE} has no {key} of this adapter's size; it is not this "
                                   "run's checkpoint (give another --output-dir)")
            target.copy_(tensor)
        torch.set_rng_state(f.get_tensor("rng.torch"))
        if "rng.cuda" in keys and torch.cuda.is_available():
            torch.cuda.set_rng_state(f.get_tensor("rng.cuda"))
    return json.loads((path / STATE_FILE).read_text())
