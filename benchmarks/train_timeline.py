"""Where a training step's time goes between one backward and the next forward, from the timeline
``train_offload.py`` dumps (``TANDEM_TIMELINE_DIR=DIR python3 benchmarks/train_offload.py --runs
3b:auto --steps 3``, one JSON file per run: every measured step with its start and its ops).

For each pair of consecutive steps it prints, in milliseconds after the first step's backward ended:
when the next forward's first copy began and its first and last layer ran (the GPU idles until the
first), when the host optimizer's passes started and ended and how long each unit's took, and the
backward's own span, compute and the gaps inside it longer than ``--gap-ms`` (a layer waiting for its
copies).

    python3 benchmarks/train_timeline.py DIR/3b_auto.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_ops(path: Path) -> tuple[list[int], list[tuple]]:
    """``(steps, ops)``: each op ``(start_s, end_s, lane, layer, phase, bytes, step)`` on one clock."""
    steps = json.loads(path.read_text())
    ops = [(o["start_s"] + s["start_s"], o["end_s"] + s["start_s"], o["lane"], o["layer"], o["phase"], o["bytes"],
            s["step"]) for s in steps for o in s["ops"]]
    return [s["step"] for s in steps], sorted(ops)


def window(ops: list[tuple], step: int, gap_s: float) -> dict | None:
    """The figures between ``step``'s backward and the next step's forward (None if either is missing)."""
    backward = [o for o in ops if o[6] == step and o[2] == "compute" and o[4] == "bwd"]
    forward = [o for o in ops if o[6] == step + 1 and o[2] == "compute" and o[4] == "fwd"]
    if not backward or not forward:
        return None
    end = max(o[1] for o in backward)
    copies = [o for o in ops if o[6] == step + 1 and o[2] == "h2d" and o[4] == "fwd"]
    passes = [o for o in ops if o[6] == step and o[2] == "optimizer"]
    gaps = [(round((b[0] - a[1]) * 1e3, 1), b[3]) for a, b in zip(backward, backward[1:]) if b[0] - a[1] > gap_s]
    ms = lambda t: round((t - end) * 1e3, 1)  # noqa: E731
    return {
        "step": step,
        "next_forward_first_copy_ms": ms(copies[0][0]) if copies else None,
        "next_forward_first_ms": ms(min(o[0] for o in forward)),
        "next_forward_last_ms": ms(max(o[1] for o in forward)),
        "host_passes_ms": [ms(passes[0][0]), ms(passes[-1][1])] if passes else None,
        "host_pass_each_ms": [round((o[1] - o[0]) * 1e3, 1) for o in passes],
        "backward_span_ms": round((end - min(o[0] for o in backward)) * 1e3, 1),
        "backward_compute_ms": round(sum(o[1] - o[0] for o in backward) * 1e3, 1),
        "backward_gaps_ms_layer": gaps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dumps", nargs="+", type=Path, help="JSON files written under TANDEM_TIMELINE_DIR")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="report backward gaps longer than this")
    args = parser.parse_args()
    for path in args.dumps:
        steps, ops = load_ops(path)
        print(f"{path}: steps {steps}")
        for step in steps[:-1]:
            figures = window(ops, step, args.gap_ms / 1e3)
            if figures is not None:
                print(json.dumps(figures))


if __name__ == "__main__":
    main()
