"""The decode fast path on the GPU: the split-K decode kernel, CUDA graphs, overlapped steps.

Its CPU twins (fused projections, random presets) are tests/unit/model/test_presets_and_fusion.py.
These check the split-K decode kernel against the gather path over long contexts and every split size, and that a
replayed decode graph computes the same logits as the eager forward on the same cache, and that
overlapped steps (the next graph fed by the last one's ids on the device) give the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.kvcache.attention import build_attention_metadata, gather_paged_attention
from tandem.shared.kvcache.cache import allocate_kv_cache
from tandem.shared.kvcache.triton_attention import HAS_TRITON
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("partition", [None, 64, 128, 512])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(32, 8), (8, 8), (16, 1)])
def test_decode_kernel_matches_gather(dtype: torch.dtype, partition: int | None, num_q_heads: int,
                                      num_kv_heads: int) -> None:
    from tandem.shared.kvcache.triton_decode import triton_decode_attention

    torch.manual_seed(0)
    block_size, head_dim, contexts = 16, 128, [1, 15, 16, 17, 63, 64, 65, 700, 2000]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 4
    cache = allocate_kv_cache(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype, "cuda")
    cache.normal_()
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for c in contexts:
        n = -(-c // block_size)
        tables.append(order[used : used + n])
        used += n
    meta = build_attention_metadata([1] * len(contexts), contexts, tables, block_size, "cuda")
    q = torch.randn(len(contexts), num_q_heads, head_dim, device="cuda", dtype=dtype)
    out = triton_decode_attention(q, cache, 1, meta.block_tables, meta.context_lens, 2048, 0.088, partition)
    reference = gather_paged_attention(q.float(), cache.float(), 1, meta, 0.088)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_decode_graph_matches_eager_forward(batch: int) -> None:
    loaded = load_model("random:llama-test", device="cuda", dtype=torch.float32)
    config = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=32, max_num_batched_tokens=2048,
                          max_model_len=512, enable_prefix_caching=False, overlap_steps=False)  # no step left in flight
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, "cuda")
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.sizes[-1] == 32
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = list(range(300 + i, 300 + i + 20 + 13 * i))
        engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
    for _ in range(5):  # prefill, then a few graph decode steps
        engine.step()
    batch_now = engine.scheduler.schedule()
    assert all(item.num_query_tokens == 1 for item in batch_now.items), "expected a pure decode step"
    graph_logits = runner._run_decode_graph(batch_now).clone()
    input_ids, positions, meta = runner.prepare(batch_now)
    hidden = runner.model(input_ids, positions, runner.kv_cache, meta)
    eager_logits = runner.model.compute_logits(hidden)
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_cuda_forward_matches_module_forward(dtype: torch.dtype) -> None:
    fused, plain = (load_model("random:llama-test", device="cuda", dtype=dtype).model for _ in range(2))
    fused.fuse_projections()
    assert fused._can_fuse(torch.zeros(1, device="cuda")) and not plain._can_fuse(torch.zeros(1, device="cuda"))
    cfg = fused.config
    caches = [allocate_kv_cache(16, cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype, "cuda")
              for _ in range(2)]
    steps = [(list(range(300, 340)) + list(range(500, 530)), [40, 30], [40, 30]), ([7, 9], [1, 1], [41, 31])]
    for ids, query_lens, context_lens in steps:
        meta = build_attention_metadata(query_lens, context_lens, [[0, 1, 2, 3], [4, 5, 6, 7]], 16, "cuda")
        positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)]).cuda()
        ids_t = torch.tensor(ids, device="cuda")
        out_fused = fused(ids_t, positions, caches[0], meta)
        out_plain = plain(ids_t, positions, caches[1], meta)
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out_fused.float(), out_plain.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(caches[0].float(), caches[1].float(), atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@requires_cuda
def test_overlapped_graph_steps_give_the_same_tokens() -> None:
    """The device-fed graph path of engine/overlap.py: same tokens and finish reasons as stepping
    one at a time, over greedy and seeded rows, stop tokens and rows ending at different steps."""
    loaded = load_model("random:llama-test", device="cuda", dtype=torch.float32)

    def generate(overlap: bool) -> tuple[dict, int]:
        config = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=2048,
                              max_model_len=512, enable_prefix_caching=False, overlap_steps=overlap)
        engine = LLMEngine(loaded.model, loaded.tokenizer, config, "cuda")
        assert engine.runner.graphs is not None
        for i in range(24):
            params = SamplingParams(max_tokens=20 + 7 * (i % 5), temperature=0.0 if i % 3 else 0.8, seed=i,
                                    top_k=50, ignore_eos=True, stop_token_ids=[7 + i] if i % 4 == 0 else [])
            prompt = list(range(300 + 5 * i, 300 + 5 * i + 10 + 9 * i))
            engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
        out: dict[str, tuple[list[int], str | None]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                tokens, _ = out.get(o.request_id, ([], None))
                out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        return out, engine.num_overlapped_steps

    plain, none = generate(False)
    overlapped, count = generate(True)
    assert none == 0 and count > 20, f"{count} steps overlapped"
    for request_id, expected in plain.items():
        assert overlapped[request_id] == expected, f"{request_id}: overlapped steps differ"


@pytest.mark.gpu
@requires_cuda
def test_logprobs_with_graphs_overlap_and_async_output_match_log_softmax() -> None:
    """Logprobs copied to pinned memory with the ids (graphs, overlapped steps, async output all on,
    the CUDA defaults) equal ``log_softmax`` of the contiguous reference's logits, and rows without
    logprobs get the tokens they get in a batch where no row asks."""
    from tandem.shared.model.reference import reference_logits

    loaded = load_model("random:llama-test", device="cuda", dtype=torch.float32)

    def generate(with_logprobs: bool) -> tuple[dict, int]:
        config = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=2048,
                              max_model_len=512, enable_prefix_caching=False)
        engine = LLMEngine(loaded.model, loaded.tokenizer, config, "cuda")
        assert engine.runner.graphs is not None and engine.overlap_steps and engine.async_output
        for i in range(12):
            params = SamplingParams(max_tokens=16 + 3 * (i % 4), temperature=0.0 if i % 3 else 0.8, seed=i, top_k=50,
                                    ignore_eos=True, logprobs=(i % 4) * 2 if with_logprobs and i % 2 == 0 else None)
            prompt = list(range(300 + 5 * i, 300 + 5 * i + 10 + 7 * i))
            engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
        out: dict[str, tuple[list[int], list, list[int], SamplingParams]] = {}
        requests = {r.request_id: r for r in engine.scheduler.requests.values()}
        while engine.has_unfinished():
            for o in engine.step():
                seq = requests[o.request_id]
                tokens, entries, _, _ = out.get(o.request_id, ([], [], seq.token_ids[:seq.num_prompt_tokens],
                                                                 seq.params))
                out[o.request_id] = (tokens + o.new_token_ids, entries + (o.logprobs or []),
                                     seq.token_ids[:seq.num_prompt_tokens], seq.params)
        return out, engine.num_overlapped_steps

    plain, _ = generate(False)
    asked, overlapped = generate(True)
    assert overlapped > 10
    for request_id, (tokens, entries, prompt, params) in asked.items():
        assert tokens == plain[request_id][0], f"{request_id}: logprobs changed the tokens"
        if params.logprobs is None:
            assert entries == []
            continue
        assert len(entries) == len(tokens)
        expected = torch.log_softmax(reference_logits(loaded.model, prompt + tokens[:-1])[len(prompt) - 1:], dim=-1)
        for token, entry, row in zip(tokens, entries, expected):
            assert entry.logprob == pytest.approx(row[token].item(), abs=2e-3)
            assert len(entry.top) == params.logprobs
            assert [v for _, v in entry.top] == pytest.approx(row.topk(params.logprobs).values.tolist(), abs=2e-3)


@pytest.mark.gpu
@requires_cuda
def test_logits_processing_and_prompt_logprobs_with_graphs_overlap_and_async_output() -> None:
    """With the CUDA defaults on (graphs, overlapped steps, async output), every token of rows with
    penalties, min_tokens and logit_bias is what the sampler draws from ``process_logits`` of its
    step's raw logits recomputed on the CPU (so the device's batched processing, its one upload and
    the histories it reads are right), and prompt logprobs (copied to pinned memory across prefill
    chunks) equal ``log_softmax`` of the contiguous reference's logits."""
    from factories import make_sequence, record_logits

    from tandem.shared.engine.logits_processors import process_logits
    from tandem.shared.engine.sampling import sample
    from tandem.shared.model.reference import reference_logits

    loaded = load_model("random:llama-test", device="cuda", dtype=torch.float32)
    config = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=64,
                          max_model_len=512, enable_prefix_caching=True)
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, "cuda")
    assert engine.runner.graphs is not None and engine.overlap_steps and engine.async_output
    raw = record_logits(engine)
    kinds = [
        dict(repetition_penalty=1.5), dict(frequency_penalty=0.8, presence_penalty=0.4), dict(min_tokens=12),
        dict(logit_bias=[(11, 4.0), (300, -5.0)]), dict(repetition_penalty=0.7, logit_bias=[(5, 2.0)]), {},
    ]
    requests = []
    for i in range(18):
        params = SamplingParams(max_tokens=12 + i % 5, temperature=0.0 if i % 3 else 0.8, seed=i, top_k=50,
                                stop_token_ids=[7 + i], prompt_logprobs=3 if i % 4 == 0 else None, **kinds[i % 6])
        prompt = [(37 * i + 11 * j) % 400 for j in range(10 + 9 * i)]  # repeats, for the penalties to count
        requests.append(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
        engine.add_request(requests[-1])
    out: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].append(o)
    eos = engine.runner.eos_token_ids
    for request in requests:
        params, prompt = request.params, request.prompt_token_ids
        tokens = [t for o in out[request.request_id] for t in o.new_token_ids]
        for index, token in enumerate(tokens):
            seq = make_sequence(request.request_id, prompt=prompt + tokens[:index])
            seq.num_prompt_tokens = len(prompt)
            processed = process_logits(raw[(request.request_id, index)].cpu()[None], [params], [seq], [index], eos)
            # Sampled on the GPU again: a seeded row's noise comes from a CUDA generator.
            expected = sample(processed.cuda(), [params], [index]).item()
            assert token == expected, f"{request.request_id}: token {index} is not drawn from the processed logits"
        assert len(tokens) >= params.min_tokens
        first = out[request.request_id][0].prompt_logprobs
        if params.prompt_logprobs is None:
            assert first is None
            continue
        expected = torch.log_softmax(reference_logits(loaded.model, prompt), dim=-1)
        assert len(first) == len(prompt) and first[0] is None
        for position, entry in enumerate(first[1:], start=1):
            assert entry.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=2e-3)
            assert [v for _, v in entry.top] == pytest.approx(expected[position - 1].topk(3).values.tolist(), abs=2e-3)
