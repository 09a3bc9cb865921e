"""GPU serving speed of the engine on an 8B Llama-3-shaped model with random bf16 weights.

    python benchmarks/serving_gpu.py [--model random:llama3-8b] [--parts roofline,batch1,throughput,fp8]
                                     [--batches 32 64 256] [--hf-peer [SCRIPT]] [--json-out FILE]

Prints one JSON line per figure, all from one process and one run:
- ``hbm``: HBM read bandwidth (sum over 8 GiB of bf16), the roofline's denominator, and the
  batch-1 decode roofline = weight bytes / that bandwidth (every weight is read once per token);
- ``batch1``: inter-token latency and tokens/s at batch 1 (prompt 512, 128 new tokens), with decode
  CUDA graphs and without (``enforce_eager``), against the roofline;
- ``throughput``: B requests of 1024 random prompt tokens and 128 output tokens submitted at once,
  B = 32, 64 and 256: output tokens/s over the whole run and over the decode phase alone, and the
  decode step against its floor (:func:`step_floor`): each part of the step (the layers' weight
  matmuls, attention over the cached K/V, the LM head) at the larger of its HBM time and its
  compute time at the bf16 matmul peak measured in the same run, both printed; the old figure
  (every byte at the HBM rate, the embedding table read whole) stays beside it;
- ``prefill`` (``--parts prefill``): ``--prefill-prompts`` prompts of 1024 random tokens, one
  output token each, submitted at once, for each ``--prefill-chunks`` step budget: prompt tokens/s
  and the FLOPs achieved (:func:`prefill_flops`: projections, MLP and causal attention, the LM head
  for the last tokens) over the bf16 matmul peak measured in the same run;
- ``memory`` (CUDA): what an engine holds on the device beyond its weights and KV pool (the CUDA
  context, graphs, the allocator's cache, an 8192-token prefill step's peak): what workers sharing
  one GPU must leave free between their ``--gpu-memory-utilization`` shares;
- ``closed`` (``--closed C ...``): the engine alone under ``tandem bench serve``'s closed loop at
  concurrency C: max(16, 2C) requests of 1024 prompt and 128 output tokens, C in flight, the next
  added when one finishes; output tokens/s and per-request TTFT and TPOT as the bench measures them,
  so a served system at the same concurrency compares with it like for like
  (``benchmarks/serving_system.py`` does);
- ``fp8_decode`` and ``fp8_parity`` (``--parts fp8``): decode at each ``--fp8-batches`` size
  (default 1; prompts of 512, 128 new tokens, CUDA graphs) of the model in bf16 and with fp8
  weights (``--quantization fp8``: the decoder layers' linears at 1 byte per weight; the LM head
  stays bf16), each against its own roofline (the bytes a step reads: every weight but the
  embedding table, whose rows are looked up) and its own step floor, then fp8 over bf16; and the
  parity fp8 keeps: greedy tokens on the same prompt (steps equal before the first divergence),
  teacher-forced top-1 agreement over those steps (both models fed the bf16 tokens), |logit diff|
  at the first step and at worst, of the row's largest |logit|; on the model, and on the shipped
  trained ``tiny`` checkpoint (a random model's logits are nearly flat, so its top-1 flips more
  easily than a trained model's);
- ``hf_generate`` (with ``--hf-peer``): transformers ``generate`` on the same model
  (``benchmarks/peers/hf_generate.py``, in its own process after this one freed its GPU memory):
  greedy, batch 1, prompt 512, 128 new tokens, as the ``batch1`` part, with tandem's batch-1 decode
  rate (CUDA graphs) over the peer's; and where the ``throughput`` part ran, at its batches with
  1024-token prompts, with tandem's decode-phase rate over the peer's at each. A peer that fails
  (out of memory at a large batch, say) fails its rows with a one-line reason, tandem's rows kept,
  and the run exits non-zero.

On CPU it runs the same code on ``random:llama-test`` so the script itself is tested.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.kvcache.cache import kv_cache_bytes_per_block
from tandem.shared.model.fp8 import Fp8Linear, scaled_mm_plan, weight_bytes
from tandem.shared.model.loader import load_model
from tandem.shared.model.reference import reference_logits
from tandem.shared.protocol.serving import SamplingParams

HF_PEER = Path(__file__).resolve().parent / "peers" / "hf_generate.py"
HF_PEER_TIMEOUT_S = 1800


def emit(record: dict, sink: list[dict]) -> None:
    sink.append(record)
    print(json.dumps(record), flush=True)


def matmul_tflops(device: torch.device) -> float:
    """Dense bf16 8192^3 matmul rate (the anchors' method): the compute side of the floors."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    sync(device)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    sync(device)
    rate = 2 * 8192**3 * 20 / (time.perf_counter() - start) / 1e12
    del a
    torch.cuda.empty_cache()
    return rate


def step_floor(cfg, batch: int, context: int, gbps: float, tflops: float, dtype_bytes: int = 2,
               linear_bytes: float | None = None) -> dict:
    """The least time one decode step of ``batch`` sequences at mean ``context`` tokens can take:
    each part at the larger of its bytes over ``gbps`` and its FLOPs over ``tflops``, summed (a part
    cannot overlap its own reads and math beyond that; parts run one after another). Parts:
    ``matmuls``: every layer's projections and MLP, weights read once (``linear_bytes`` each: 1 for
    fp8 weights; default ``dtype_bytes``), 2 FLOPs per weight per row (at the bf16 rate: a bound
    that fp8's faster tensor cores only lower where the step is compute-bound);
    ``attention``: each sequence's K/V read once, QK^T and PV 4 FLOPs per query head, dim and token;
    ``lm_head``: the vocabulary projection. The input embedding is a lookup of ``batch`` rows, not a
    read of the table; norms and RoPE are noise at this scale."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = cfg.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * cfg.hidden_size * cfg.intermediate_size
    kv_per_token = cfg.num_layers * 2 * kv_dim * dtype_bytes
    parts = {
        "matmuls": (cfg.num_layers * layer_weights * (dtype_bytes if linear_bytes is None else linear_bytes),
                    2 * cfg.num_layers * layer_weights * batch),
        "attention": (batch * context * kv_per_token, 4 * cfg.num_layers * q_dim * context * batch),
        "lm_head": (cfg.vocab_size * cfg.hidden_size * dtype_bytes, 2 * cfg.vocab_size * cfg.hidden_size * batch),
    }
    out: dict = {}
    floor = 0.0
    for name, (nbytes, flops) in parts.items():
        hbm_ms, compute_ms = nbytes / (gbps * 1e9) * 1e3, flops / (tflops * 1e12) * 1e3
        out[name] = {"hbm_ms": round(hbm_ms, 3), "compute_ms": round(compute_ms, 3),
                     "bound": "compute" if compute_ms > hbm_ms else "hbm"}
        floor += max(hbm_ms, compute_ms)
    out["floor_ms"] = round(floor, 3)
    return out


def prefill_flops(cfg, prompts: int, length: int) -> dict:
    """FLOPs of prefilling ``prompts`` prompts of ``length`` tokens: the layers' projections and MLP
    (2 per weight per token), causal attention (QK^T and PV, 4 per query head, dim and attended
    position: token i attends to i + 1 positions) and the LM head for each prompt's last token only
    (the one that is sampled)."""
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer_weights = cfg.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * cfg.hidden_size * cfg.intermediate_size
    linear = 2 * cfg.num_layers * layer_weights * length * prompts
    attention = 4 * cfg.num_layers * q_dim * (length * (length + 1) // 2) * prompts
    head = 2 * cfg.vocab_size * cfg.hidden_size * prompts
    return {"linear": linear, "attention": attention, "lm_head": head, "total": linear + attention + head}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hbm_read_gbps(device: torch.device) -> float:
    """Same method as the anchors' hbm_read.py: a float32 sum over 8 GiB of bf16."""
    x = torch.ones(4 << 30, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        x.sum(dtype=torch.float32)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        x.sum(dtype=torch.float32)
    sync(device)
    gbps = x.numel() * 2 * 10 / (time.perf_counter() - start) / 1e9
    del x
    torch.cuda.empty_cache()
    return gbps


def make_engine(loaded, device: torch.device, max_num_seqs: int, max_model_len: int, eager: bool,
                kv_gib: float, max_num_batched_tokens: int = 8192) -> LLMEngine:
    cfg = loaded.config
    per_block = kv_cache_bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16
                                         if device.type == "cuda" else torch.float32)
    num_blocks = max(64, int(kv_gib * 2**30) // per_block) if kv_gib else 4096
    config = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          enable_prefix_caching=False,
                          enforce_eager=eager)
    return LLMEngine(loaded.model, loaded.tokenizer, config, device)


def greedy_tokens(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(EngineRequest(request_id="greedy", prompt_token_ids=prompt,
                                     params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def fp8_parity(plain, quantized, device: torch.device, prompts: list[list[int]], steps: int, label: str) -> dict:
    """Greedy ``steps`` tokens of each prompt through each model's engine (CUDA graphs on), then both
    models fed the bf16 tokens (the contiguous-KV reference forward): top-1 agreement at each step,
    |logit diff| of the row's largest |logit| at the first step and at worst."""
    prefix, agree, first, worst = [], 0, 0.0, 0.0
    for prompt in prompts:
        want = greedy_tokens(make_engine(plain, device, 1, 2048, False, 0.5), prompt, steps)
        got = greedy_tokens(make_engine(quantized, device, 1, 2048, False, 0.5), prompt, steps)
        prefix.append(next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), steps))
        ids = prompt + want
        rows = slice(len(prompt) - 1, len(ids) - 1)
        a = reference_logits(plain.model, ids)[rows].float()
        b = reference_logits(quantized.model, ids)[rows].float()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        relative = (a - b).abs().amax(-1) / a.abs().amax(-1)
        first, worst = max(first, relative[0].item()), max(worst, relative.max().item())
        del a, b
    return {"figure": "fp8_parity", "model": label, "prompts": len(prompts), "steps": steps,
            "greedy_equal_steps": prefix, "teacher_forced_top1": round(agree / (len(prompts) * steps), 4),
            "first_step_max_logit_diff_of_row_max": round(first, 4),
            "worst_max_logit_diff_of_row_max": round(worst, 4)}


def fp8_figures(model: str, plain, device: torch.device, gbps: float | None, tflops: float | None,
                kv_gib: float, records: list[dict], batches: Sequence[int] = (1,)) -> None:
    """The ``fp8`` part: decode at each of ``batches`` in the model dtype and in fp8, each against
    its own roofline and step floor, fp8 over the other, and the parity (see the module docstring)."""
    quantized = load_model(model, device=device, quantization="fp8")  # same preset seed: the same weights before
    plan = next(m.plan for m in quantized.model.modules() if isinstance(m, Fp8Linear))
    path = plan.description if plan is not None else "dequantize reference (" + \
        scaled_mm_plan(device, plain.model.model.embed_tokens.weight.dtype)[1] + ")"
    cfg, vocab = plain.config, plain.config.vocab_size
    for batch in batches:
        rates = {}
        for name, loaded in ((str(plain.model.model.embed_tokens.weight.dtype).removeprefix("torch."), plain),
                             ("fp8", quantized)):
            engine = make_engine(loaded, device, batch, 2048, False, min(kv_gib, 4.0))
            run_requests(engine, random_prompts(batch, 512, vocab, 1), 8, device)  # warm-up
            result = run_requests(engine, random_prompts(batch, 512, vocab, 2), 128, device)
            read = weight_bytes(loaded.model, skip_embedding=True)
            record = {"figure": "fp8_decode", "batch": batch, "weights": name,
                      "read_GB_per_step": round(read / 1e9, 3), "decode_tok_s": result["decode_tok_s"],
                      "ms_per_step": result["itl_ms"], "tpot_p50_ms": result["tpot_p50_ms"]}
            if name == "fp8":
                record["path"] = path
            if gbps and result["decode_tok_s"]:
                roofline = gbps * 1e9 / read * batch  # tokens/s if a step took only its weight reads
                record["roofline_tok_s"] = round(roofline, 1)
                record["of_roofline"] = round(result["decode_tok_s"] / roofline, 3)
                floor = step_floor(cfg, batch, 512 + 64, gbps, tflops, linear_bytes=1 if name == "fp8" else None)
                record["step_floor_ms"] = floor["floor_ms"]
                record["of_step_floor"] = round(floor["floor_ms"] / result["itl_ms"], 3)
            rates[name] = (result["decode_tok_s"], record.get("roofline_tok_s"))
            emit(record, records)
            del engine
            torch.cuda.empty_cache() if device.type == "cuda" else None
        (plain_rate, plain_roof), (fp8_rate, fp8_roof) = rates.values()
        emit({"figure": "fp8_speedup", "batch": batch,
              "decode_tok_s": round(fp8_rate / plain_rate, 3) if plain_rate else None,
              "roofline": round(fp8_roof / plain_roof, 3) if plain_roof else None}, records)
    emit(fp8_parity(plain, quantized, device, random_prompts(2, 512, vocab, 2), 64, model), records)
    del quantized
    torch.cuda.empty_cache() if device.type == "cuda" else None
    # A trained model (the shipped tiny checkpoint): its logits have real margins.
    tiny_plain, tiny_fp8 = load_model("tiny", device=device), load_model("tiny", device=device, quantization="fp8")
    prompts = [tiny_plain.tokenizer.encode(text) for text in TINY_PROMPTS]
    emit(fp8_parity(tiny_plain, tiny_fp8, device, prompts, 32, "tiny"), records)


TINY_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n", "class Config:\n    def __init__(self",
                "    for i in range(len(items)):\n        if ", "# Copyright 2001 Python Software Foundation\n")


def memory_figures(loaded, device: torch.device) -> dict:
    """Device memory, GiB, around one engine with a 4096-block pool: weights, pool, what the device
    shows used beyond them, the allocator's cache (reserved but unallocated) before and after
    ``empty_cache``, and the extra peak of one 8192-token prefill step."""
    gib = 2**30
    weights = torch.cuda.memory_allocated(device)
    engine = make_engine(loaded, device, 256, 2048, False, 0)
    engine_blocks = engine.config.num_blocks
    cfg = loaded.config
    pool = (engine_blocks + 1) * kv_cache_bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim,
                                                          torch.bfloat16)
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    out = {"weights_gib": round(weights / gib, 2), "pool_gib": round(pool / gib, 2),
           "allocated_beyond_weights_and_pool_gib": round((allocated - weights - pool) / gib, 2),
           "cached_unallocated_gib": round((reserved - allocated) / gib, 2),
           "device_used_beyond_reserved_gib": round((total - free - reserved) / gib, 2)}
    torch.cuda.empty_cache()
    out["cached_after_empty_cache_gib"] = round((torch.cuda.memory_reserved(device) - allocated) / gib, 2)
    torch.cuda.reset_peak_memory_stats(device)
    run_requests(engine, random_prompts(8, 1024, cfg.vocab_size, 5), 1, device)
    out["prefill_8192_step_peak_gib"] = round((torch.cuda.max_memory_allocated(device) - allocated) / gib, 2)
    del engine
    torch.cuda.empty_cache()
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab - 300, (n, length), generator=gen).tolist()


def run_requests(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, device: torch.device) -> dict:
    """Submit all at once, step to the end; time to the last first token and the whole run."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    token_times: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                tokens += len(out.new_token_ids)
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
        if len(outputs) == len(prompts) and len(first) == len(prompts):
            token_times.append(now)  # a step in which every request got a token: a decode step
    total = time.perf_counter() - start
    tpots = sorted((last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1)
    decode_steps = len(token_times) - 1
    decode_s = token_times[-1] - token_times[0] if decode_steps > 0 else float("nan")
    return {"requests": len(prompts), "output_tokens": tokens, "total_s": round(total, 3),
            "output_tok_s": round(tokens / total, 1),
            "last_first_token_s": round(max(first.values()) - start, 3),
            "decode_steps": decode_steps,
            "tpot_p50_ms": round(tpots[len(tpots) // 2] * 1e3, 3) if tpots else None,
            "itl_ms": round(decode_s / decode_steps * 1e3, 3) if decode_steps > 0 else None,
            "decode_tok_s": round(decode_steps * len(prompts) / decode_s, 1) if decode_steps > 0 else None}


def run_closed_loop(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int,
                    device: torch.device) -> dict:
    """``tandem bench serve``'s closed loop in process: ``concurrency`` requests in flight, the next
    added the step after one finishes; TTFT from a request's submission, TPOT over its later tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync(device)
    start = time.perf_counter()
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    pending = list(enumerate(prompts))
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            submitted[f"c{i}"] = time.perf_counter()
            engine.add_request(EngineRequest(request_id=f"c{i}", prompt_token_ids=prompt, params=params))
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
    total = time.perf_counter() - start
    ttfts = sorted(first[r] - submitted[r] for r in first)
    tpots = sorted((last[r] - first[r]) / (counts[r] - 1) for r in first if counts[r] > 1)
    tokens = sum(counts.values())
    return {"requests": len(prompts), "concurrency": concurrency, "output_tokens": tokens,
            "total_s": round(total, 3), "output_tok_s": round(tokens / total, 1),
            "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1e3, 2),
            "tpot_p50_ms": round(tpots[len(tpots) // 2] * 1e3, 3) if tpots else None}


def run_hf_peer(script: str, model: str, batches: Sequence[int], prompt_len: int, cache: str,
                device: torch.device) -> tuple[list[dict], str]:
    """The peer's rows (one JSON line per batch, printed as each is measured) and, where it did not
    measure every batch, why, in one line (its last line of stderr)."""
    cmd = [sys.executable, script, "--model", model, "--batches", *map(str, batches), "--prompt-len",
           str(prompt_len), "--new-tokens", "128", "--cache", cache, "--repeats", "3" if device.type == "cuda" else "1"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=HF_PEER_TIMEOUT_S)
    except subprocess.TimeoutExpired as late:
        stdout = late.stdout.decode() if isinstance(late.stdout, bytes) else late.stdout or ""
        out = subprocess.CompletedProcess(cmd, -1, stdout, f"ran past {HF_PEER_TIMEOUT_S} s")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode == 0 and len(rows) >= len(batches):
        return rows, ""
    last = next((line.strip() for line in reversed(out.stderr.splitlines()) if line.strip()), "no output")
    return rows, f"{Path(script).name} (batches {' '.join(map(str, batches))}, prompt {prompt_len}) exited " \
                 f"{out.returncode}: {last}"


def hf_peer_record(row: dict, records: list[dict]) -> dict:
    """A peer row with tandem's rate over it, from this run's rows of the same shape."""
    record = {"figure": "hf_generate", **row}
    peer_rate, batch = row.get("decode_tok_s"), row.get("batch")
    if not peer_rate:
        return record
    if batch == 1 and row.get("prompt_len") == 512:
        ours = next((r["decode_tok_s"] for r in records if r["figure"] == "batch1" and r["cuda_graphs"]), None)
        if ours:
            record["tandem_batch1_over_hf"] = round(ours / peer_rate, 1)
    else:
        ours = next((r["decode_tok_s"] for r in records if r["figure"] == "throughput" and r["batch"] == batch
                     and r["prompt_len"] == row.get("prompt_len")), None)
        if ours:
            record["tandem_over_hf"] = round(ours / peer_rate, 2)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, random:llama-test on CPU")
    parser.add_argument("--parts", default="roofline,batch1,throughput")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 256])
    parser.add_argument("--closed", type=int, nargs="+", default=[32],
                        help="the closed part's concurrencies (max(16, 2C) requests each)")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="the throughput and closed engine's batch limit (0: the largest batch or concurrency)")
    parser.add_argument("--kv-gib", type=float, default=None,
                        help="the KV pool of the batch and prefill parts (default: 60 GiB, or 70%% of the memory "
                             "left after the weights where that is less, as on an 80 GB card)")
    parser.add_argument("--prefill-prompts", type=int, default=256, help="the prefill part's 1024-token prompts")
    parser.add_argument("--prefill-chunks", type=int, nargs="+", default=[8192, 16384],
                        help="the prefill part's step token budgets (max_num_batched_tokens), one run each")
    parser.add_argument("--fp8-batches", type=int, nargs="+", default=[1],
                        help="the fp8 part's decode batch sizes (up to 16 the few-row kernel runs, past it _scaled_mm)")
    parser.add_argument("--json-out")
    parser.add_argument("--hf-peer", "--hf-anchor", dest="hf_peer", nargs="?", const=str(HF_PEER), metavar="SCRIPT",
                        help="after the parts, run the HF generate peer (default script: benchmarks/peers/"
                             "hf_generate.py) on the same model and shapes, and print tandem's rate over it")
    parser.add_argument("--hf-cache", default="dynamic", choices=("dynamic", "static"),
                        help="the HF peer's KV cache (static: compiled on CUDA by transformers)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("random:llama3-8b" if device.type == "cuda" else "random:llama-test")
    parts = set(args.parts.split(","))
    kv_gib = args.kv_gib if device.type == "cuda" else 0.25
    records: list[dict] = []
    weight_bytes, gbps, tflops = 0, None, None
    if parts & {"roofline", "fp8", "prefill"} and device.type == "cuda":
        gbps = hbm_read_gbps(device)
        tflops = matmul_tflops(device)
        emit({"figure": "hbm", "hbm_read_GBps": round(gbps, 1), "bf16_matmul_tflops": round(tflops, 1)}, records)
    loaded = load_model(model, device=device)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(f"# loaded {model}: {weight_bytes / 1e9:.2f} GB of weights on {device}", flush=True)
    if kv_gib is None:  # the pool, activations and graphs must fit beside the weights
        kv_gib = min(60.0, 0.7 * torch.cuda.mem_get_info(device)[0] / 2**30)
        print(f"# KV pool of the batch and prefill parts: {kv_gib:.1f} GiB", flush=True)
    if gbps:
        emit({"figure": "roofline", "weight_GB": round(weight_bytes / 1e9, 2),
              "batch1_roofline_tok_s": round(gbps * 1e9 / weight_bytes, 1)}, records)
    vocab = loaded.config.vocab_size
    if "memory" in parts and device.type == "cuda":
        emit({"figure": "memory", **memory_figures(loaded, device)}, records)
    if "fp8" in parts:
        fp8_figures(model, loaded, device, gbps, tflops, kv_gib, records, args.fp8_batches)
    if "batch1" in parts:
        for eager in (False, True):
            engine = make_engine(loaded, device, 1, 2048, eager, min(kv_gib, 4.0))
            run_requests(engine, random_prompts(1, 512, vocab, 1), 8, device)  # warm-up
            result = run_requests(engine, random_prompts(1, 512, vocab, 2), 128, device)
            record = {"figure": "batch1", "cuda_graphs": not eager, **result}
            if gbps and result["decode_tok_s"]:
                record["of_roofline"] = round(result["decode_tok_s"] / (gbps * 1e9 / weight_bytes), 3)
                # The same step by parts (the embedding table is not read whole; context prompt + half the output).
                floor = step_floor(loaded.config, 1, 512 + 64, gbps, tflops)
                record["step_floor"] = floor
                record["of_step_floor"] = round(floor["floor_ms"] / result["itl_ms"], 3)
            emit(record, records)
            del engine
            torch.cuda.empty_cache() if device.type == "cuda" else None
    engine = None
    batches = args.batches if device.type == "cuda" else [4, 8]
    closed = args.closed if device.type == "cuda" else [min(c, 4) for c in args.closed]
    if parts & {"throughput", "closed"}:
        seqs = args.max_num_seqs or max([*(batches if "throughput" in parts else []),
                                         *(closed if "closed" in parts else [])])
        engine = make_engine(loaded, device, seqs, 2048, False, kv_gib)
        run_requests(engine, random_prompts(min(batches), 1024, vocab, 3), 4, device)  # warm-up
    if "throughput" in parts:
        for batch in batches:
            result = run_requests(engine, random_prompts(batch, 1024, vocab, 10 + batch), 128, device)
            record = {"figure": "throughput", "batch": batch, "prompt_len": 1024, **result}
            if gbps and result["itl_ms"]:
                # Every decode step reads all weights and every sequence's cached K/V (mean context
                # over the decode phase: prompt + half the output): the step's bandwidth floor.
                cfg = loaded.config
                kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
                step_bytes = weight_bytes + batch * (1024 + 64) * kv_per_token
                record["decode_step_roofline_ms"] = round(step_bytes / (gbps * 1e9) * 1e3, 2)
                record["decode_of_roofline"] = round(record["decode_step_roofline_ms"] / result["itl_ms"], 3)
                floor = step_floor(cfg, batch, 1024 + 64, gbps, tflops)
                record["step_floor"] = floor
                record["decode_of_step_floor"] = round(floor["floor_ms"] / result["itl_ms"], 3)
            emit(record, records)
    if "closed" in parts:
        for concurrency in closed:
            n = max(16, 2 * concurrency)
            result = run_closed_loop(engine, random_prompts(n, 1024, vocab, 1000 + concurrency), concurrency, 128,
                                     device)
            emit({"figure": "closed", "prompt_len": 1024, **result}, records)
    if "prefill" in parts:
        engine = None  # the parts before used it; each budget gets an engine of its own
        prompts, length = (args.prefill_prompts, 1024) if device.type == "cuda" else (8, 128)
        flops = prefill_flops(loaded.config, prompts, length)
        for chunk in args.prefill_chunks:
            gc.collect()  # an engine's parts refer to each other: its pool is freed only by the collector
            torch.cuda.empty_cache() if device.type == "cuda" else None
            runner = make_engine(loaded, device, prompts, 2048, False, kv_gib, max_num_batched_tokens=chunk)
            run_requests(runner, random_prompts(min(prompts, 8), length, vocab, 7), 1, device)  # warm-up
            result = run_requests(runner, random_prompts(prompts, length, vocab, 8 + chunk), 1, device)
            record = {"figure": "prefill", "prompts": prompts, "prompt_len": length, "chunk_tokens": chunk,
                      "total_s": result["total_s"],
                      "prompt_tok_s": round(prompts * length / result["total_s"], 1),
                      "achieved_tflops": round(flops["total"] / result["total_s"] / 1e12, 1),
                      "attention_share": round(flops["attention"] / flops["total"], 4)}
            if tflops:
                record["of_matmul_peak"] = round(flops["total"] / result["total_s"] / 1e12 / tflops, 3)
            emit(record, records)
            del runner
    failed = []
    try:
        if args.hf_peer:
            # The peer needs the memory: drop the model, pool and graphs first. The engines' parts refer
            # to each other, so only the collector frees them (with 40 GiB of KV left behind the peer ran
            # out of memory on an 80 GB H100).
            loaded = engine = None
            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
            shapes = [([1], 512)] + ([(batches, 1024)] if "throughput" in parts else [])
            for peer_batches, prompt_len in shapes:
                rows, reason = run_hf_peer(args.hf_peer, model, peer_batches, prompt_len, args.hf_cache, device)
                for row in rows:
                    emit(hf_peer_record(row, records), records)
                if reason:
                    failed.append(reason)
                    emit({"figure": "hf_generate", "prompt_len": prompt_len, "error": reason,
                          "batches": [b for b in peer_batches if b not in {r.get("batch") for r in rows}]}, records)
    finally:
        if args.json_out:  # also when the peer fails: its failure loses none of tandem's own rows
            Path(args.json_out).write_text(json.dumps(records, indent=1))
    if failed:
        raise SystemExit(f"the HF peer failed: {failed[0]}")


if __name__ == "__main__":
    main()
