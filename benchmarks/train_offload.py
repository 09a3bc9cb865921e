"""Benchmark of the streaming trainer: tokens/s, model TFLOP/s, hidden transfer time, peak GPU memory.

    python benchmarks/train_offload.py                          # CUDA: 3b, probe (7b), long (1b @ 131k), adam
    python benchmarks/train_offload.py --runs 3b --json-out r.json
    python benchmarks/train_offload.py --device cpu             # a tiny config, for CI
    python benchmarks/train_offload.py --runs 3b:0/12 --peer    # and DeepSpeed ZeRO-3 offload, same run

Runs (each in its own process, so host RAM is returned between them):
- ``3b``: the 3B preset, batch 8 x 2048, bf16 compute, GPU memory capped at 16 GiB;
- ``probe``: the 7B preset (6.74B parameters, fp32 masters and moments) under the same 16 GiB cap;
- ``long``: the 1B preset at sequence 131,072, GPU memory capped at 32 GiB; ``long-1b-524k`` and
  ``long-3b-262k``: the 1B preset at 524,288 and the 3B at 262,144 under the same cap, one step each
  (attention staged, functional.layer_backward), ``+atomics`` unless a variant is named (the
  deterministic flash backward does not fit the cap there);
- ``adam``: the host AdamW's throughput on one 3B layer, and the host's copy bandwidth;
- ``learn``: the 3B preset as ``3b`` but on the Python stdlib's text for 24 steps, its loss curve
  printed (``learn-tiny``: the tiny model on the CPU);
- ``largest``: the 13B preset (13.0B parameters) with bf16 masters that are the working copy and int8
  Adam moments (``--master-weights bf16-sr --adam-moments int8``: 6 bytes a parameter of host state,
  docs/training.md), batch 8 x 2048 under the 16 GiB cap, whole host updates; its host RSS peak is the
  row's ``peak_host_rss_GiB``; no bound is printed for it (the bound models the fp32 state's passes);
  ``largest-tiny``: the same formats on the tiny config;
- ``tiny``: a tiny config, for CI;
- ``peer`` (``--peer``): after tandem's runs, DeepSpeed ZeRO-3 with parameters and optimizer offloaded
  to the CPU on the ``3b`` run's model, batch, sequence and warm-up (``benchmarks/peers/zero3_offload.py``,
  in its own process), and each run of that shape's tokens/s over it; where the peer cannot run (no
  deepspeed, no CUDA) its row carries the one-line reason and tandem's rows stand.
A run named ``NAME:v1/v2`` (e.g. ``3b:auto/0/13``) is measured once per variant, on one host state.
A variant is ``auto`` (the placement plan.py chooses from the cap and the rates measured in this run;
a bare ``NAME`` is ``NAME:auto``) or ``K[rR][sS]``: the GPU does the AdamW of the first K layers, R of
them with their fp32 state resident on the GPU, the others streamed from host RAM with S GPU buffer
sets (default 2), and the CPU the rest (shared/train/device_update.py): ``0`` is all on the CPU,
``13`` the earlier 13 streamed layers, ``6r6`` six resident ones. Either may end in ``+atomics``: the
step without deterministic kernels (shared/train/determinism.py), so ``3b:auto/auto+atomics`` prints
what determinism costs.

Every run first measures, in its own process, host memory read, write and copy on the host AdamW's
threads and pinned PCIe copies host->device, device->host and both at once (plan.measure_rates),
then prints for each variant the step's lower bound (plan.step_bound: the bytes the step moves
through host memory and each PCIe direction at those rates, the GPU compute measured in the step's
trace, and the exact-clipping chain) and the measured step over it.
Model TFLOP/s = (6N + 6·L·d·seq) · tokens / step time (DESIGN.md; recompute not counted). The hidden
fraction is the share of host<->device transfer time that runs under compute (CUDA events).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEER = Path(__file__).resolve().parent / "peers" / "zero3_offload.py"
PEER_TIMEOUT_S = 1800  # a 7B-sized peer's init and CPU Adam build included

RUNS = {
    "3b": dict(model="3b", batch_size=8, seq_len=2048, gpu_memory_gib=16, warmup=2, measure=4),
    "probe": dict(model="7b", batch_size=4, seq_len=2048, gpu_memory_gib=16, warmup=1, measure=2),
    "long": dict(model="1b", batch_size=1, seq_len=131072, gpu_memory_gib=32, warmup=1, measure=1),
    # the long contexts: one step each (minutes), eager blocks so no compile lands in it, the
    # atomics kernels by default (deterministic flash attention needs 16-20 GiB more there: plan.flash_splits)
    "long-1b-524k": dict(model="1b", batch_size=1, seq_len=524288, gpu_memory_gib=32, compile_layers=False,
                         warmup=0, measure=1, variants="auto+atomics"),
    "long-3b-262k": dict(model="3b", batch_size=1, seq_len=262144, gpu_memory_gib=32, compile_layers=False,
                         warmup=0, measure=1, variants="auto+atomics"),
    "tiny": dict(model="tiny", batch_size=4, seq_len=128, gpu_memory_gib=None, warmup=1, measure=2),
    # the largest model: bf16 masters (the working copy) and int8 moments, 6 bytes a parameter of host state
    "largest": dict(model="13b", master_weights="bf16-sr", adam_moments="int8", split_update=False, batch_size=8,
                    seq_len=2048, gpu_memory_gib=16, warmup=1, measure=2),
    "largest-tiny": dict(model="tiny", master_weights="bf16-sr", adam_moments="int8", batch_size=4, seq_len=128,
                         gpu_memory_gib=None, warmup=1, measure=2),
    "learn": dict(model="3b", dataset="stdlib", lr=3e-4, batch_size=8, seq_len=2048, gpu_memory_gib=16, warmup=0,
                  measure=24),
    "learn-tiny": dict(model="tiny", dataset="stdlib", lr=3e-3, batch_size=8, seq_len=128, gpu_memory_gib=None,
                       warmup=0, measure=30),
}
ATOMICS = "+atomics"


def parse_variant(token: str) -> tuple[tuple[int, int, int] | None, bool]:
    """``"auto"`` -> (None, True); ``"K[rR][sS]"`` -> ((K, R, S), True); a ``+atomics`` suffix makes
    the second item (deterministic kernels) False."""
    import re

    deterministic = not token.endswith(ATOMICS)
    token = token.removesuffix(ATOMICS)
    if token in ("", "auto"):
        return None, deterministic
    match = re.fullmatch(r"(\d+)(?:r(\d+))?(?:s(\d+))?", token)
    if not match:
        raise SystemExit(f"bad variant {token!r}: auto or K[rR][sS], e.g. 13, 13s4, 6r6, each with an optional "
                         f"{ATOMICS}")
    k, r, sets = int(match[1]), int(match[2] or 0), int(match[3] or 2)
    return (max(k, r), r, sets), deterministic


def variant_label(base: str, placement, auto: bool, deterministic: bool) -> str:  # noqa: ANN001 - plan.Placement
    suffix = "" if deterministic else ATOMICS
    if auto:
        return f"{base}:auto{suffix}"
    label = f"{base}:{placement.device_update}" + (f"r{placement.resident}" if placement.resident else "")
    return label + (f"s{placement.sets}" if placement.sets != 2 and placement.streamed else "") + suffix


def run_one(name: str, device: str, steps: int | None) -> list[dict]:
    """One run, once per variant (module docstring) on one host state; one RESULT line each."""
    import gc

    import torch

    from tandem.shared.protocol.training import TrainJob
    from tandem.shared.train.loop import TrainLoop, gpu_cap_bytes
    from tandem.shared.train.offload_step import OffloadStep
    from tandem.shared.train.optimizer import HostAdamW
    from tandem.shared.train.plan import Placement, choose_placement, measure_rates, step_bound

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    base, _, ks = name.partition(":")
    spec = dict(RUNS[base])
    variants = [parse_variant(v) for v in (ks or spec.pop("variants", "auto")).split("/")]
    spec.pop("variants", None)
    warmup, measure = spec.pop("warmup"), spec.pop("measure")
    measure = steps or measure
    rates = measure_rates(torch.device(device))
    rates_row = {"host_read_GBps": round(rates.host_read / 1e9, 1), "host_write_GBps": round(rates.host_write / 1e9, 1),
                 "host_copy_GBps": round(rates.host_copy / 1e9, 1), "host_threads": rates.source,
                 "h2d_GBps": round(rates.h2d / 1e9, 1), "d2h_GBps": round(rates.d2h / 1e9, 1),
                 "both_GBps": round(rates.duplex / 1e9, 1), "host_with_dma_GBps": round(rates.dram / 1e9, 1),
                 "preview_with_dma_GBps": rates.preview_dram and round(rates.preview_dram / 1e9, 1),
                 "preview_Gparams_per_s": round(rates.preview / 1e9, 2),
                 "commit_Gparams_per_s": round(rates.commit / 1e9, 2),
                 "whole_Gparams_per_s": round(rates.whole / 1e9, 2)}
    print("RATES " + json.dumps(rates_row), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        first, first_deterministic = variants[0]
        explicit = dict(device_update_layers=first[0], device_resident_layers=first[1],
                        device_update_sets=first[2]) if first else {}
        job = TrainJob(**(dict(dataset="random", lr=1e-4) | spec), steps=warmup + measure, weight_decay=0.0,
                       grad_clip=1.0, device=device, output_dir=tmp, deterministic=first_deterministic, **explicit)
        t0 = time.perf_counter()
        runner = TrainLoop(job, name, Path(tmp), rates=rates)
        init_s = time.perf_counter() - t0
        for index, (variant, deterministic) in enumerate(variants):
            if index:  # same host state, fresh optimizer thread and engine
                runner.engine = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                if variant is None and runner.device.type != "cuda":
                    placement = runner.setup.placement  # the CPU's: it updates every layer itself
                elif variant is None:
                    placement, _ = choose_placement(runner.config, runner.state.work_dtype, job.batch_size, job.seq_len,
                                                    gpu_cap_bytes(runner.device, job.gpu_memory_gib), rates,
                                                    runner.optimizer.split, job.device_update_sets,
                                                    deterministic=deterministic)
                else:
                    placement = Placement(variant[1], variant[0], variant[2], "given")
                runner.placement = placement
                runner.start_step = int(runner.state.units[0].step)
                runner.job = job = job.model_copy(update={"steps": runner.start_step + warmup + measure,
                                                          "deterministic": deterministic})
                runner.optimizer = HostAdamW(runner.state, runner.lr_at, job.weight_decay, job.grad_clip,
                                             split=runner.optimizer.split, seed=job.seed)
                runner.engine = OffloadStep(runner.config, runner.state, runner.optimizer, runner.device,
                                                device_update_layers=placement.device_update,
                                                device_update_sets=placement.sets,
                                                device_resident_layers=placement.resident,
                                                compile_layers=runner.compile_layers, deterministic=deterministic)
            placement = runner.placement
            metrics, traces, starts = [], [], {}
            first_step = runner.start_step

            def on_step(m, metrics=metrics, starts=starts) -> None:  # noqa: ANN001
                metrics.append(m)
                # the step was just issued after the previous backward ended, so its host start is
                # its trace's origin on the GPU too: the dump puts every step on one clock with it
                starts[m.step] = runner.engine.trace.t0

            runner.run(on_step=on_step, trace_every_s=0, final_checkpoint=False,
                       on_trace=lambda step, ops, hidden, traces=traces: traces.append((step, ops, hidden)))
            result = summarize(runner, job, metrics, [t for t in traces if t[0] - first_step > warmup], warmup)
            label = variant_label(base, placement, variant is None, deterministic)
            compute = result["last_step_compute_s"]
            result = {"run": label, "dataset": job.dataset, "deterministic": deterministic,
                      "device_update_layers": placement.device_update,
                      "device_resident_layers": placement.resident, "device_update_sets": placement.sets,
                      "placement": placement.describe(runner.config.num_layers), "placement_reason": placement.reason,
                      "state_format": runner.state.format.describe(), **result,
                      "plan_peak_gpu_GiB": round(runner.setup.plan.gpu_peak / 2**30, 2) if index == 0 else None,
                      "rates": rates_row, "init_s": round(init_s, 1)}
            if runner.state.format.default:  # step_bound models the fp32 state's passes and bytes
                terms = step_bound(runner.config, job.batch_size, job.seq_len, placement, rates,
                                   runner.state.work_dtype.itemsize, runner.optimizer.split,
                                   compute_s=(compute["fwd"], compute["bwd"]) if compute["fwd"] else None)
                result |= {"bound_s": round(terms["bound"], 3),
                           "bound_binding": max((k for k in terms if k != "bound"), key=terms.get),
                           "bound_terms_s": {k: round(v, 3) for k, v in terms.items() if k != "bound"},
                           "over_bound": round(result["step_s_median"] / terms["bound"], 3)}
            if (dump := os.environ.get("TANDEM_TIMELINE_DIR")) and traces:
                origin = starts.get(traces[0][0], 0.0)
                steps = [{"step": step, "start_s": starts.get(step, origin) - origin,
                          "ops": [op.model_dump() for op in ops]} for step, ops, _ in traces]
                Path(dump, f"{label.replace(':', '_')}.json").write_text(json.dumps(steps))
            results.append(result)
            print("RESULT " + json.dumps(result), flush=True)
    return results


def summarize(runner, job, metrics, measured, warmup: int) -> dict:  # noqa: ANN001
    import resource

    import torch

    from tandem.shared.train.lanes import _union

    timed = metrics[warmup:]
    step_s = statistics.median(m.step_time_s for m in timed)
    tokens = job.batch_size * job.seq_len
    last_ops = measured[-1][1] if measured else []
    busy = {lane: sum(b - a for a, b in _union([(o.start_s, o.end_s) for o in last_ops if o.lane == lane]))
            for lane in ("compute", "h2d", "d2h", "optimizer")}
    cuda = runner.device.type == "cuda"
    # the host units' passes the next forward waits for: previews (split mode) or whole updates
    passes = [o for o in last_ops if o.lane == "optimizer" and o.end_s > o.start_s]
    pass_rate = (sum(o.bytes / 4 for o in passes) / sum(o.end_s - o.start_s for o in passes) / 1e9
                 if passes else None)  # an op's bytes are its fp32 master's: 4 per parameter
    return {
        "model": job.model, "params_B": round(runner.num_params / 1e9, 3), "device": str(runner.device),
        "batch": job.batch_size, "seq": job.seq_len, "gpu_cap_GiB": job.gpu_memory_gib,
        "step_s_median": round(step_s, 3), "tokens_per_s": round(tokens / step_s),
        "model_TFLOPs": round(runner.flops_per_token * tokens / step_s / 1e12, 1),
        "hidden_fraction": round(statistics.mean(t[2] for t in measured), 4) if measured else None,
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
        # the process's peak so far (all variants of this run): the peer prints the same figure
        "peak_host_rss_GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
        "host_state_GiB": round(runner.state.nbytes() / 2**30, 1),
        "last_step_busy_s": {k: round(v, 3) for k, v in busy.items()},
        "last_step_compute_s": {phase: round(sum(o.end_s - o.start_s for o in last_ops
                                                 if o.lane == "compute" and o.phase == phase), 3)
                                for phase in ("fwd", "bwd", "opt")},
        "last_step_span_s": {lane: [round(min(o.start_s for o in ops), 3), round(max(o.end_s for o in ops), 3)]
                             for lane in ("compute", "h2d", "d2h", "optimizer")
                             if (ops := [o for o in last_ops if o.lane == lane])},
        "host_pass": "preview" if runner.optimizer.split else "whole",
        "host_pass_in_step_Gparams_per_s": round(pass_rate, 2) if pass_rate else None,
        "step_times": [round(m.step_time_s, 3) for m in metrics],
        "losses": [round(m.loss, 3) for m in metrics], "torch": torch.__version__,
    }


def run_adam(device: str) -> dict:
    """Host AdamW on one layer of the 3B preset (bf16 gradients, as on CUDA) and plain copy bandwidth."""
    import torch

    from tandem.shared.train import optimizer as opt_mod
    from tandem.shared.train.host_state import HostState
    from tandem.shared.train.presets import preset_config

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    cfg = preset_config("3b" if device != "cpu" else "tiny").replace(num_layers=1)
    state = HostState.random(cfg, 0, torch.bfloat16, pin=False)
    unit = state.units[1]
    n = unit.master.numel()
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    copy_gbs = 3 * 2 * n * 4 / (time.perf_counter() - t) / 1e9
    out = {"run": "adam", "layer_params_M": round(n / 1e6, 1), "threads": torch.get_num_threads(),
           "copy_GBps": round(copy_gbs, 1)}
    def rate(fn) -> float:  # noqa: ANN001
        fn()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return round(3 * n / (time.perf_counter() - t) / 1e9, 2)

    torch_path = opt_mod.HostAdamW(state, lambda step: 1e-4, 0.1, 1.0, kernel=False)
    out["torch_Gparams_per_s"] = rate(lambda: torch_path.update_unit(unit, 1e-4, 0.5))
    kernel = opt_mod.HostAdamW(state, lambda step: 1e-4, 0.1, 1.0)
    if kernel.kernel is not None:
        out["kernel_threads"] = kernel.kernel.threads
        out["kernel_full_Gparams_per_s"] = rate(lambda: kernel.update_unit(unit, 1e-4, 0.5))
        out["kernel_preview_Gparams_per_s"] = rate(lambda: kernel.kernel_pass(unit, unit.grad, 1e-4, 0.5,
                                                                                   write_state=False, write_work=True))
        out["kernel_commit_Gparams_per_s"] = rate(lambda: kernel.kernel_pass(unit, unit.grad, 1e-4, 0.5,
                                                                                  write_state=True, write_work=False))
    return out


def run_peer(cmd: list[str]) -> tuple[dict | None, str]:
    """The peer's JSON line, or None and why it gave none, in one line (its last line of stderr: the
    peers exit with one line naming what is missing)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"{Path(cmd[1]).name} ran past {PEER_TIMEOUT_S} s"
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode == 0 and line is not None:
        return json.loads(line), ""
    last = next((ln.strip() for ln in reversed((proc.stderr or proc.stdout).splitlines()) if ln.strip()),
                "no output")
    return None, f"{Path(cmd[1]).name} exited {proc.returncode}: {last}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: the tiny config only)")
    ap.add_argument("--runs", default="", help="comma-separated subset of 3b,probe,long,adam,learn (default: "
                                               "3b,probe,long,adam)")
    ap.add_argument("--steps", type=int, help="measured steps per run (default: per run)")
    ap.add_argument("--json-out")
    ap.add_argument("--peer", nargs="?", const=str(PEER), metavar="SCRIPT",
                    help="after tandem's runs, run the DeepSpeed ZeRO-3 offload peer (default script: "
                         "benchmarks/peers/zero3_offload.py) on the 3b run's shape and print each run of that "
                         "shape's tokens/s over it")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.one == "adam":
            print("RESULT " + json.dumps(run_adam(args.device)), flush=True)
        else:
            run_one(args.one, args.device, args.steps)  # prints a RESULT line per variant
        return 0
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    names = [n for n in args.runs.split(",") if n] or (["3b", "probe", "long", "adam"] if device == "cuda"
                                                       else ["tiny", "adam"])
    results = []
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, "--device", device]
        cmd += ["--steps", str(args.steps)] if args.steps else []
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [json.loads(ln[7:]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            lines.append({"run": name, "error": (proc.stderr or proc.stdout)[-3000:]})
        for result in lines:
            result["wall_s"] = round(time.perf_counter() - t, 1)
            results.append(result)
            print(json.dumps(result), flush=True)
    if args.peer:
        spec = RUNS["3b"]
        peer, reason = run_peer([sys.executable, args.peer, "--preset", spec["model"], "--batch",
                                 str(spec["batch_size"]), "--seq", str(spec["seq_len"]), "--warmup",
                                 str(spec["warmup"]), "--steps", str(args.steps or spec["measure"])])
        if peer is None:
            results.append({"run": "peer", "error": reason})
        else:
            results.append({"run": "peer", **peer})
            for r in results:  # only runs of the peer's own shape: a long-context 3B row is another job
                if (r.get("model"), r.get("batch"), r.get("seq")) == ("3b", spec["batch_size"], spec["seq_len"]) \
                        and "tokens_per_s" in r:
                    r["peer_tokens_per_s"] = peer["tokens_per_s"]
                    r["over_peer"] = round(r["tokens_per_s"] / peer["tokens_per_s"], 3)
        print(json.dumps(results[-1]), flush=True)
    shown = set()
    for r in results:
        if "rates" in r and json.dumps(r["rates"]) not in shown:
            shown.add(json.dumps(r["rates"]))
            q = r["rates"]
            print(f" rates: host read {q['host_read_GBps']} GB/s, write {q['host_write_GBps']}, copy "
                  f"{q['host_copy_GBps']} ({q['host_threads']}); PCIe h2d {q['h2d_GBps']} GB/s, d2h {q['d2h_GBps']}, "
                  f"both at once {q['both_GBps']}; host memory with the CPU and both copy directions at it "
                  f"{q['host_with_dma_GBps']} GB/s (reads), {q.get('preview_with_dma_GBps') or '-'} GB/s (the "
                  f"preview pass); host AdamW preview {q['preview_Gparams_per_s']}, commit "
                  f"{q['commit_Gparams_per_s']}, whole {q['whole_Gparams_per_s']} G parameters/s")
        if "tokens_per_s" in r and r["run"] != "peer":
            print(f"{r['run']:>6}: {r['model']} ({r['params_B']}B) batch {r['batch']} x {r['seq']}: "
                  f"{r['tokens_per_s']:,} tok/s, {r['model_TFLOPs']} TFLOP/s, hidden {r['hidden_fraction']}, "
                  f"peak GPU {r['peak_gpu_GiB']} GiB (cap {r['gpu_cap_GiB']}), step {r['step_s_median']} s"
                  + (f", {r['over_peer']}x DeepSpeed" if "over_peer" in r else ""))
            print(f"        host state {r['host_state_GiB']} GiB ({r['state_format']}), host RSS peak "
                  f"{r['peak_host_rss_GiB']} GiB")
            if "bound_s" in r:
                terms = ", ".join(f"{k} {v}" for k, v in r["bound_terms_s"].items() if v)
                print(f"        placement: {r['placement']} ({r['placement_reason']})")
                print(f"        bound {r['bound_s']} s ({r['bound_binding']}; {terms}); step / bound "
                      f"{r['over_bound']}x" + (f"; DeepSpeed at the bound would be "
                                               f"{round(r['over_peer'] * r['over_bound'], 2)}x"
                                               if "over_peer" in r else ""))
            if r.get("host_pass_in_step_Gparams_per_s") and "rates" in r:
                name = r["host_pass"]
                print(f"        host AdamW {name} passes inside the step: {r['host_pass_in_step_Gparams_per_s']} G "
                      f"parameters/s (alone: {r['rates'][name + '_Gparams_per_s']}; the bound assumes the latter)")
            if r.get("dataset") != "random" and r.get("losses"):
                curve = " ".join(f"{loss:.2f}" for loss in r["losses"])
                print(f"        learning on {r['dataset']}: loss {r['losses'][0]:.2f} -> {r['losses'][-1]:.2f} in "
                      f"{len(r['losses'])} steps; per step: {curve}")
        elif r["run"] == "peer" and "error" in r:
            print(f"  peer: DeepSpeed ZeRO-3 offload did not run: {r['error']}")
        elif r["run"] == "peer":
            print(f"  peer: DeepSpeed ZeRO-3 offload ({r.get('optimizer')}), {r.get('preset')} batch {r.get('batch')} "
                  f"x {r.get('seq')}: {r['tokens_per_s']:,} tok/s, step {r['step_s_median']} s, peak GPU "
                  f"{r.get('peak_gpu_GiB')} GiB, peak host RSS {r.get('peak_host_rss_GiB')} GiB")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
