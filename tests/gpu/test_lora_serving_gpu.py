"""LoRA adapters on the GPU: the Triton products inside decode CUDA graphs (each row's slot a graph
input) and the segmented kernel in prefill, with overlapped steps. A mixed batch of three adapters
and no-adapter rows in float32 equals ``peft``'s logits on the CPU (its CPU twin is
tests/unit/lora/test_lora_serving.py, to 1e-5); graphs equal eager decoding token for token; in bf16
the tokens of each adapter's rows equal those of the same engine run with that adapter alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from lora_support import ALL_TARGETS, peft_logits, served_adapters

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CONFIG = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=128,
                      max_loras=3, max_lora_rank=16)
ADAPTERS = {"all-r8": (8, ALL_TARGETS, 1), "attn-r4": (4, ["q_proj", "v_proj", "o_proj"], 2),
            "mlp-r16": (16, ["gate_proj", "up_proj", "down_proj"], 3)}
NAMES = [None, "all-r8", "attn-r4", "mlp-r16", "all-r8", None, "mlp-r16", "attn-r4", "all-r8", None]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_adapters(tmp_path_factory.mktemp("lora-gpu"), ADAPTERS)


def prompts() -> list[list[int]]:
    return [[(3 * i + 7 * j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(len(NAMES))]


def run(engine: LLMEngine, refs: dict, names: list, max_tokens: int = 12) -> tuple[dict, dict]:
    seen: dict[str, list[torch.Tensor]] = {}
    sample_async = engine.runner.sample_async

    def recording(pending, bitmask=None):  # noqa: ANN001
        for row, seq in enumerate(pending.seqs):
            seen.setdefault(seq.request_id, []).append(pending.logits[row].float().cpu())
        return sample_async(pending, bitmask)

    engine.runner.sample_async = recording
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, (prompt, name) in enumerate(zip(prompts(), names)):
        engine.add_request(EngineRequest(f"r{i}", prompt, params, adapter=None if name is None else refs[name]))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, seen


@pytest.mark.gpu
@requires_cuda
def test_mixed_adapters_with_graphs_match_peft(served) -> None:
    hf_model, base_dir, refs = served
    loaded = load_model(str(base_dir), device="cuda", dtype=torch.float32)
    engine = LLMEngine(loaded.model, loaded.tokenizer, CONFIG, "cuda")
    assert engine.runner.graphs is not None and engine.overlap_steps, "graphs and overlap should be on"
    tokens, logits = run(engine, refs, NAMES)
    eager = LLMEngine(loaded.model, loaded.tokenizer, dataclasses.replace(CONFIG, enforce_eager=True), "cuda")
    eager_tokens, _ = run(eager, refs, NAMES)
    assert tokens == eager_tokens, "decode graphs and eager decoding disagree"
    for i, (prompt, name) in enumerate(zip(prompts(), NAMES)):
        rid = f"r{i}"
        expected = peft_logits(hf_model, None if name is None else Path(refs[name].path), prompt + tokens[rid])
        rows = expected[len(prompt) - 1 : len(prompt) - 1 + len(logits[rid])]
        error = (torch.stack(logits[rid]) - rows).abs().max().item()
        assert error < 2e-3, f"{rid} ({name}): max |logit - peft's| = {error:.2e} on the GPU"


@pytest.mark.gpu
@requires_cuda
def test_bf16_rows_do_not_depend_on_their_neighbours_adapters(served) -> None:
    """Each adapter's rows decode to the same tokens whether the batch mixes adapters or not (the
    kernels never read another row's adapter)."""
    _, base_dir, refs = served
    loaded = load_model(str(base_dir), device="cuda", dtype=torch.bfloat16)
    mixed, _ = run(LLMEngine(loaded.model, loaded.tokenizer, CONFIG, "cuda"), refs, NAMES)
    for name in ADAPTERS:
        alone_names = [n if n == name else name for n in NAMES]  # every row this adapter
        alone, _ = run(LLMEngine(loaded.model, loaded.tokenizer, CONFIG, "cuda"), refs, alone_names)
        for i, n in enumerate(NAMES):
            if n == name:
                assert mixed[f"r{i}"][:4] == alone[f"r{i}"][:4], f"r{i} ({name}) differs beside other adapters"
