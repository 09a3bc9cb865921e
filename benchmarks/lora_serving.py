"""What serving LoRA adapters costs the engine, in one run: decode steps and prefill with rows of many
adapters against the same rows with none.

    python benchmarks/lora_serving.py [--model random:llama3-8b] [--batch 32] [--adapters 8] [--rank 16]
                                      [--max-tokens 128] [--prefill-prompts 8] [--prefill-len 1024]
                                      [--json-out FILE]

Three engines over one model, built in turn: without LoRA (``--max-loras 0``: the baseline), and with
``--adapters`` slots of ``--rank``, first with no request naming an adapter, then with the batch spread
over ``--adapters`` distinct adapters (every target projection, random weights). Figures:

* ``decode``: TPOT, the median wall time of an engine step while all ``--batch`` sequences decode
  (CUDA graphs and overlapped steps as in serving; prefill steps and the tail left out), and the
  ratios with adapters / baseline and without adapter rows / baseline (slots attached cost what?);
* ``prefill``: the wall time of prefilling ``--prefill-prompts`` prompts of ``--prefill-len`` tokens
  (each its own adapter, or none), the best of three, and the ratio;
* ``load``: reading one adapter from its PEFT directory and writing it into a slot.

On CUDA the model is ``random:llama3-8b`` in bf16; on CPU the tiny model with small sizes, so the script
itself is tested. Adapters are made in memory (the engine's reader is given them by name); one is also
saved to disk to time the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.lora.peft_format import (
    TARGETS,
    AdapterConfig,
    LoraWeights,
    load_adapter,
    projection_shapes,
    save_adapter,
)
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.adapters import AdapterRef
from tandem.shared.protocol.serving import SamplingParams

WARMUP_STEPS = 3


def emit(record: dict, sink: list[dict]) -> None:
    sink.append(record)
    print(json.dumps(record), flush=True)


def progress(message: str) -> None:
    print(f"[lora_serving] {message}", file=sys.stderr, flush=True)


def random_adapter(config, rank: int, seed: int, dtype: torch.dtype) -> LoraWeights:  # noqa: ANN001
    generator = torch.Generator().manual_seed(seed)
    a, b = {}, {}
    for layer in range(config.num_layers):
        for target, (out_features, in_features) in projection_shapes(config).items():
            a[(layer, target)] = (torch.randn(rank, in_features, generator=generator) * 0.01).to(dtype)
            b[(layer, target)] = (torch.randn(out_features, rank, generator=generator) * 0.01).to(dtype)
    return LoraWeights(AdapterConfig(rank, 2.0 * rank, TARGETS), a, b)


def decode_steps(engine: LLMEngine, requests: list[EngineRequest]) -> list[float]:
    """Each step's wall time while every request runs (see structured_decoding.py's step_times)."""
    for request in requests:
        engine.add_request(request)
    times, full, ended = [], 0, False
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        ended = ended or any(out.finished for out in outputs)
        if engine.stats()["running"] == len(requests) and not ended:
            full += 1
            if full > WARMUP_STEPS:
                times.append(elapsed)
    return times


def prefill_time(engine: LLMEngine, requests: list[EngineRequest]) -> float:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def build(loaded, config: EngineConfig, device: torch.device, adapters: dict[str, LoraWeights]) -> LLMEngine:  # noqa: ANN001
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, device)
    if engine.adapters is not None:
        engine.adapters._read = lambda path, cfg, rank: adapters[path]  # in memory: the figure is compute
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, tiny on CPU")
    parser.add_argument("--batch", type=int, default=None, help="decoding sequences (default: 32 on CUDA, 4 on CPU)")
    parser.add_argument("--adapters", type=int, default=None, help="distinct adapters (default: 8 on CUDA, 2 on CPU)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 128 on CUDA, 24 on CPU")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--prefill-prompts", type=int, default=None, help="default: 8 on CUDA, 2 on CPU")
    parser.add_argument("--prefill-len", type=int, default=None, help="default: 1024 on CUDA, 64 on CPU")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = args.model or ("random:llama3-8b" if cuda else "tiny")
    batch = args.batch or (32 if cuda else 4)
    count = args.adapters or (8 if cuda else 2)
    max_tokens = args.max_tokens or (128 if cuda else 24)
    prefill_prompts = args.prefill_prompts or (8 if cuda else 2)
    prefill_len = args.prefill_len or (1024 if cuda else 64)
    progress(f"loading {model} on {device}")
    loaded = load_model(model, device=device)
    dtype = next(loaded.model.parameters()).dtype
    progress(f"making {count} rank-{args.rank} adapters")
    adapters = {f"mem:{i}": random_adapter(loaded.config, args.rank, i, dtype) for i in range(count)}
    refs = [AdapterRef(name=f"a{i}", version="1", path=f"mem:{i}") for i in range(count)]
    longest = max(args.prompt_len + max_tokens, prefill_len + 1) + 16
    blocks = (batch * -(-(args.prompt_len + max_tokens) // 16)) + prefill_prompts * -(-prefill_len // 16) + 32
    base = EngineConfig(block_size=16, num_blocks=blocks, max_num_seqs=max(batch, prefill_prompts),
                        max_num_batched_tokens=max(8192, prefill_len), max_model_len=longest,
                        enable_prefix_caching=False)
    records: list[dict] = []
    emit({"figure": "setup", "model": model, "device": torch.cuda.get_device_name() if cuda else "cpu",
          "batch": batch, "adapters": count, "rank": args.rank, "max_tokens": max_tokens}, records)
    vocab = min(loaded.config.vocab_size, 256)
    prompts = [[(7 * i + 13 * j) % vocab for j in range(args.prompt_len)] for i in range(batch)]
    long_prompts = [[(5 * i + 3 * j) % vocab for j in range(prefill_len)] for i in range(prefill_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    variants = {"baseline": (0, False), "slots_no_adapter_rows": (count, False), "adapters": (count, True)}
    tpot, prefill = {}, {}
    for name, (slots, use) in variants.items():
        config = EngineConfig(**{**base.__dict__, "max_loras": slots, "max_lora_rank": args.rank}) if slots else base
        progress(f"{name}: building the engine")
        engine = build(loaded, config, device, adapters)
        pick = (lambda i: refs[i % count]) if use else (lambda i: None)
        progress(f"{name}: decode, batch {batch}")
        times = decode_steps(engine, [EngineRequest(f"{name}-{i}", p, params, adapter=pick(i))
                                      for i, p in enumerate(prompts)])
        tpot[name] = statistics.median(times) * 1e3 if times else float("nan")
        progress(f"{name}: prefill, {prefill_prompts} x {prefill_len}")
        prefill[name] = min(prefill_time(engine, [EngineRequest(f"{name}-p{k}-{i}", p, one, adapter=pick(i))
                                                  for i, p in enumerate(long_prompts)]) for k in range(3)) * 1e3
        del engine
        if cuda:
            torch.cuda.empty_cache()
    emit({"figure": "decode", "batch": batch, "tpot_ms": {k: round(v, 3) for k, v in tpot.items()},
          "adapters_vs_baseline": round(tpot["adapters"] / tpot["baseline"], 3),
          "slots_vs_baseline": round(tpot["slots_no_adapter_rows"] / tpot["baseline"], 3)}, records)
    emit({"figure": "prefill", "prompts": prefill_prompts, "prompt_len": prefill_len,
          "ms": {k: round(v, 2) for k, v in prefill.items()},
          "adapters_vs_baseline": round(prefill["adapters"] / prefill["baseline"], 3)}, records)
    folder = Path(tempfile.mkdtemp()) / "adapter"
    save_adapter(folder, adapters["mem:0"])
    start = time.perf_counter()
    weights = load_adapter(folder, loaded.config, args.rank)
    read_s = time.perf_counter() - start
    config = EngineConfig(**{**base.__dict__, "max_loras": 1, "max_lora_rank": args.rank, "num_blocks": 64})
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, device)
    start = time.perf_counter()
    engine.adapters.slots.write(0, weights)
    if cuda:
        torch.cuda.synchronize()
    emit({"figure": "load", "adapter_mib": round(weights.nbytes() / 2**20, 1), "read_ms": round(read_s * 1e3, 1),
          "slot_write_ms": round((time.perf_counter() - start) * 1e3, 1)}, records)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
