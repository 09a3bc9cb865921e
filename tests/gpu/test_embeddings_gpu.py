"""Embeddings on the GPU: pooled on the device, copied to pinned host memory behind an event, beside
generation with decode CUDA graphs, overlapped steps and deferred text on (their CPU twin:
tests/unit/engine/test_embedding_pooling.py). A one-token prompt is a one-token row like a decode row: it
must never be sent through a graph replay, which computes no hidden rows to pool."""

from __future__ import annotations

import pytest
import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.loader import load_model
from tandem.shared.model.reference import reference_hidden_states
from tandem.shared.protocol.embedding import PoolingParams
from tandem.shared.protocol.serving import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CONFIG = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPTS = [[(5 + 7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in (1, 16, 37, 90)]


def expected(model, prompt: list[int], method: str, dimensions: int | None) -> torch.Tensor:
    hidden = reference_hidden_states(model, prompt).float()
    pooled = torch.nn.functional.normalize(hidden[-1] if method == "last" else hidden.mean(0), dim=0)
    if dimensions is not None:
        pooled = torch.nn.functional.normalize(pooled[:dimensions], dim=0)
    return pooled.cpu()


def generate_alone(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny", device="cuda", dtype=torch.float32)


@pytest.mark.gpu
@requires_cuda
def test_embeddings_beside_graphed_overlapped_generation(tiny_cuda) -> None:
    generation = [EngineRequest(f"g{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    alone = generate_alone(LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, CONFIG, "cuda"), generation)

    engine = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, CONFIG, "cuda")
    assert engine.runner.graphs is not None and engine.overlap_steps and engine.async_output
    embeddings = [EngineRequest(f"e{n}-{method}-{dims}", prompt, pooling=PoolingParams(method=method, dimensions=dims))
                  for n, prompt in enumerate(PROMPTS) for method in ("last", "mean") for dims in (None, 32)]
    for request in generation:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, torch.Tensor] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps in (3, 12):  # join while decode steps run (overlapped between arrivals)
            for request in embeddings[: len(embeddings) // 2] if steps == 3 else embeddings[len(embeddings) // 2:]:
                engine.add_request(request)
        for out in engine.step():
            if out.finish_reason == "embedded":
                vectors[out.request_id] = out.embedding
            else:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.num_overlapped_steps > 0, "no step was overlapped"
    assert tokens == alone, "generation changed beside embeddings"
    for request in embeddings:
        got = vectors[request.request_id]
        assert got.device.type == "cpu" and got.is_pinned(), "the vector should land in pinned host memory"
        want = expected(tiny_cuda.model, request.prompt_token_ids, request.pooling.method, request.pooling.dimensions)
        assert torch.allclose(got, want, atol=1e-4, rtol=0), \
            f"{request.request_id}: {(got - want).abs().max().item():.2e} from the reference"


@pytest.mark.gpu
@requires_cuda
def test_bf16_embeddings_point_where_the_fp32_reference_does() -> None:
    bf16 = load_model("tiny", device="cuda", dtype=torch.bfloat16)
    fp32 = load_model("tiny", device="cuda", dtype=torch.float32)
    engine = LLMEngine(bf16.model, bf16.tokenizer, CONFIG, "cuda", torch.bfloat16)
    prompt = PROMPTS[3]
    for method in ("last", "mean"):
        engine.add_request(EngineRequest(method, prompt, pooling=PoolingParams(method=method)))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    for method in ("last", "mean"):
        vector = outputs[method].embedding
        cosine = torch.dot(vector, expected(fp32.model, prompt, method, None)).item()
        assert vector.dtype == torch.float32 and cosine > 0.99, f"{method}: cosine {cosine:.4f}"
