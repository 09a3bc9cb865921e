"""Where a decode step's time goes: cProfile of the engine stepping a full batch of decodes.

    python benchmarks/decode_profile.py [--model random:llama3-8b] [--batch 256] [--steps 30]

Submits ``--batch`` random 1024-token prompts, steps until every one has its first token, then
profiles ``--steps`` pure decode steps and prints the mean step time (profiler included) and the
functions by own time. On CUDA the time spent in ``synchronize`` (``SampledTokens.wait``) or
``tolist`` is the host waiting for the device; the rest is host work, which overlapped steps
(``engine/overlap.py``) run while the device computes. Without CUDA it profiles ``random:llama-test`` on the CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from serving_gpu import make_engine, random_prompts, sync

from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kv-gib", type=float, default=60.0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("random:llama3-8b" if device.type == "cuda" else "random:llama-test")
    loaded = load_model(model, device=device)
    engine = make_engine(loaded, device, args.batch, 2048, False, args.kv_gib if device.type == "cuda" else 1.0)
    params = SamplingParams(max_tokens=args.steps + 10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.batch, 1024, loaded.config.vocab_size, 5)):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    sync(device)
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


if __name__ == "__main__":
    main()
