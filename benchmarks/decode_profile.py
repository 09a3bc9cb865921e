"""Where a decode (or prefill) step's time goes: the host's side (cProfile) or the device's (torch profiler).

    python benchmarks/decode_profile.py [--model random:llama3-8b] [--batch 256] [--steps 30] [--eager]
    python benchmarks/decode_profile.py --device-kernels [--batch 256] [--steps 10]
    python benchmarks/decode_profile.py --prefill-kernels [--batch 64] [--chunk 8192]

Submits ``--batch`` random 1024-token prompts, steps until every one has its first token, then
profiles ``--steps`` pure decode steps and prints the mean step time (profiler included) and the
functions by own time. On CUDA the time spent in ``synchronize`` (``SampledTokens.wait``) or
``tolist`` is the host waiting for the device; the rest is host work, which overlapped steps
(``engine/overlap.py``) run while the device computes. ``--eager`` profiles the engine without CUDA
graphs, where the host launches every kernel itself and sets the pace at small batch. Without CUDA it
profiles ``random:llama-test`` on the CPU.

``--device-kernels`` instead times the same steps with CUDA graphs (the served figure) and splits
them into the host's wait for the device's tokens and its own work (``decode_host_split``), then runs
them eagerly under the torch profiler and prints the device time per step of each kernel family
(the weight matmuls, decode attention, the K/V write, norms and RoPE, sampling, the rest) and the
kernels a step launches (an eager step's host time grows with that count) as one JSON line, then
the top kernels: the graph's kernels are the eager ones, launched at once.

``--prefill-kernels`` does the same for prefill steps: ``--batch`` 1024-token prompts submitted at
once into ``--chunk``-token steps, timed to the last first token, then again under the profiler; it
prints the kernel families per step and the rate the weight matmuls and the prefill attention
reach (their FLOPs from ``serving_gpu.prefill_flops`` over their kernels' device time) against the
dense matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import time
from collections.abc import Iterator

import torch
from serving_gpu import make_engine, matmul_tflops, prefill_flops, random_prompts, sync

from tandem.shared.engine.model_runner import SampledTokens
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-gib", type=float, default=40.0, help="the KV pool (256 x 1,100 tokens of 8B: 34 GiB)")
    parser.add_argument("--device-kernels", action="store_true",
                        help="time the step with graphs, then profile its kernels eagerly (torch profiler)")
    parser.add_argument("--prefill-kernels", action="store_true",
                        help="profile prefill steps of --batch 1024-token prompts instead")
    parser.add_argument("--chunk", type=int, default=8192, help="the prefill steps' token budget")
    parser.add_argument("--eager", action="store_true", help="profile the host without CUDA graphs")
    parser.add_argument("--pstats-out", help="also write the host profile here (pstats format)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("random:llama3-8b" if device.type == "cuda" else "random:llama-test")
    loaded = load_model(model, device=device)
    kv_gib = args.kv_gib if device.type == "cuda" else 1.0
    if args.prefill_kernels:
        profile_prefill(loaded, device, model, args.batch, args.chunk, kv_gib)
        return
    if args.device_kernels:
        graphed = decoding_engine(loaded, device, args.batch, args.steps, False, kv_gib)
        step_ms = timed_steps(graphed, device, args.steps)
        print(json.dumps({"figure": "decode_host_split", "model": model, "batch": args.batch,
                          **host_split(graphed, device, args.steps)}), flush=True)
        del graphed
        gc.collect()  # the engine's parts refer to each other: its pool is freed only by the collector
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eager = decoding_engine(loaded, device, args.batch, args.steps, True, kv_gib)
        eager_ms = timed_steps(eager, device, args.steps)
        print_kernel_families(eager, device, args.steps, model, args.batch, step_ms, eager_ms)
        return
    engine = decoding_engine(loaded, device, args.batch, args.steps, args.eager, kv_gib)
    start = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    sync(device)
    print(f"# {model}, batch {args.batch}{', eager' if args.eager else ''}: "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.1f} ms per decode step under the profiler", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    if args.pstats_out:
        profile.dump_stats(args.pstats_out)


def decoding_engine(loaded, device: torch.device, batch: int, steps: int, eager: bool, kv_gib: float):
    """An engine with ``batch`` 1024-token prompts prefilled and a few decode steps behind it, room
    left for ``steps`` more profiled (and as many timed) steps."""
    engine = make_engine(loaded, device, batch, 2048, eager, kv_gib)
    # Prompts are prefilled a few per step, so the first have tens of tokens before the last has one:
    # no sequence may finish inside a measured window, or the batch shrinks under it.
    params = SamplingParams(max_tokens=2048 - 1024 - 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, 1024, loaded.config.vocab_size, 5)):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while any(seq.num_output_tokens == 0 for seq in engine.sequences()):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(device)
    return engine


def timed_steps(engine, device: torch.device, steps: int) -> float:
    rows = engine.stats()["running"]
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    if engine.stats()["running"] != rows:
        raise RuntimeError(f"the batch changed from {rows} to {engine.stats()['running']} rows while measured")
    return (time.perf_counter() - start) / steps * 1e3


@contextlib.contextmanager
def timed_calls(targets: dict[str, tuple[object, str]]) -> Iterator[dict[str, float]]:
    """Seconds spent inside each named ``(owner, attribute)`` callable while inside, summed into the
    yielded dict by name (nested phases each count their own whole time)."""
    spent = dict.fromkeys(targets, 0.0)
    originals = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}

    def timed(name: str, plain):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    for name, (owner, attr) in targets.items():
        setattr(owner, attr, timed(name, originals[name]))
    try:
        yield spent
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, originals[name])


def host_split(engine, device: torch.device, steps: int) -> dict[str, float]:
    """Per step with graphs: the host's time waiting for the device's tokens (``SampledTokens.wait``)
    and the rest of the step, the host's own work. With overlapped steps a step whose wait is near
    zero was paced by the host: the device finished before the host asked."""
    with timed_calls({"wait": (SampledTokens, "wait")}) as spent:
        step_ms = timed_steps(engine, device, steps)
    wait_ms = spent["wait"] / steps * 1e3
    return {"step_ms": round(step_ms, 3), "host_wait_ms": round(wait_ms, 3),
            "host_work_ms": round(step_ms - wait_ms, 3)}


# Kernel families by name (cuBLAS/CUTLASS names vary by version: gemm, nvjet, sm90_xmma, cutlass).
FAMILIES = (
    ("decode_attention", ("_decode_partial", "_decode_reduce")),
    ("prefill_attention", ("_paged_attention", "_prefill", "flash")),
    ("matmuls", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "matmul", "addmm", "aten::mm")),
    ("kv_write", ("index_put", "scatter", "_write_kv")),
    ("norms_rope_act", ("rms", "norm", "rope", "silu", "mul", "pow", "rsqrt", "mean", "add", "cat", "neg")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "gumbel", "exponential", "max", "sampl")),
    ("copies", ("copy", "memcpy", "memset", "fill")),
)


def family_of(name: str) -> str:
    lowered = name.lower()
    for family, needles in FAMILIES:
        if any(needle in lowered for needle in needles):
            return family
    return "other"


def kernel_times(run, device: torch.device) -> tuple[dict[str, float], int]:
    """Device microseconds by kernel name of what ``run()`` launches (on CPU its ops' own CPU time),
    and the number of launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    kernels: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        # torch 2.11 and later name it device time; earlier ones cuda time.
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if device.type != "cuda":
            us = event.self_cpu_time_total
        if us > 0 and (device.type != "cuda" or event.device_type.name == "CUDA"):
            kernels[event.key] = kernels.get(event.key, 0.0) + us
            launches += event.count
    return kernels, launches


def families_ms(kernels: dict[str, float], steps: int) -> dict[str, float]:
    families: dict[str, float] = {}
    for name, us in kernels.items():
        families[family_of(name)] = families.get(family_of(name), 0.0) + us / steps / 1e3
    return families


def print_top_kernels(kernels: dict[str, float], steps: int) -> None:
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{us / steps / 1e3:8.3f} ms/step  {family_of(name):18s} {name[:110]}")


def print_kernel_families(engine, device: torch.device, steps: int, model: str, batch: int, step_ms: float,
                          eager_ms: float) -> None:
    def run() -> None:
        for _ in range(steps):
            engine.step()

    kernels, launches = kernel_times(run, device)
    families = families_ms(kernels, steps)
    device_ms = sum(families.values())
    print(json.dumps({"figure": "decode_kernels", "model": model, "batch": batch, "step_ms_graphs": round(step_ms, 3),
                      "step_ms_eager": round(eager_ms, 3), "device_ms_per_step": round(device_ms, 3),
                      "kernels_per_step": round(launches / steps, 1),
                      "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])}}),
          flush=True)
    print_top_kernels(kernels, steps)


def profile_prefill(loaded, device: torch.device, model: str, prompts: int, chunk: int, kv_gib: float) -> None:
    """Prefill ``prompts`` 1024-token prompts in ``chunk``-token steps: timed, then profiled."""
    length = 1024
    peak = matmul_tflops(device) if device.type == "cuda" else None
    engine = make_engine(loaded, device, prompts, 2048, False, kv_gib, max_num_batched_tokens=chunk)
    vocab = loaded.config.vocab_size

    def prefill_all(seed: int) -> int:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(random_prompts(prompts, length, vocab, seed)):
            engine.add_request(EngineRequest(f"p{seed}-{i}", prompt, params))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return steps

    prefill_all(1)  # compiles the kernels for these shapes
    sync(device)
    start = time.perf_counter()
    # The host's phases between two steps' waits, when the device may have nothing queued.
    phases = {"wait": (SampledTokens, "wait"), "schedule": (engine.scheduler, "schedule"),
              "prepare": (engine.runner, "prepare"), "launch": (engine.runner, "launch"),
              "postprocess": (engine, "_postprocess"), "hash_blocks": (engine.scheduler.block_manager,
                                                                      "hash_full_blocks")}
    with timed_calls(phases) as spent:
        steps = prefill_all(2)
    sync(device)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    wait_ms = spent["wait"] / steps * 1e3
    kernels, launches = kernel_times(lambda: prefill_all(3), device)
    families = families_ms(kernels, steps)
    flops = prefill_flops(loaded.config, prompts, length)
    record = {"figure": "prefill_kernels", "model": model, "prompts": prompts, "chunk_tokens": chunk,
              "steps": steps, "step_ms": round(step_ms, 3), "host_wait_ms": round(wait_ms, 3),
              "host_work_ms": round(step_ms - wait_ms, 3),
              "host_phases_ms": {name: round(sec / steps * 1e3, 3) for name, sec in spent.items()},
              "device_ms_per_step": round(sum(families.values()), 3),
              "kernels_per_step": round(launches / steps, 1),
              "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])}}
    for family, part in (("matmuls", "linear"), ("prefill_attention", "attention")):
        if families.get(family):
            tflops = flops[part] / steps / (families[family] * 1e-3) / 1e12
            record[f"{family}_tflops"] = round(tflops, 1)
            if peak:
                record[f"{family}_of_peak"] = round(tflops / peak, 3)
    if peak:
        record["matmul_peak_tflops"] = round(peak, 1)
        record["step_of_peak"] = round(flops["total"] / steps / (step_ms * 1e-3) / 1e12 / peak, 3)
    print(json.dumps(record), flush=True)
    print_top_kernels(kernels, steps)
    host = cProfile.Profile()
    host.enable()
    prefill_all(4)
    host.disable()
    print("# the host's side of the same steps, by own time:")
    pstats.Stats(host).sort_stats("tottime").print_stats(15)

if __name__ == "__main__":
    main()
