"""Embedding requests in the engine (``EngineRequest.pooling``) against a plain full forward.

The reference is the contiguous-cache model (``shared/model/reference.py``): its final norm's
output over the whole prompt, pooled (last row, or mean of the rows), L2-normalised, truncated to
``dimensions`` and normalised again. The engine's vector must equal it in one chunk and across chunk
boundaries, beside generating requests (whose tokens must not change, overlapped steps and
deferred text included), with prefix caching on (last-token pooling claims a cached prefix, mean
pooling cannot), across a preemption in the middle of the prompt (by recompute and by swap), and
every block must be free at the end.
"""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, make_prompts, make_request, mixed_requests, run

from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.sequence import EngineRequest, RequestOutput
from tandem.shared.kvcache.swap_space import GIB
from tandem.shared.model.reference import reference_hidden_states
from tandem.shared.protocol.embedding import PoolingParams

TOLERANCE = 1e-5  # fp32 on the CPU: the paged path and the reference agree this closely
METHODS = ["last", "mean"]
BUDGETS = pytest.mark.parametrize("budget", [1000, 16, 7], ids=["one-chunk", "16-token-chunks", "7-token-chunks"])


def expected_vector(tiny, prompt: list[int], method: str, dimensions: int | None = None) -> torch.Tensor:
    hidden = reference_hidden_states(tiny.model, prompt)
    pooled = hidden[-1] if method == "last" else hidden.mean(0)
    pooled = torch.nn.functional.normalize(pooled, dim=0)
    return pooled if dimensions is None else torch.nn.functional.normalize(pooled[:dimensions], dim=0)


def embedding(request_id: str, prompt: list[int], method: str, dimensions: int | None = None) -> EngineRequest:
    return EngineRequest(request_id, list(prompt), pooling=PoolingParams(method=method, dimensions=dimensions))


def assert_all_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks), "a block is still referenced"


def embed(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, RequestOutput]:
    """Step until done; each embedding reports exactly once, ending it, with no token or text."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in outputs, f"{out.request_id} reported twice"
            outputs[out.request_id] = out
    assert_all_free(engine)
    for out in outputs.values():
        assert out.finished and out.finish_reason == "embedded", f"{out.request_id}: {out.finish_reason}"
        assert out.new_token_ids == [] and out.text_delta == "" and out.num_output_tokens == 0
    return outputs


def check_vector(tiny, out: RequestOutput, prompt: list[int], method: str, dimensions: int | None = None) -> None:
    want = expected_vector(tiny, prompt, method, dimensions)
    got = out.embedding
    assert got is not None and got.dtype == torch.float32 and got.device.type == "cpu"
    assert got.shape == want.shape, f"{out.request_id}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=TOLERANCE, rtol=0), \
        f"{out.request_id}: differs from the reference by {(got - want).abs().max().item():.2e}"
    assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert out.num_prompt_tokens == len(prompt)


@BUDGETS
@pytest.mark.parametrize("method", METHODS)
def test_an_embedding_equals_the_pooled_reference_forward(tiny, method: str, budget: int) -> None:
    """Every prompt length on and around block edges (a one-token prompt too), in one batch."""
    prompts = make_prompts()
    outputs = embed(make_engine(tiny, budget=budget),
                    [embedding(f"e{len(p)}", p, method) for p in prompts])
    for prompt in prompts:
        check_vector(tiny, outputs[f"e{len(prompt)}"], prompt, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dimensions", [1, 16, 255, 256])
def test_dimensions_keep_the_leading_components_normalised_again(tiny, method: str, dimensions: int) -> None:
    prompt = make_prompts()[8]
    out = embed(make_engine(tiny, budget=16), [embedding("d", prompt, method, dimensions)])["d"]
    check_vector(tiny, out, prompt, method, dimensions)


def test_methods_differ_and_identical_inputs_agree(tiny) -> None:
    prompt = make_prompts()[9]
    outputs = embed(make_engine(tiny), [embedding("a", prompt, "last"), embedding("b", prompt, "last"),
                                         embedding("m", prompt, "mean")])
    assert torch.equal(outputs["a"].embedding, outputs["b"].embedding)
    assert not torch.allclose(outputs["a"].embedding, outputs["m"].embedding, atol=1e-3)


@pytest.mark.parametrize(("overlap", "async_output"), [(False, False), (True, True)], ids=["plain", "overlapped"])
@pytest.mark.parametrize("budget", [1000, 40], ids=["whole-prompts", "chunked"])
def test_embeddings_ride_beside_generation_and_change_none_of_its_tokens(tiny, overlap: bool, async_output: bool,
                                                                         budget: int) -> None:
    """Generation alone, then the same requests with embeddings joining at the start and mid-way:
    the generated tokens, texts and reasons are the same, the vectors the reference's, some step
    mixes an embedding's prefill with generating rows, and (overlapped) steps were still overlapped."""
    config = dict(budget=budget, overlap_steps=overlap, async_output=async_output)
    alone = run(make_engine(tiny, **config), mixed_requests())

    engine = make_engine(tiny, **config)
    mixed_steps = []
    launch = engine.runner.launch

    def noting(batch):
        kinds = {item.seq.pooling is not None for item in batch.items}
        mixed_steps.append(kinds == {True, False})
        return launch(batch)

    engine.runner.launch = noting
    prompts = make_prompts()
    early = [embedding(f"early-{m}", prompts[10], m) for m in METHODS]
    late = [embedding(f"late-{m}", prompts[7], m) for m in METHODS]
    for request in mixed_requests() + early:
        engine.add_request(request)
    generated: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    reasons: dict[str, str] = {}
    vectors: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            for request in late:
                engine.add_request(request)
        for out in engine.step():
            if out.embedding is not None or out.finish_reason == "embedded":
                assert out.request_id not in vectors
                vectors[out.request_id] = out
                continue
            generated.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert_all_free(engine)
    for request_id, expected in alone.items():
        assert generated[request_id] == expected.tokens, f"{request_id}: tokens changed beside embeddings"
        assert texts[request_id] == expected.text, f"{request_id}: text changed beside embeddings"
        assert reasons[request_id] == expected.finish_reason
    for request in early + late:
        check_vector(tiny, vectors[request.request_id], request.prompt_token_ids, request.pooling.method)
    assert any(mixed_steps), "no step mixed an embedding with generation: the test checks nothing"
    if overlap:
        assert engine.num_overlapped_steps > 0, "no step was overlapped"


def test_prefix_caching_serves_last_token_pooling_and_not_mean(tiny) -> None:
    """A generated prompt's cached blocks give last-token pooling its prefix (the last row is computed
    here); mean pooling claims none (every row goes into its vector); both equal the reference, and an
    embedding's own blocks are cached for the requests after it."""
    prompts = make_prompts()
    prompt = prompts[10]  # 47 tokens: two full blocks to cache
    engine = make_engine(tiny, caching=True)
    run(engine, [make_request("g", prompt, 2)])
    hits = engine.stats()["prefix_cache_hits"]
    check_vector(tiny, embed(engine, [embedding("last", prompt, "last")])["last"], prompt, "last")
    assert engine.stats()["prefix_cache_hits"] == hits + 32, "last-token pooling did not claim the cached prefix"
    check_vector(tiny, embed(engine, [embedding("mean", prompt, "mean")])["mean"], prompt, "mean")
    assert engine.stats()["prefix_cache_hits"] == hits + 32, "mean pooling claimed a cached prefix"
    other = prompts[9]  # never computed before: the embedding's blocks are the first to hold it
    embed(engine, [embedding("fresh", other, "mean")])
    hits = engine.stats()["prefix_cache_hits"]
    run(engine, [make_request("after", other, 2)])
    assert engine.stats()["prefix_cache_hits"] > hits, "an embedding's computed blocks were not cached"
    assert_all_free(engine)


SWAP_GIB = 64 * (4 * 2 * 16 * 4 * 32 * 4) / GIB  # 64 host blocks of the tiny model (float32)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_embedding_preempted_mid_prompt_equals_the_reference(tiny, method: str, mode: str) -> None:
    """Six blocks, two tokens a step: the decoding A outgrows the pool while the embedding's 47-token
    prompt is part computed, so it (the youngest) is preempted, then recomputed from the start or
    swapped back in where it stopped."""
    prompts = make_prompts()
    engine = make_engine(tiny, num_blocks=6, budget=2, preemption_mode=mode,
                         swap_space_gib=SWAP_GIB if mode == "swap" else 0)
    preempted = []
    preempt = engine.scheduler.preempt

    def note(seq):
        preempted.append((seq.request_id, seq.num_computed_tokens))
        preempt(seq)

    engine.scheduler.preempt = note
    outputs = {}
    engine.add_request(make_request("A", prompts[8], 40))
    engine.add_request(embedding("B", prompts[10], method))
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert_all_free(engine)
    assert [name for name, _ in preempted] == ["B"], preempted
    assert 0 < preempted[0][1] < len(prompts[10]), "it was not preempted in the middle of its prompt"
    assert engine.stats()["swaps" if mode == "swap" else "recomputes"] == 1
    (out,) = outputs["B"]
    check_vector(tiny, out, prompts[10], method)


def test_an_aborted_embedding_frees_its_blocks_and_reports_no_vector(tiny) -> None:
    engine = make_engine(tiny, budget=7)
    engine.add_request(embedding("x", make_prompts()[10], "mean"))
    engine.step()
    assert engine.stats()["free_blocks"] < engine.stats()["num_blocks"]
    assert engine.abort("x")
    (out,) = engine.step()
    assert out.finish_reason == "abort" and out.embedding is None
    assert not engine.has_unfinished()
    assert_all_free(engine)


def test_a_prompt_may_fill_the_whole_context(tiny) -> None:
    """An embedding generates nothing: a prompt of max_model_len tokens is taken (a generation
    request's must leave room for one token)."""
    engine = make_engine(tiny, max_model_len=64)
    prompt = [(7 * i) % 256 for i in range(64)]
    check_vector(tiny, embed(engine, [embedding("full", prompt, "mean")])["full"], prompt, "mean")


@pytest.mark.parametrize(("change", "message"), [
    (dict(prompt_token_ids=[]), "must not be empty"),
    (dict(prompt_token_ids=list(range(65))), "max_model_len is 64"),
    (dict(prompt_token_ids=[1, 2, 999]), "token ids must be in"),
    (dict(pooling=PoolingParams(method="mean", dimensions=257)), "hidden size is 256"),
    (dict(pooling=PoolingParams(method=None)), "pooling method must be one of"),
    (dict(output_token_ids=[5]), "no KV, output tokens"),
    (dict(prefill_only=True), "no KV, output tokens"),
    (dict(kv=torch.zeros(1)), "no KV, output tokens"),
], ids=["empty", "too-long", "outside-vocabulary", "too-many-dimensions", "unresolved-method", "output-tokens",
        "prefill-only", "kv"])
def test_an_embedding_the_engine_cannot_serve_is_refused(tiny, change: dict, message: str) -> None:
    engine = make_engine(tiny, max_model_len=64)
    fields = dict(request_id="bad", prompt_token_ids=[1, 2, 3], pooling=PoolingParams(method="last"))
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest(**{**fields, **change}))
    assert not engine.has_unfinished()
    assert_all_free(engine)
