"""Several outputs per request on the GPU: forked samples and beams with decode CUDA graphs on, the
copy-on-write copies made on the device (their CPU twins: tests/unit/engine/test_parallel_sampling.py
and test_beam_search.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.engine.sequence_group import candidate_seed
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CONFIG = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512)


def outputs_of(engine: LLMEngine, request: EngineRequest) -> dict[int, list[int]]:
    engine.add_request(request)
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.sample_index, []).extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny", device="cuda", dtype=torch.float32)


@pytest.mark.gpu
@requires_cuda
def test_forked_samples_match_lone_requests_with_graphs(tiny_cuda) -> None:
    engine = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, CONFIG, "cuda")
    assert engine.runner.graphs is not None, "decode CUDA graphs should be on"
    prompt = [(5 + 7 * i) % 250 + 1 for i in range(37)]
    params = SamplingParams(max_tokens=24, temperature=1.5, seed=9, ignore_eos=True)
    grouped = outputs_of(engine, EngineRequest("g", prompt, params.model_copy(update={"n": 4})))
    lone = [outputs_of(engine, EngineRequest(f"s{i}", prompt, params.model_copy(update={"seed": candidate_seed(9, i)})))
            for i in range(4)]
    assert [grouped[i] for i in range(4)] == [next(iter(o.values())) for o in lone]
    assert engine.block_manager.num_cow_copies >= 3


@pytest.mark.gpu
@requires_cuda
def test_beam_search_on_the_gpu_matches_the_cpu(tiny_cuda) -> None:
    cpu = load_model("tiny", device="cpu", dtype=torch.float32)
    prompt = [(3 + 11 * i) % 250 + 1 for i in range(21)]
    params = SamplingParams(max_tokens=16, beam_width=4, n=2, ignore_eos=True)
    gpu_engine = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, CONFIG, "cuda")
    on_gpu = outputs_of(gpu_engine, EngineRequest("b", prompt, params))
    on_cpu = outputs_of(LLMEngine(cpu.model, cpu.tokenizer, CONFIG, "cpu"), EngineRequest("b", prompt, params))
    assert on_gpu == on_cpu
