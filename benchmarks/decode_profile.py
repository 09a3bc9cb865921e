"""Where a decode step's time goes: the host's side (cProfile) or the device's (torch profiler).

    python benchmarks/decode_profile.py [--model random:llama3-8b] [--batch 256] [--steps 30]
    python benchmarks/decode_profile.py --device-kernels [--batch 256] [--steps 10]

Submits ``--batch`` random 1024-token prompts, steps until every one has its first token, then
profiles ``--steps`` pure decode steps and prints the mean step time (profiler included) and the
functions by own time. On CUDA the time spent in ``synchronize`` (``SampledTokens.wait``) or
``tolist`` is the host waiting for the device; the rest is host work, which overlapped steps
(``engine/overlap.py``) run while the device computes. Without CUDA it profiles ``random:llama-test`` on the CPU.

``--device-kernels`` instead times the same steps with CUDA graphs (the served figure) and splits
them into the host's wait for the device's tokens and its own work (``decode_host_split``), then runs
them eagerly under the torch profiler and prints the device time per step of each kernel family
(the weight matmuls, decode attention, the K/V write, norms and RoPE, sampling, the rest) and the
kernels a step launches (an eager step's host time grows with that count) as one JSON line, then
the top kernels: the graph's kernels are the eager ones, launched at once.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time

import torch
from serving_gpu import make_engine, random_prompts, sync

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
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("random:llama3-8b" if device.type == "cuda" else "random:llama-test")
    loaded = load_model(model, device=device)
    kv_gib = args.kv_gib if device.type == "cuda" else 1.0
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
    engine = decoding_engine(loaded, device, args.batch, args.steps, False, kv_gib)
    start = time.perf_counter()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    sync(device)
    print(f"# {model}, batch {args.batch}: {(time.perf_counter() - start) / args.steps * 1e3:.1f} ms per decode "
          f"step under the profiler", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)


def decoding_engine(loaded, device: torch.device, batch: int, steps: int, eager: bool, kv_gib: float):
    """An engine with ``batch`` 1024-token prompts prefilled and a few decode steps behind it, room
    left for ``steps`` more profiled (and as many timed) steps."""
    engine = make_engine(loaded, device, batch, 2048, eager, kv_gib)
    # Prompts are prefilled a few per step, so the first have tens of tokens before the last has one:
    # no sequence may finish inside a measured window, or the batch shrinks under it.
    params = SamplingParams(max_tokens=2048 - 1024 - 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, 1024, loaded.config.vocab_size, 5)):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(device)
    return engine


def timed_steps(engine, device: torch.device, steps: int) -> float:
    rows = len(engine.scheduler.running)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    if len(engine.scheduler.running) != rows:
        raise RuntimeError(f"the batch changed from {rows} to {len(engine.scheduler.running)} rows while measured")
    return (time.perf_counter() - start) / steps * 1e3


def host_split(engine, device: torch.device, steps: int) -> dict[str, float]:
    """Per step with graphs: the host's time waiting for the device's tokens (``SampledTokens.wait``)
    and the rest of the step, the host's own work. With overlapped steps a step whose wait is near
    zero was paced by the host: the device finished before the host asked."""
    waited = [0.0]
    plain_wait = SampledTokens.wait

    def timed_wait(tokens: SampledTokens) -> list[int]:
        start = time.perf_counter()
        try:
            return plain_wait(tokens)
        finally:
            waited[0] += time.perf_counter() - start

    SampledTokens.wait = timed_wait
    try:
        step_ms = timed_steps(engine, device, steps)
    finally:
        SampledTokens.wait = plain_wait
    wait_ms = waited[0] / steps * 1e3
    return {"step_ms": round(step_ms, 3), "host_wait_ms": round(wait_ms, 3),
            "host_work_ms": round(step_ms - wait_ms, 3)}


# Kernel families by name (cuBLAS/CUTLASS names vary by version: gemm, nvjet, sm90_xmma, cutlass).
FAMILIES = (
    ("decode_attention", ("_decode_partial", "_decode_reduce")),
    ("prefill_attention", ("_paged_attention", "_prefill", "flash")),
    ("matmuls", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "matmul")),
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


def print_kernel_families(engine, device: torch.device, steps: int, model: str, batch: int, step_ms: float,
                          eager_ms: float) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
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
    families: dict[str, float] = {}
    for name, us in kernels.items():
        families[family_of(name)] = families.get(family_of(name), 0.0) + us / steps / 1e3
    device_ms = sum(families.values())
    print(json.dumps({"figure": "decode_kernels", "model": model, "batch": batch, "step_ms_graphs": round(step_ms, 3),
                      "step_ms_eager": round(eager_ms, 3), "device_ms_per_step": round(device_ms, 3),
                      "kernels_per_step": round(launches / steps, 1),
                      "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])}}),
          flush=True)
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{us / steps / 1e3:8.3f} ms/step  {family_of(name):18s} {name[:110]}")


if __name__ == "__main__":
    main()
