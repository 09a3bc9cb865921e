"""Constrained against unconstrained decoding in the engine, in one run: what a structured output costs.

    python benchmarks/structured_decoding.py [--model random:llama3-8b] [--batches 1 32 256]
                                             [--max-tokens 128] [--json-out FILE]

For each batch size B, B requests decode together twice on the same engine: free (``ignore_eos``)
and constrained by a mid-size JSON schema (nested objects, arrays, enums, patterns, integer ranges;
``ORDER_SCHEMA`` below). The figure is TPOT: the median wall time of an engine step while all B
sequences decode (prefill steps and the tail, where sequences have ended, left out), the ratio
constrained / free, and the host's time filling a step's masks. The constrained rows' token masks
are filled by llguidance on host threads while the device runs the forward, and applied on the
device before sampling. Also the schema's compile
time over the vocabulary: cold (the first request with it on a fresh engine, the vocabulary's
token table built first and timed apart) and cached (the next request: a copy of the compiled
matcher), and the valid documents among the constrained outputs that ended.

On CUDA the model is ``random:llama3-8b`` (bf16, CUDA graphs, overlapped steps) over a 128K-token
byte-level BPE vocabulary trained on a generated corpus (random weights have no tokenizer of their
own; a real vocabulary's token table is what the mask work runs over; see grammar_engines.py). On
CPU it is the tiny model with its byte vocabulary and small batches, so the script itself is tested.
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
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams, StructuredOutput
from tandem.shared.structured.compiler import GrammarCompiler
from tandem.shared.text.tokenizer import HFTokenizer

ORDER_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "status", "customer", "items", "shipping", "notes", "priority"],
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["new", "paid", "packed", "shipped", "delivered", "returned"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "age", "tier"],
                     "properties": {"name": {"type": "string", "maxLength": 40},
                                    "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
                                    "age": {"type": "integer", "minimum": 18, "maximum": 120},
                                    "tier": {"enum": ["free", "pro", "team"]}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number", "minimum": 0},
                           "gift": {"type": "boolean"}}}},
        "shipping": {"type": "object", "additionalProperties": False, "required": ["city", "zip", "express"],
                     "properties": {"city": {"type": "string", "maxLength": 30},
                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                    "express": {"type": "boolean"}}},
        "notes": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 60}},
    },
}
SPEC = StructuredOutput(kind="json_schema", spec=json.dumps(ORDER_SCHEMA))
WARMUP_STEPS = 3  # steps after the batch is full, before timing (graph replays settle, masks' caches warm)


def emit(record: dict, sink: list[dict]) -> None:
    sink.append(record)
    print(json.dumps(record), flush=True)


def progress(message: str) -> None:
    print(f"[structured_decoding] {message}", file=sys.stderr, flush=True)


def bpe_tokenizer(vocab_size: int, eos_name: str = "<|end_of_text|>") -> HFTokenizer:
    """A byte-level BPE trained here (grammar_engines.py's), as the engine's tokenizer."""
    sys.path.insert(0, str(Path(__file__).parent))
    from grammar_engines import train_bpe

    progress(f"training a {vocab_size}-token byte-level BPE (the vocabulary the masks run over)")
    trained = train_bpe(vocab_size, seed=0)
    path = Path(tempfile.mkdtemp()) / "tokenizer.json"
    trained.save(str(path))
    return HFTokenizer(path, eos_token_ids=[trained.token_to_id(eos_name)])


def step_times(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[list[float], dict]:
    """Step ``requests`` to the end: the wall time of each step taken while every one of them was
    running, and each request's text and finish reason. No synchronize between steps: ``step``
    waits for the tokens it returns, and overlapped steps keep the device busy while the host
    postprocesses and fills masks, as in serving."""
    for request in requests:
        engine.add_request(request)
    texts = {r.request_id: "" for r in requests}
    reasons: dict[str, str | None] = {}
    times, full = [], 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outputs:
            texts[out.request_id] += out.text_delta
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if engine.stats()["running"] == len(requests) and not reasons:
            full += 1
            if full > WARMUP_STEPS:
                times.append(elapsed)
    return times, {rid: (texts[rid], reasons.get(rid)) for rid in texts}


def valid_documents(results: dict) -> tuple[int, int]:
    """(ended, valid): constrained outputs that ended by themselves, and those that validate."""
    import jsonschema

    ended = valid = 0
    for text, reason in results.values():
        if reason != "stop":
            continue
        ended += 1
        try:
            jsonschema.validate(json.loads(text), ORDER_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ended, valid


def compile_figures(engine: LLMEngine, records: list[dict]) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    start = time.perf_counter()
    _ = compiler.vocabulary
    vocabulary_s = time.perf_counter() - start
    start = time.perf_counter()
    compiler.output_grammar(SPEC)
    cold_s = time.perf_counter() - start
    cached = []
    for _ in range(20):
        start = time.perf_counter()
        compiler.output_grammar(SPEC)
        cached.append(time.perf_counter() - start)
    emit({"figure": "compile", "vocab_size": engine.vocab_size, "vocabulary_table_ms": round(vocabulary_s * 1e3, 2),
          "schema_cold_ms": round(cold_s * 1e3, 3), "schema_cached_ms": round(statistics.median(cached) * 1e3, 4)},
         records)


def tpot_figures(engine: LLMEngine, batch: int, max_tokens: int, prompt_len: int, records: list[dict]) -> None:
    vocab = min(engine.vocab_size, 256)  # prompt ids every vocabulary here has (bytes, or the BPE's first pieces)
    prompts = [[(7 * i + 13 * j) % vocab for j in range(prompt_len)] for i in range(batch)]
    free = [EngineRequest(f"free-{batch}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                                                                   ignore_eos=True)) for i, p in enumerate(prompts)]
    constrained = [EngineRequest(f"json-{batch}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                        seed=i, structured_output=SPEC))
                   for i, p in enumerate(prompts)]
    progress(f"batch {batch}: free")
    free_times, _ = step_times(engine, free)
    progress(f"batch {batch}: constrained")
    fills_before, fill_s_before = engine.grammars.stats.mask_fills, engine.grammars.stats.mask_fill_seconds
    json_times, results = step_times(engine, constrained)
    fills = engine.grammars.stats.mask_fills - fills_before
    fill_ms = (engine.grammars.stats.mask_fill_seconds - fill_s_before) * 1e3 / max(1, fills)
    ended, valid = valid_documents(results)
    record = {"figure": "tpot", "batch": batch, "free_steps": len(free_times), "constrained_steps": len(json_times)}
    if free_times and json_times:
        free_ms, json_ms = statistics.median(free_times) * 1e3, statistics.median(json_times) * 1e3
        record.update(free_tpot_ms=round(free_ms, 3), constrained_tpot_ms=round(json_ms, 3),
                      ratio=round(json_ms / free_ms, 3))
    record.update(host_mask_fill_ms=round(fill_ms, 3), constrained_ended=ended, constrained_valid=valid)
    emit(record, records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, tiny on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 32 256 on CUDA, 1 8 on CPU")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: 160 on CUDA, 48 on CPU)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=128000, help="the trained BPE's size (random models)")
    parser.add_argument("--json-out", default=None, help="write every figure there as a JSON list")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = args.model or ("random:llama3-8b" if cuda else "tiny")
    batches = args.batches or ([1, 32, 256] if cuda else [1, 8])
    max_tokens = args.max_tokens or (160 if cuda else 48)
    progress(f"loading {model} on {device}")
    loaded = load_model(model, device=device)
    tokenizer = bpe_tokenizer(args.vocab_size) if model.startswith("random:") else loaded.tokenizer
    blocks_per_seq = -(-(args.prompt_len + max_tokens) // 16)
    config = EngineConfig(block_size=16, num_blocks=max(batches) * blocks_per_seq + 16, max_num_seqs=max(batches),
                          max_num_batched_tokens=max(8192, max(batches) * args.prompt_len),
                          max_model_len=args.prompt_len + max_tokens + 16, enable_prefix_caching=False)
    engine = LLMEngine(loaded.model, tokenizer, config, device)
    records: list[dict] = []
    emit({"figure": "setup", "model": model, "device": torch.cuda.get_device_name() if cuda else "cpu",
          "vocab_size": engine.vocab_size, "overlap_steps": engine.overlap_steps,
          "cuda_graphs": engine.runner.graphs is not None, "max_tokens": max_tokens}, records)
    compile_figures(engine, records)
    for batch in batches:
        tpot_figures(engine, batch, max_tokens, args.prompt_len, records)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
