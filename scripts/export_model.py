"""Refresh a checkpoint shipped in shared/model/weights/ from a ``tandem train`` run.

    python3 -m tandem train --default --data-dir /tmp/tiny-ship
    python3 scripts/export_model.py /tmp/tiny-ship/models/tiny --target shared/model/weights/tiny
    python3 scripts/export_model.py /tmp/coder-run --target shared/model/weights/coder

Writes ``config.json`` and ``model.safetensors`` there, and the tokenizer files the run saved
(``tokenizer.json``, ``tokenizer_config.json``): the same config, the weights rounded to float16
(half the bytes; the loader casts them back to the serving dtype). The trainer's optimizer state
stays behind; its ``trainer_state.json`` (the job that made the weights) is kept as
``trainer_job.json``. Update the folder's ``PROVENANCE.md`` by hand afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = Path(__file__).resolve().parents[1] / "shared" / "model" / "weights"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export(source: Path, target: Path, dtype: torch.dtype = torch.float16) -> Path:
    state = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    trainer = (json.loads((source / "trainer_state.json").read_text())
               if (source / "trainer_state.json").is_file() else {})
    target.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "source": "tandem train", "step": str(trainer.get("step", "?"))}
    tmp = target / "model.safetensors.tmp"
    save_file({k: v.to(dtype).contiguous() for k, v in sorted(state.items())}, str(tmp), metadata=metadata)
    os.replace(tmp, target / "model.safetensors")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if trainer:
        (target / "trainer_job.json").write_text(json.dumps(trainer, indent=1) + "\n")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a checkpoint directory tandem train wrote")
    parser.add_argument("--target", type=Path, default=WEIGHTS / "tiny",
                        help="default: the shipped tiny model's folder")
    args = parser.parse_args()
    out = export(args.source, args.target)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}/config.json and model.safetensors ({size / 1e6:.2f} MB, float16)")


if __name__ == "__main__":
    main()
