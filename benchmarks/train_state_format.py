"""The host state's formats against fp32 AdamW: loss curves on the same data, bytes a parameter, speed.

    python benchmarks/train_state_format.py                       # tiny on the CPU, 200 steps, 3 seeds
    python benchmarks/train_state_format.py --model 1b --device cuda --batch-size 8 --seq-len 1024 --seeds 0
    python benchmarks/train_state_format.py --formats fp32/fp32,bf16-sr/int8 --steps 50
    python benchmarks/train_state_format.py --largest-for-gib 128   # the plan's largest preset per format

Each format (``MASTER/MOMENTS``: ``--master-weights`` and ``--adam-moments``, shared/train/state_format.py)
trains in its own process (host RAM is returned between them) with the same seed, data, schedule and
placement rules as ``tandem train``, once per seed; the first format listed is the baseline (fp32/fp32 by
default). Printed per format and seed: the host state's bytes a parameter (masters, moments, working copies
and gradient buffers as allocated, over the model's parameters), the final loss (mean of the last 10
steps) and its ratio to the baseline's of the same seed, the largest gap between the two loss curves
(each smoothed over 10 steps, relative), and the tokens/s of the steps after the first five; then per
format the mean ratio over the seeds, and the first seed's curves every ``--every`` steps side by side.
Why several seeds: a compact format's run parts ways with fp32's (its rounding perturbs every step and
training amplifies it), and on a small model one run's final loss lands a few percent above or below
fp32's depending on the seed; the mean over seeds is the format's effect.

``--largest-for-gib G`` trains nothing: for each format it prints the largest preset whose memory plan
(shared/train/plan.py, batch and sequence as given, the GPU's part left out) fits G GiB of host RAM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_FORMATS = "fp32/fp32,bf16-sr/int8,bf16-kahan/int8,fp32/int8,bf16-sr/fp32"
SMOOTH = 10


def run_one(fmt: str, args: argparse.Namespace) -> dict:
    """Train one format in this process; its figures."""
    from tandem.shared.protocol.training import TrainJob
    from tandem.shared.train.loop import TrainLoop

    master, moments = fmt.split("/")
    job = TrainJob(model=args.model, dataset=args.dataset, steps=args.steps, batch_size=args.batch_size,
                   seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=0.1, grad_clip=1.0,
                   seed=args.seed, device=args.device, master_weights=master, adam_moments=moments,
                   output_dir=tempfile.mkdtemp(prefix="state-format-"))
    loop = TrainLoop(job, f"format-{master}-{moments}", Path(job.output_dir))
    losses: list[float] = []
    rates: list[float] = []

    def on_step(m) -> None:  # noqa: ANN001
        losses.append(m.loss)
        rates.append(m.tokens_per_s)
        if m.step % max(1, args.steps // 10) == 0:
            print(f"  {fmt}: step {m.step}/{args.steps} loss {m.loss:.4f}", file=sys.stderr, flush=True)

    loop.run(on_step=on_step, final_checkpoint=False)
    return {"format": fmt, "params": loop.num_params, "host_state_bytes": loop.state.nbytes(),
            "bytes_per_param": round(loop.state.nbytes() / loop.num_params, 3), "losses": losses,
            "tokens_per_s": round(statistics.median(rates[5:] or rates)), "device": str(loop.device)}


def smoothed(values: list[float]) -> list[float]:
    return [statistics.fmean(values[max(0, i - SMOOTH + 1): i + 1]) for i in range(len(values))]


def largest(args: argparse.Namespace, formats: list[str]) -> None:
    import torch

    from tandem.shared.train.layout import count_parameters
    from tandem.shared.train.plan import GiB, Placement, memory_plan
    from tandem.shared.train.presets import _SHAPES, preset_config
    from tandem.shared.train.state_format import StateFormat

    cap = int(args.largest_for_gib * GiB)
    for fmt in formats:
        state = StateFormat(*fmt.split("/"))
        fits = []
        for name in _SHAPES:
            cfg = preset_config(name)
            for split in (True, False):
                plan = memory_plan(cfg, torch.bfloat16, args.batch_size, args.seq_len, Placement(), split=split,
                                   host_available=cap, state_format=state)
                if plan.host_total <= cap:
                    fits.append((count_parameters(cfg), name, split, plan.host_total))
                    break
        if fits:
            params, name, split, total = max(fits)
            print(f"{fmt:>16}: largest preset {name} ({params / 1e9:.2f}B parameters), host plan "
                  f"{total / GiB:.1f} GiB of {args.largest_for_gib:g} ({'split' if split else 'whole'} updates)")
        else:
            print(f"{fmt:>16}: no preset fits {args.largest_for_gib:g} GiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="MASTER/MOMENTS,... (the first is the baseline)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dataset", default="stdlib")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2", help="each format trains once per seed (data order, init)")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # one child's
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--every", type=int, default=20, help="print the curves every this many steps")
    ap.add_argument("--largest-for-gib", type=float, help="print the largest preset per format for this host RAM")
    ap.add_argument("--json-out")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    if args.largest_for_gib:
        largest(args, formats)
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s]
    results = []
    print(f"{args.model} on {args.device}, {args.steps} steps of {args.batch_size} x {args.seq_len} "
          f"({args.dataset}), lr {args.lr:g}, seeds {args.seeds}; baseline {formats[0]}")
    print(f"{'format':>16} {'seed':>4} {'bytes/param':>11} {'final loss':>10} {'vs base':>8} {'max curve gap':>13} "
          f"{'tok/s':>8}", flush=True)
    for seed in seeds:
        passed = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (
            "model", "dataset", "steps", "batch_size", "seq_len", "lr", "warmup_steps", "device")] + [f"--seed={seed}"]
        base = None
        for fmt in formats:
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, *passed, "--one", fmt], stdout=subprocess.PIPE,
                                  text=True)
            lines = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{fmt}: failed (exit {proc.returncode})", flush=True)
                return 1
            r = lines[0] | {"seed": seed, "wall_s": round(time.perf_counter() - started, 1)}
            base = base or r
            final, base_final = statistics.fmean(r["losses"][-10:]), statistics.fmean(base["losses"][-10:])
            gap = max(abs(a - b) / b for a, b in zip(smoothed(r["losses"]), smoothed(base["losses"])))
            r.update(final_loss=round(final, 4), final_vs_base=round(final / base_final, 4),
                     max_curve_gap=round(gap, 4))
            results.append(r)
            print(f"{fmt:>16} {seed:>4} {r['bytes_per_param']:>11.2f} {final:>10.4f} {final / base_final:>8.4f} "
                  f"{gap:>13.2%} {r['tokens_per_s']:>8,}", flush=True)
    print(f"mean over seeds {args.seeds}: final loss / baseline's")
    for fmt in formats:
        ratios = [r["final_vs_base"] for r in results if r["format"] == fmt]
        print(f"{fmt:>16}: {statistics.fmean(ratios):.4f} (from {min(ratios):.4f} to {max(ratios):.4f})")
    first = [r for r in results if r["seed"] == seeds[0]]
    print(f"loss every {args.every} steps, seed {seeds[0]} (smoothed over {SMOOTH}):")
    print(f"{'step':>6} " + " ".join(f"{r['format']:>16}" for r in first))
    curves = [smoothed(r["losses"]) for r in first]
    for step in range(args.every, args.steps + 1, args.every):
        print(f"{step:>6} " + " ".join(f"{c[step - 1]:>16.4f}" for c in curves))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
