"""Peer of tandem's decode: Hugging Face transformers ``generate``, greedy, on the model tandem serves.

    python benchmarks/peers/hf_generate.py                                  # CUDA: random:llama3-8b, bf16, batch 1
    python benchmarks/peers/hf_generate.py --batches 1 32 --prompt-len 1024 --new-tokens 128
    python benchmarks/peers/hf_generate.py --cache static                   # static KV cache (compiled on CUDA)
    python benchmarks/peers/hf_generate.py --model random:llama-test --prompt-len 32 --new-tokens 8   # CPU, a second

For each batch size B: B random prompts of P tokens, ``generate`` with greedy decoding and N new
tokens (end-of-sequence ignored, as tandem's benchmark requests are), after ``--warmup`` untimed calls
of the same shape. A stopping criterion, which ``generate`` calls once per new token, stamps the time
each token exists (after a device sync: ``generate`` syncs every step anyway to test for the end), so
one call splits into prefill (the call's start to the first new token) and decode (first new token to
the last, N - 1 steps): decode tokens/s = B (N - 1) / that time, tandem's own definition in
``benchmarks/serving_gpu.py``. The median of ``--repeats`` timed calls is printed, one JSON line per
batch size, as soon as it is measured (so an out-of-memory error at a large batch keeps the lines
before it).

The model: ``random:<preset>`` builds tandem's preset (``tandem.shared.model.meta.PRESETS``: same
shapes, RoPE and vocabulary) as a transformers ``LlamaForCausalLM`` with seeded random weights, on
the device, in the dtype (bf16 on CUDA, fp32 on the CPU by default); a directory is loaded with
``from_pretrained``. Attention is SDPA. ``--cache static`` uses transformers' static KV cache, which
transformers compiles (CUDA graphs through ``torch.compile``'s reduce-overhead mode) on CUDA unless
``--compile off``; the line says whether the forward was compiled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RANDOM_PREFIX = "random:"


@dataclass
class Timing:
    """One timed ``generate`` call: its output ids and when each new token existed."""

    output: object  # torch.Tensor [B, P + N]
    prefill_s: float
    decode_s: float
    steps: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="random:<tandem preset> or a Hugging Face directory (default: random:llama3-8b "
                                    "on CUDA, random:llama-test on the CPU)")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batches", type=int, nargs="+", default=[1], help="batch sizes, one JSON line each")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per sequence (at least 2)")
    ap.add_argument("--cache", default="dynamic", choices=("dynamic", "static"), help="transformers' KV cache kind")
    ap.add_argument("--compile", default="auto", choices=("auto", "off"),
                    help="auto: transformers compiles the forward where it would (a static cache on CUDA); off: never")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls of the same shape before timing")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per batch size (the median is printed)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random weights and prompts")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2: decode is the steps after the first new token")
    if args.prompt_len < 1 or args.repeats < 1 or args.warmup < 0 or min(args.batches) < 1:
        ap.error("--prompt-len, --repeats and each of --batches must be positive, --warmup not negative")
    return args


def hf_config(spec: str):  # noqa: ANN201 - transformers.LlamaConfig, imported late
    """The transformers config of ``random:<preset>``: tandem's preset, as tandem would save it."""
    from transformers import AutoConfig

    from tandem.shared.model.meta import PRESETS

    name = spec.removeprefix(RANDOM_PREFIX)
    if name not in PRESETS:
        raise SystemExit(f"unknown model {spec!r}: use random:<preset> ({', '.join(sorted(PRESETS))}) or a directory")
    fields = PRESETS[name].to_hf_dict()
    fields.pop("tandem_tokenizer", None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    return config


def build_model(spec: str, device, dtype, seed: int):  # noqa: ANN001, ANN201 - torch and transformers types
    """The model in ``dtype`` on ``device``, eval mode, end of sequence switched off (tandem's requests
    ignore it, so both sides generate exactly N tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    if spec.startswith(RANDOM_PREFIX):
        config = hf_config(spec)
        torch.manual_seed(seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in the target dtype on the device: no float32 copy of an 8B model
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(previous)
    elif Path(spec).is_dir():
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        raise SystemExit(f"model {spec!r} is neither random:<preset> nor a directory")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def generation_config(new_tokens: int, cache: str, compile_mode: str):  # noqa: ANN201
    from transformers import GenerationConfig
    from transformers.generation import configuration_utils

    if cache == "static" and "static" not in getattr(configuration_utils, "ALL_CACHE_IMPLEMENTATIONS", ()):
        raise SystemExit("this transformers has no static cache for generate: use --cache dynamic or a newer "
                         "transformers")
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0,
                              cache_implementation="static" if cache == "static" else None)
    if compile_mode == "off":
        if not hasattr(config, "disable_compile"):
            raise SystemExit("this transformers cannot switch compilation off: leave --compile auto")
        config.disable_compile = True
    return config


def timed_generate(model, prompts, config) -> Timing:  # noqa: ANN001
    """One ``generate`` call, each new token time-stamped by a stopping criterion that never stops."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    cuda = prompts.device.type == "cuda"
    stamps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:  # noqa: ANN001
            if cuda:
                torch.cuda.synchronize(prompts.device)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    if cuda:
        torch.cuda.synchronize(prompts.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config,
                                stopping_criteria=StoppingCriteriaList([Clock()]))
    return Timing(output, stamps[0] - start, stamps[-1] - stamps[0], len(stamps) - 1)


def measure(model, batch: int, args: argparse.Namespace, config) -> dict:  # noqa: ANN001
    import torch

    device = model.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + batch)
    low, high = (300, vocab - 300) if vocab > 1200 else (0, vocab)  # away from special ids where there is room
    prompts = torch.randint(low, high, (batch, args.prompt_len), generator=generator).to(device)
    for _ in range(args.warmup):
        timed_generate(model, prompts, config)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = [timed_generate(model, prompts, config) for _ in range(args.repeats)]
    new = [run.output[:, args.prompt_len:] for run in runs]
    decode_s = statistics.median(run.decode_s for run in runs)
    steps = runs[0].steps
    digest = hashlib.sha256(new[0].cpu().numpy().tobytes()).hexdigest()[:16]
    row = {
        "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "new_tokens_generated": int(new[0].shape[1]),
        "prefill_ms": round(statistics.median(run.prefill_s for run in runs) * 1e3, 2),
        "decode_steps": steps, "decode_s": round(decode_s, 4),
        "decode_ms_per_step": round(decode_s / steps * 1e3, 3),
        "decode_tok_s": round(batch * steps / decode_s, 1),
        "decode_tok_s_each": [round(batch * run.steps / run.decode_s, 1) for run in runs],
        "output_sha256": digest,
        "same_output_across_repeats": all(torch.equal(new[0], other) for other in new[1:]),
        "compiled": getattr(model, "_compiled_call", None) is not None,
    }
    if device.type == "cuda":
        row["peak_gpu_GiB"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as missing:
        raise SystemExit(f"hf_generate.py needs torch and transformers: {missing}") from None
    cuda = torch.cuda.is_available()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if cuda else "cpu"))
    if device.type == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    spec = args.model or ("random:llama3-8b" if device.type == "cuda" else "random:llama-test")
    started = time.perf_counter()
    model = build_model(spec, device, dtype, args.seed)
    config = generation_config(args.new_tokens, args.cache, args.compile)
    params = sum(p.numel() for p in model.parameters())
    common = {"peer": "hf_generate", "model": spec, "params_B": round(params / 1e9, 3),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "attention": "sdpa", "cache": args.cache,
              "warmup": args.warmup, "repeats": args.repeats, "init_s": round(time.perf_counter() - started, 1),
              "transformers": transformers.__version__, "torch": torch.__version__}
    for batch in args.batches:
        print(json.dumps({**common, **measure(model, batch, args, config)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
