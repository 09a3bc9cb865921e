"""Refresh the tiny checkpoint shipped in shared/model/weights/ from a ``tandem train --default`` run.

    python3 -m tandem train --default --data-dir /tmp/tiny-ship
    python3 scripts/export_tiny.py /tmp/tiny-ship/models/tiny

Writes ``tiny/config.json`` and ``tiny/model.safetensors`` there: the same config, the
weights rounded to float16 (half the bytes; the loader casts them back to the serving dtype, and
the logits move by under 0.01 from the float32 run's). The trainer's optimizer state and
trainer_state.json stay behind. Update ``tiny/PROVENANCE.md`` by hand afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parents[1] / "shared" / "model" / "weights" / "tiny"


def export(source: Path, target: Path = HERE, dtype: torch.dtype = torch.float16) -> Path:
    state = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    trainer = (json.loads((source / "trainer_state.json").read_text())
               if (source / "trainer_state.json").is_file() else {})
    target.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "source": "tandem train --default", "step": str(trainer.get("step", "?"))}
    tmp = target / "model.safetensors.tmp"
    save_file({k: v.to(dtype).contiguous() for k, v in sorted(state.items())}, str(tmp), metadata=metadata)
    os.replace(tmp, target / "model.safetensors")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a tiny checkpoint directory, e.g. <data-dir>/models/tiny")
    parser.add_argument("--target", type=Path, default=HERE)
    args = parser.parse_args()
    out = export(args.source, args.target)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}/config.json and model.safetensors ({size / 1e6:.2f} MB, float16)")


if __name__ == "__main__":
    main()
