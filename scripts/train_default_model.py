"""Train the default ``coder`` model on one GPU: candidates side by side, the best one chosen by measurement.

    python3 scripts/train_default_model.py --out /tmp/coder-run                  # within a 10-minute call
    python3 scripts/train_default_model.py --candidates coder-m --twin coder-m --limit-s 560 --out /tmp/final

Each candidate preset runs the same ``tandem train`` recipe (the standard library, the preset's own
BPE, batch 32 × 2,048 unless told, AdamW 2e-3 with 5 % warmup and cosine decay, seed 0, deterministic kernels)
for the same wall time on one GPU: a short probe of all of them at once measures each one's tok/s
while sharing the card, and each then gets the steps that fill what is left of ``--limit-s`` (less
``--margin-s`` for start-up, scoring and export). ``--twin P`` runs preset P a second time with the
same command, and the two ``model.safetensors`` are compared by sha256: whether the recipe
reproduces. Every candidate is scored by ``benchmarks/default_model.py`` (heads, bits per byte); the
one with the lowest bits per byte is exported in fp16 with its tokenizer (``scripts/export_model.py``)
to ``--out``/best, ready to become ``shared/model/weights/coder``. Logs (each run's command first, a
progress line every 10 steps: the loss curve) and the scores land in ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ["--dataset", "stdlib", "--lr", "2e-3",
          "--weight-decay", "0.1", "--grad-clip", "1.0", "--seed", "0", "--deterministic", "--checkpoint-every", "0",
          "--log-every", "10"]
PROBE_STEPS = 12


class Runs:
    """``tandem train`` children, one log file each."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out, self.args = out, args

    def command(self, preset: str, steps: int, run_dir: Path) -> list[str]:
        return ["-m", "tandem", "train", "--model", preset, "--steps", str(steps),
                "--warmup-steps", str(max(2, steps // 20)), "--batch-size", str(self.args.batch_size),
                "--seq-len", str(self.args.seq_len), *RECIPE, "--device", self.args.device,
                "--gpu-memory-gib", str(self.args.gpu_memory_gib), "--output-dir", str(run_dir),
                "--job-id", run_dir.name]

    def start(self, preset: str, steps: int, name: str) -> subprocess.Popen:
        run_dir = self.out / name
        log = (self.out / f"{name}.log").open("w")
        log.write("$ python3 " + " ".join(self.command(preset, steps, run_dir)) + "\n")
        log.flush()
        return subprocess.Popen([sys.executable, *self.command(preset, steps, run_dir)], stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT)

    def rate(self, name: str) -> float:
        """The last progress line's tokens/s."""
        lines = re.findall(r"step \d+/\d+ .*? ([\d,]+) tok/s", (self.out / f"{name}.log").read_text())
        return float(lines[-1].replace(",", "")) if lines else 0.0


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", default="coder-s,coder-m", help="presets, comma-separated")
    parser.add_argument("--twin", default="coder-m", help="a preset to run twice (empty: none)")
    parser.add_argument("--limit-s", type=float, default=540, help="wall time for everything")
    parser.add_argument("--margin-s", type=float, default=130, help="of it, kept for start-up, scoring, export")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-gib", type=float, default=24, help="each run's cap (they share the card)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    candidates = [c for c in args.candidates.split(",") if c]
    names = {c: c for c in candidates} | ({f"{args.twin}-twin": args.twin} if args.twin else {})
    args.out.mkdir(parents=True, exist_ok=True)
    probe = Runs(args.out / "probe", args)
    probe.out.mkdir(exist_ok=True)
    for proc in [probe.start(preset, PROBE_STEPS, name) for name, preset in names.items()]:
        proc.wait()
    rates = {name: probe.rate(name) for name in names}
    left = args.limit_s - (time.perf_counter() - started) - args.margin_s
    steps = {name: max(20, int(rates[name] * left / (args.batch_size * args.seq_len))) for name in names}
    steps.update({name: steps[names[name]] for name in names if name not in candidates})  # a twin: its preset's
    print(f"probe tok/s (sharing the card): {rates}; {left:.0f} s left to train: steps {steps}", flush=True)
    runs = Runs(args.out, args)
    procs = {name: runs.start(preset, steps[name], name) for name, preset in names.items()}
    failed = [name for name, proc in procs.items() if proc.wait() != 0]
    if failed:
        print(f"failed: {failed} (see their logs in {args.out})", flush=True)
    if args.twin:
        digests = [sha256(args.out / name / "model.safetensors") for name in (args.twin, f"{args.twin}-twin")]
        same = digests[0] is not None and digests[0] == digests[1]
        print(f"{args.twin} twice with one command: {'bit-identical' if same else 'DIFFERENT'} weights {digests}",
              flush=True)
    scored = [c for c in candidates if c not in failed]
    if not scored:
        return 1
    scores = args.out / "scores.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "default_model.py"), *[str(args.out / c) for c in scored],
                    "--device", args.device, "--skip-decode", "--json", str(scores)], check=True, cwd=ROOT)
    rows = json.loads(scores.read_text())["models"]
    best = min(zip(scored, rows, strict=True), key=lambda pair: pair[1]["bits_per_byte"])[0]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_model.py"), str(args.out / best),
                    "--target", str(args.out / "best")], check=True, cwd=ROOT)
    print(f"best: {best}, exported to {args.out / 'best'} ({time.perf_counter() - started:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
