"""Preemption by swap versus by recompute under memory pressure: the same workload, one run.

    python benchmarks/swap_vs_recompute.py [--model random:llama3-8b] [--requests 64] [--prompt-len 1024]
                                           [--output-len 512] [--pool-fraction 0.4] [--prefix-caching]

Submits ``--requests`` random prompts of ``--prompt-len`` tokens at once, greedy, ``--output-len``
tokens each, to an in-process engine whose KV pool holds only ``--pool-fraction`` of what the batch
needs at its end, so sequences are preempted over and over: once with ``preemption_mode="swap"``
(a swap space large enough for every victim), once with ``"recompute"``; then once more with
``"auto"`` (the cost rule choosing per victim). Prefix caching is off unless ``--prefix-caching``:
with it, a victim's full blocks stay cached either way and only its last block differs.

Prints one JSON line per mode (output tokens/s over the whole run, preemptions, swaps, recomputes,
swapped-then-recomputed fallbacks) and one comparing them: swap's throughput over recompute's, and
how many requests got the same tokens in both runs (all on CPU; on CUDA in bf16 a near-tie may
flip a greedy token once batches differ).

On CPU it runs the tiny model with small sizes (a smoke test); on CUDA ``random:llama3-8b`` in bf16.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from serving_gpu import emit, sync

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.kvcache.cache import kv_cache_bytes_per_block
from tandem.shared.kvcache.swap_space import GIB
from tandem.shared.model.loader import LoadedModel, load_model
from tandem.shared.protocol.serving import SamplingParams

BLOCK_SIZE = 16


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    low = 300 if vocab > 1000 else 0  # real vocabularies: clear of the special tokens at either end
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab - low, (n, length), generator=gen).tolist()


def engine_for(loaded: LoadedModel, device: torch.device, mode: str, args: argparse.Namespace) -> LLMEngine:
    """A pool of ``--pool-fraction`` of the batch's final blocks, and a swap space for the rest."""
    cfg = loaded.config
    per_seq = -(-(args.prompt_len + args.output_len) // BLOCK_SIZE)
    needed = args.requests * per_seq
    num_blocks = max(per_seq + 1, int(needed * args.pool_fraction))
    dtype = next(loaded.model.parameters()).dtype
    block_bytes = kv_cache_bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=args.requests,
                          max_num_batched_tokens=args.chunk, max_model_len=args.prompt_len + args.output_len + 1,
                          enable_prefix_caching=args.prefix_caching, preemption_mode=mode,
                          swap_space_gib=(needed + per_seq) * block_bytes / GIB)
    return LLMEngine(loaded.model, loaded.tokenizer, config, device)


def serve(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, device: torch.device) -> dict:
    """Submit every prompt at once and step to the end: output tokens/s and each request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    sync(device)
    wall = time.perf_counter() - start
    total = sum(map(len, tokens.values()))
    return {"output_tokens": total, "total_s": round(wall, 3), "output_tok_s": round(total / wall, 1),
            "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, tiny on CPU")
    parser.add_argument("--requests", type=int, default=None, help="default: 64 on CUDA, 12 on CPU")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 1024 on CUDA, 48 on CPU")
    parser.add_argument("--output-len", type=int, default=None, help="default: 512 on CUDA, 80 on CPU")
    parser.add_argument("--pool-fraction", type=float, default=0.4,
                        help="the pool's share of the blocks the whole batch needs at its end")
    parser.add_argument("--chunk", type=int, default=None, help="prefill tokens per step (default: 8192 on CUDA, "
                                                                 "256 on CPU)")
    parser.add_argument("--prefix-caching", action="store_true", help="keep prefix caching on")
    parser.add_argument("--modes", default="swap,recompute,auto")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    defaults = dict(requests=(64, 12), prompt_len=(1024, 48), output_len=(512, 80), chunk=(8192, 256))
    for name, (on_cuda, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    model = args.model or ("random:llama3-8b" if cuda else "tiny")
    loaded = load_model(model, device=device)
    print(f"# {model} on {device}: {args.requests} requests of {args.prompt_len} + {args.output_len} tokens, "
          f"pool {args.pool_fraction:.0%} of the batch's blocks", flush=True)
    prompts = prompts_for(args.requests, args.prompt_len, loaded.config.vocab_size, seed=0)
    records: list[dict] = []
    results: dict[str, dict] = {}
    for index, mode in enumerate(args.modes.split(",")):
        engine = engine_for(loaded, device, mode, args)
        # Warm-up: the first engine runs the whole workload once, so that every kernel shape is
        # compiled (Triton) before any run is timed; the others a short one.
        serve(engine, prompts if index == 0 else prompts[:2], args.output_len if index == 0 else 4, device)
        before = engine.stats()
        result = serve(engine, prompts, args.output_len, device)
        stats = engine.stats()
        results[mode] = result
        emit({"figure": mode, "model": model, "requests": args.requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "num_blocks": stats["num_blocks"], "swap_blocks": stats["swap_blocks"],
              **{k: v for k, v in result.items() if k != "tokens"},
              **{k: stats[k] - before[k] for k in ("preemptions", "swaps", "recomputes", "swap_fallbacks")}},
             records)
        del engine
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
    if "swap" in results and "recompute" in results:
        swap, recompute = results["swap"], results["recompute"]
        same = sum(swap["tokens"][r] == recompute["tokens"][r] for r in swap["tokens"])
        emit({"figure": "swap_vs_recompute", "swap_over_recompute": round(swap["output_tok_s"] /
                                                                         recompute["output_tok_s"], 3),
              "same_tokens": f"{same}/{len(swap['tokens'])}"}, records)


if __name__ == "__main__":
    main()
