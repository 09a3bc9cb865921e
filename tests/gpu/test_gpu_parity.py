"""CUDA, bf16: the engine (Triton paged attention) and the full disaggregated path against the
contiguous-KV reference run in bf16 on the same GPU.

bf16 rounding differs between the paged kernel and the reference's SDPA, so a near-tie can flip a
greedy token; the bar is token-exact on at least 19 of 20 prompts (a divergence where the
reference's top two logits are within one bf16 ulp counts as exact: bf16 cannot order them), and
at every step up to the first divergence the engine's logits as close to the float32 model's (the
same weights, teacher-forced on the same tokens) as ERROR_RATIO times the bf16 reference's own
error there. A fixed fraction of the row's largest logit was the bar before: the tiny model's
training on the GPU was not deterministic then, and on some trainings both bf16 paths were that far
from each other (0.47 against 0.36) while neither was wrong; against float32 each path's error is
measured, not guessed. The training now runs with PyTorch's deterministic kernels, so a machine
trains the same model on every run and a failure reproduces.
The model is the tiny architecture trained for a few hundred steps (transformers, on this
machine's Python standard library sources) and saved as a Hugging Face directory: a random model's
logits are so flat that its top-2 gaps fall below bf16's resolution at many steps (measured: 9 of
20 prompts token-exact through the bus, with every divergence at a near-tie), so greedy decoding
in bf16 is ill-defined there, unlike for a trained model.
Run: ``python -m pytest -m gpu tests/gpu/test_gpu_parity.py -s``.
"""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest
import torch
from factories import record_logits
from support import PARITY_LENGTHS, prompt_of

from tandem.client import connect
from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.loader import build_random_model, load_model, save_hf_checkpoint
from tandem.shared.model.reference import reference_generate, reference_logits
from tandem.shared.protocol.serving import SamplingParams
from tandem.shared.train.determinism import deterministic_kernels, fix_cublas_workspace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 16
MIN_EXACT = 19
# The engine's largest logit error against float32 over the bf16 reference's at the same step.
# Measured: worst 2.1 on the CPU bf16 path, 2.76 on an H200 (2026-12-04, 20 prompts x 16 steps, with
# and without overlap); two bf16 paths with different reduction orders land anywhere within a few
# times each other's error. Below a floor of two bf16 ulps of the row's largest logit both are
# rounding of the last matmul alone. A wrong kernel is off by a whole logit, far past this.
ERROR_RATIO = 4.0
TRAIN_STEPS, TRAIN_BATCH, TRAIN_SEQ = 400, 32, 256


def stdlib_bytes(limit: int = 4 << 20) -> bytes:
    """Python source every machine has: the standard library."""
    chunks, size = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(chunks)


def train_tiny(directory: Path, device: str = "cuda", steps: int = TRAIN_STEPS) -> None:
    """A few hundred AdamW steps of the tiny model on stdlib source, in transformers."""
    transformers = pytest.importorskip("transformers")
    config = ModelConfig.tiny()
    save_hf_checkpoint(build_random_model(config), config, directory)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).to(device).train()
    data = torch.frombuffer(bytearray(stdlib_bytes()), dtype=torch.uint8).long().to(device)
    optimizer = torch.optim.AdamW(hf.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator(device=device).manual_seed(0)
    fix_cublas_workspace()
    with deterministic_kernels(True):  # the same model on every run on a machine: a failure reproduces
        for _ in range(steps):
            starts = torch.randint(0, data.numel() - TRAIN_SEQ, (TRAIN_BATCH,), device=device, generator=generator)
            batch = data[starts[:, None] + torch.arange(TRAIN_SEQ, device=device)]
            loss = hf(input_ids=batch, labels=batch).loss  # transformers shifts the labels itself
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(f"\ntrained tiny model: final loss {loss.item():.6f}")
    model = build_random_model(config)
    missing, _ = model.load_state_dict({k: v.float().cpu() for k, v in hf.state_dict().items()}, strict=False)
    assert not missing, f"trained weights lack {missing}"
    save_hf_checkpoint(model, config, directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-trained")
    train_tiny(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_cuda(model_dir):
    return load_model(str(model_dir), device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_fp32(model_dir):
    """The same weights in float32: what both bf16 paths are measured against."""
    return load_model(str(model_dir), device="cuda", dtype=torch.float32)


def references(model, prompts: list[list[int]]) -> list[tuple[list[int], list[torch.Tensor]]]:
    return [reference_generate(model, p, NEW_TOKENS) for p in prompts]


def float32_rows(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Row ``j``: the float32 logits from which ``tokens[j]`` is chosen after ``prompt + tokens[:j]``."""
    return reference_logits(model, prompt + tokens[:-1])[len(prompt) - 1:].float().cpu()


def bf16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7) if value else 0.0


def matches_up_to_ties(got: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> bool:
    """Token-exact, or equal until a step where the reference's logit for our token is within one
    bf16 ulp of its top logit: bf16 cannot tell the two apart (the reference's own rounding is half
    an ulp), so both are its argmax; from there the contexts differ and nothing more is comparable."""
    for index, (token, ref_token) in enumerate(zip(got, ref_tokens)):
        if token != ref_token:
            row = ref_logits[index].float()
            top = row.max()
            ulp = 2.0 ** (torch.floor(torch.log2(top.abs())).item() - 7)  # bf16: 7 explicit mantissa bits
            return bool(top - row[token] <= ulp)
    return len(got) == len(ref_tokens)


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "overlapped"])
def test_engine_bf16_matches_reference(tiny_cuda, tiny_fp32, overlap: bool):
    config = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=32,
                          max_model_len=512, overlap_steps=overlap)
    engine = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, config, "cuda", torch.bfloat16)
    logged = record_logits(engine)
    prompts = [tiny_cuda.tokenizer.encode(prompt_of(n, salt=i)) for i, n in enumerate(PARITY_LENGTHS)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    exact, worst, margins, over, compared = 0, 0.0, [], [], 0
    for i, (ref_tokens, ref_logits) in enumerate(references(tiny_cuda.model, prompts)):
        got = tokens[f"p{i}"]
        exact += matches_up_to_ties(got, ref_tokens, ref_logits)
        truth = float32_rows(tiny_fp32.model, prompts[i], ref_tokens)
        for index, ref_row in enumerate(ref_logits):
            row = logged[(f"p{i}", index)].float().cpu()
            engine_error = (row - truth[index]).abs().max().item()
            reference_error = (ref_row.float().cpu() - truth[index]).abs().max().item()
            bound = ERROR_RATIO * max(reference_error, 2 * bf16_ulp(truth[index].abs().max().item()))
            worst, compared = max(worst, engine_error / bound), compared + 1
            if engine_error > bound:  # all of them are reported: one outlier and a wrong kernel read differently
                over.append(f"prompt {len(prompts[i])} step {index}: {engine_error:.4f} from float32's against the "
                            f"bf16 reference's {reference_error:.4f}")
            if got[index] != ref_tokens[index]:
                margins.append((truth[index][ref_tokens[index]] - truth[index][got[index]]).item())
                break  # the contexts differ from here on
    print(f"\nengine bf16 on CUDA: {exact}/{len(prompts)} token-exact up to bf16 ties, "
          f"worst logit error {worst:.2f} of its bound ({ERROR_RATIO:g}x the bf16 reference's against float32), "
          f"float32 margins between the two tokens where diverged: {[round(m, 4) for m in margins]}")
    assert not over, (f"{len(over)} of {compared} steps' logits are more than {ERROR_RATIO:g}x the bf16 "
                      f"reference's error from float32's: " + "; ".join(over[:5]))
    assert exact >= MIN_EXACT, f"only {exact} of {len(prompts)} prompts token-exact up to bf16 ties"


@pytest.fixture(scope="module")
def gpu_system(start_system, model_dir):
    """Router, prefill and decode sharing the GPU, and a KV-store: hand-offs through the pinned ring."""
    share = ["--device", "cuda", "--gpu-memory-utilization", "0.3"]
    # Prefill on the decode worker's own GPU, as asked: else the router prefills on decode (policy.py).
    return start_system(prefill=1, decode=1, kvstore=1, model_args=["--model", str(model_dir)],
                        prefill_args=[*share, "--max-num-batched-tokens", "32"], decode_args=share,
                        router_args=["--router-prefill-on-shared-device"])


def complete_all(url: str, texts: list[str]):
    async def run():
        async with connect(url) as client:
            return await asyncio.gather(*(
                client.complete(t, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for t in texts))

    return asyncio.run(run())


def test_full_disaggregated_path_bf16(gpu_system, tiny_cuda):
    texts = [prompt_of(n, salt=i) for i, n in enumerate(PARITY_LENGTHS)]
    results = complete_all(gpu_system.url, texts)
    expected = references(tiny_cuda.model, [r.prompt_token_ids for r in results])
    exact = sum(matches_up_to_ties(r.token_ids, ref, logits) for r, (ref, logits) in zip(results, expected))
    print(f"\nfull path bf16 on CUDA: {exact}/{len(texts)} token-exact up to bf16 ties")
    assert exact >= MIN_EXACT, f"only {exact} of {len(texts)} prompts token-exact through the bus"


def test_shared_prefixes_through_caches_and_store_bf16(gpu_system, tiny_cuda):
    """Prompts sharing a 64-token prefix, one after another: later ones reuse cached blocks on the
    prefill and decode workers (the KV-store holds them too); outputs stay those of the reference."""
    prefix = prompt_of(64, salt=5)
    texts = [prefix + prompt_of(n, salt=50 + n) for n in (3, 16, 17, 40)]
    results = [complete_all(gpu_system.url, [t])[0] for t in texts]
    expected = references(tiny_cuda.model, [r.prompt_token_ids for r in results])
    exact = sum(matches_up_to_ties(r.token_ids, ref, logits) for r, (ref, logits) in zip(results, expected))
    print(f"\nshared prefixes bf16 on CUDA: {exact}/{len(texts)} token-exact")
    assert exact >= len(texts) - 1, f"only {exact} of {len(texts)} shared-prefix prompts token-exact"
