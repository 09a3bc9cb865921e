"""Several outputs per request: KV blocks shared by parallel samples, and beam search against
transformers' ``generate(num_beams=k)``, in one run.

    python benchmarks/several_outputs.py [--model random:llama3-8b] [--parts blocks,beam]
                                         [--prompt-len 1000] [--samples 8] [--beam-width 4] [--json-out FILE]

Prints one JSON line per figure:
- ``blocks``: one request with ``n = --samples`` outputs against that many independent requests of the
  same prompt submitted at once (prefix caching off, so nothing is shared but through forks): peak KV
  blocks in use, wall time and output tokens/s of each;
- ``beam``: one beam search (``--beam-width`` beams, a 512-token prompt, 128 new tokens, eos
  ignored so both run every step) through the engine, then ``transformers``' ``generate(num_beams=k,
  do_sample=False)`` on a model of the same shape and dtype in the same process: wall time, search
  steps per second and tandem's speed over transformers'.

On CUDA the default model is ``random:llama3-8b`` in bf16; on CPU ``random:llama-test`` with short
lengths, so the script itself is tested.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams


def emit(record: dict, sink: list[dict]) -> None:
    sink.append(record)
    print(json.dumps(record), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(loaded, device: torch.device, num_blocks: int) -> LLMEngine:
    config = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=64, max_num_batched_tokens=8192,
                          max_model_len=4096, enable_prefix_caching=False)
    return LLMEngine(loaded.model, loaded.tokenizer, config, device)


def drive(engine: LLMEngine, requests: list[EngineRequest], device: torch.device) -> dict:
    """Submit ``requests`` at once and step to the end: wall time, output tokens, peak blocks in use."""
    sync(device)
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    tokens = peak = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
        stats = engine.stats()
        peak = max(peak, stats["num_blocks"] - stats["free_blocks"])
    sync(device)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "output_tokens": tokens, "output_tok_s": round(tokens / seconds, 1),
            "peak_blocks": peak}


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab - 3, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_figure(loaded, device: torch.device, args, records: list[dict]) -> None:
    vocab = loaded.config.vocab_size
    prompt = random_prompt(args.prompt_len, vocab, 1)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=3, ignore_eos=True)
    engine = make_engine(loaded, device, args.num_blocks)
    drive(engine, [EngineRequest("warm", prompt[:64], params.model_copy(update={"max_tokens": 4}))], device)
    group = drive(engine, [EngineRequest("g", prompt, params.model_copy(update={"n": args.samples}))], device)
    alone = drive(engine, [EngineRequest(f"r{i}", prompt, params.model_copy(update={"seed": 3 + i}))
                           for i in range(args.samples)], device)
    emit({"figure": "blocks", "device": device.type, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "samples": args.samples, "one_request": group, "independent_requests": alone,
          "blocks_ratio": round(group["peak_blocks"] / alone["peak_blocks"], 3),
          "cow_copies": engine.stats()["cow_copies"]}, records)


def hf_model_like(loaded, device: torch.device, dtype: torch.dtype):
    """A transformers Llama of the same shape as ``loaded`` (random weights: only speed is compared)."""
    import transformers

    hf_config = transformers.LlamaConfig(**{k: v for k, v in loaded.config.to_hf_dict().items()
                                            if k not in ("architectures", "model_type")})
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        return transformers.LlamaForCausalLM(hf_config).to(dtype).eval()


def beam_figure(loaded, device: torch.device, dtype: torch.dtype, args, records: list[dict]) -> None:
    vocab = loaded.config.vocab_size
    prompt = random_prompt(args.beam_prompt_len, vocab, 2)
    params = SamplingParams(max_tokens=args.beam_new_tokens, beam_width=args.beam_width, ignore_eos=True)
    engine = make_engine(loaded, device, args.num_blocks)
    drive(engine, [EngineRequest("warm", prompt, params.model_copy(update={"max_tokens": 4}))], device)
    ours = drive(engine, [EngineRequest("b", prompt, params)], device)
    ours["steps_per_s"] = round(args.beam_new_tokens / ours["seconds"], 1)
    del engine
    loaded.model.to("cpu")  # room for the peer on the device
    torch.cuda.empty_cache() if device.type == "cuda" else None
    hf_model = hf_model_like(loaded, device, dtype)
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(num_beams=args.beam_width, do_sample=False, eos_token_id=None, pad_token_id=0,
                  num_return_sequences=1)
    with torch.no_grad():
        hf_model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        sync(device)
        start = time.perf_counter()
        out = hf_model.generate(ids, max_new_tokens=args.beam_new_tokens, min_new_tokens=args.beam_new_tokens,
                                **kwargs)
        sync(device)
    hf_s = time.perf_counter() - start
    assert out.shape[1] - len(prompt) == args.beam_new_tokens, "transformers stopped early"
    peer = {"seconds": round(hf_s, 3), "steps_per_s": round(args.beam_new_tokens / hf_s, 1)}
    emit({"figure": "beam", "device": device.type, "beam_width": args.beam_width, "prompt_len": len(prompt),
          "new_tokens": args.beam_new_tokens, "tandem": ours, "transformers": peer,
          "tandem_over_transformers": round(hf_s / ours["seconds"], 2)}, records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: random:llama3-8b on CUDA, random:llama-test on CPU")
    parser.add_argument("--parts", default="blocks,beam")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=None, help="blocks figure (default 1000 on CUDA, 100 on CPU)")
    parser.add_argument("--new-tokens", type=int, default=None, help="blocks figure (default 128 on CUDA, 16 on CPU)")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    model = args.model or ("random:llama3-8b" if cuda else "random:llama-test")
    args.prompt_len = args.prompt_len or (1000 if cuda else 100)
    args.new_tokens = args.new_tokens or (128 if cuda else 16)
    args.beam_prompt_len, args.beam_new_tokens = (512, 128) if cuda else (48, 12)
    args.num_blocks = 4096 if cuda else 256
    loaded = load_model(model, device=device)
    dtype = next(loaded.model.parameters()).dtype
    print(f"# loaded {model} on {device} ({dtype})", flush=True)
    records: list[dict] = []
    parts = set(args.parts.split(","))
    if "blocks" in parts:
        blocks_figure(loaded, device, args, records)
    if "beam" in parts:
        beam_figure(loaded, device, dtype, args, records)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
