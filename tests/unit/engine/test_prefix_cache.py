"""Prefix caching in the engine, on the tiny model (CPU, float32) against the contiguous-cache
reference: prompts that share whole blocks, share a prefix ending mid-block, are fully cached on a
block boundary or share nothing; eviction under a tiny pool with exact hits and KV events;
preemption; the prefill_only export from cached blocks and imported blocks becoming cacheable.
Every test checks exact token parity, exact hit counters and a pool of ref-0 blocks at the end."""

from __future__ import annotations

import random

import pytest
import torch
from factories import greedy, make_engine, record_logits, run

from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.reference import reference_generate
from tandem.shared.protocol.block_hashes import hash_block, prefix_hashes

BS = 16
_rng = random.Random(3)
BASE = [_rng.randrange(256) for _ in range(48)]
OTHER = [_rng.randrange(256) for _ in range(48)]
H0 = hash_block(None, BASE[:16])  # the chained hashes of BASE's first blocks
H1 = hash_block(H0, BASE[16:32])
G0 = hash_block(None, OTHER[:16])
G1 = hash_block(G0, OTHER[16:32])


def count_computed(engine: LLMEngine) -> list[int]:
    """Wrap the runner to count the query tokens it computes (a one-element list, updated in place)."""
    computed, launch = [0], engine.runner.launch

    def counting(batch):
        computed[0] += batch.num_batched_tokens
        return launch(batch)

    engine.runner.launch = counting
    return computed


_references: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}


def reference(tiny, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """``reference_generate``, memoized: several tests and engines check the same prompts."""
    key = (tuple(prompt), max_tokens)
    if key not in _references:
        _references[key] = reference_generate(tiny.model, prompt, max_tokens)
    return _references[key]


def check_parity(tiny, results, requests: list[EngineRequest], logged=None) -> None:
    for request in requests:
        ref_tokens, ref_logits = reference(tiny, request.prompt_token_ids, request.params.max_tokens)
        assert results[request.request_id].tokens == ref_tokens, f"{request.request_id} diverged from the reference"
        for index, ref_row in enumerate(ref_logits if logged is not None else []):
            row = logged[(request.request_id, index)]
            assert torch.allclose(row, ref_row, atol=1e-4, rtol=1e-4), f"logits of {request.request_id}[{index}]"


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks still allocated"
    assert all(block.ref_count == 0 for block in bm.blocks), "a block kept a reference"


# Followers of a seed request (BASE[:40], 8 tokens: 47 computed, so BASE's first 2 blocks cached).
FOLLOWERS = {
    "whole": (BASE[:32] + OTHER[:10], 32),  # shares both cached blocks
    "mid": (BASE[:20] + OTHER[:5], 16),  # the shared prefix ends mid-block: only the whole block counts
    "exact": (BASE[:32], 16),  # fully cached, 2 whole blocks: the last one is recomputed
    "seed-again": (BASE[:40], 32),
    "miss": (OTHER[:30], 0),
}


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_followers_match_reference_and_skip_cached_tokens(tiny, caching: bool) -> None:
    engine = make_engine(tiny, caching=caching)
    logged, computed = record_logits(engine), count_computed(engine)
    seed = [EngineRequest("seed", BASE[:40], greedy(8))]
    run(engine, seed)
    assert engine.drain_kv_events() == (([H0, H1], []) if caching else ([], [])), "the seed's 2 full blocks"
    assert engine.stats()["cached_blocks"] == (2 if caching else 0)
    followers = [EngineRequest(rid, prompt, greedy(6)) for rid, (prompt, _) in FOLLOWERS.items()]
    results = run(engine, followers)  # all admitted in one step: they can only hit the seed's blocks
    check_parity(tiny, results, followers, logged)
    stats = engine.stats()
    hits = sum(h for _, h in FOLLOWERS.values()) if caching else 0
    queries = 40 + sum(len(p) for p, _ in FOLLOWERS.values()) if caching else 0
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (queries, hits)
    every_token = sum(len(r.prompt_token_ids) + r.params.max_tokens - 1 for r in seed + followers)
    assert computed[0] == every_token - hits, "cached tokens must not be computed again"
    assert engine.drain_kv_events()[1] == [], "a roomy pool evicts nothing"
    assert_all_free(engine)


def test_eviction_under_a_tiny_pool_with_exact_hits_and_events(tiny) -> None:
    """4 blocks; A and B alternate. Each wave's lookup, eviction and events, derived by hand:
    - A (33 tokens, 1 out): blocks [0, 1, 2], caches H0 (0), H1 (1); freed -> free list [3, 2, 1, 0].
    - B (40 tokens, 1 out): no hit; takes 3, 2, 1 (evicting H1, the least recently freed cached
      block); caches G0 (3), G1 (2); freed -> [0, 1, 2, 3].
    - A again (4 out): hits H0 (block 0; H1 is gone): 16 tokens; takes 1, then 2 (evicting G1) and
      recomputes H1 into block 1; freed -> [3, 2, 1, 0].
    - B again: hits G0 (block 3): 16 tokens; takes 2, 1 (evicting H1) and recomputes G1 into block 2.
    """
    engine = make_engine(tiny, num_blocks=4)
    logged = record_logits(engine)
    waves = [
        (EngineRequest("a1", BASE[:33], greedy(1)), 0, ([H0, H1], [])),
        (EngineRequest("b1", OTHER[:40], greedy(1)), 0, ([G0, G1], [H1])),
        (EngineRequest("a2", BASE[:33], greedy(4)), 16, ([H1], [G1])),
        (EngineRequest("b2", OTHER[:40], greedy(1)), 16, ([G1], [H1])),
    ]
    hits = 0
    for request, wave_hits, events in waves:
        check_parity(tiny, run(engine, [request]), [request], logged)
        hits += wave_hits
        assert engine.stats()["prefix_cache_hits"] == hits, f"after {request.request_id}"
        assert engine.drain_kv_events() == events, f"events of {request.request_id}"
    assert engine.stats()["prefix_cache_queries"] == 33 + 40 + 33 + 40
    assert sorted(engine.block_manager.hash_to_block.items()) == sorted([(H0, 0), (G0, 3), (G1, 2)])
    assert engine.stats()["cached_blocks"] == 3
    assert_all_free(engine)


@pytest.mark.parametrize("num_blocks,budget", [(6, 24), (5, 40), (8, 7)],
                         ids=["tiny-pool", "tinier-pool", "small-chunks"])
def test_preemption_with_shared_prefixes_matches_reference(tiny, num_blocks: int, budget: int) -> None:
    prompts = [BASE[:n] + [i] for i, n in enumerate([15, 16, 31, 33, 40, 20, 47])] + [BASE[:32], OTHER[:17]]
    outcomes = {}
    for caching in (True, False):
        engine = make_engine(tiny, num_blocks=num_blocks, budget=budget, caching=caching)
        logged = record_logits(engine)
        requests = [EngineRequest(f"r{i}", p, greedy(10 + i % 5)) for i, p in enumerate(prompts)]
        results = run(engine, requests)
        check_parity(tiny, results, requests, logged)
        stats = engine.stats()
        assert (stats["prefix_cache_hits"] > 0) == caching, "shared prefixes and re-prefills should hit"
        assert stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
        assert_all_free(engine)
        outcomes[caching] = ({rid: r.tokens for rid, r in results.items()}, stats["preemptions"])
    assert outcomes[True][0] == outcomes[False][0], "the cache changed the outputs"
    if budget != 7:
        assert outcomes[True][1] > 0 and outcomes[False][1] > 0, "the small pool should have forced preemption"


def test_prefill_export_from_cache_and_imported_blocks_are_cacheable(tiny) -> None:
    prompt, params = BASE[:40], greedy(10)
    prefill = make_engine(tiny, num_blocks=16)
    first = run(prefill, [EngineRequest("p1", prompt, params, prefill_only=True)])["p1"]
    second = run(prefill, [EngineRequest("p2", prompt, params, prefill_only=True)])["p2"]
    assert prefill.stats()["prefix_cache_hits"] == 32, "p2's first two blocks come from the cache"
    assert first.finish_reason == second.finish_reason == "prefilled" and first.tokens == second.tokens
    assert torch.equal(second.kv[:2], first.kv[:2]), "cached blocks are exported as they are"
    assert torch.allclose(second.kv[2, :, :, :8], first.kv[2, :, :, :8], atol=1e-5), "the recomputed partial block"
    fresh = run(make_engine(tiny, num_blocks=16, caching=False),
                [EngineRequest("p", prompt, params, prefill_only=True)])
    for got, want in ((second.kv[:2], fresh["p"].kv[:2]), (second.kv[2, :, :, :8], fresh["p"].kv[2, :, :, :8])):
        assert torch.allclose(got, want, atol=1e-5), "the export differs from a cache-free prefill's"
    assert_all_free(prefill)

    decode = make_engine(tiny, num_blocks=16)
    handoff = EngineRequest("d1", prompt, params, kv=second.kv, output_token_ids=second.tokens)
    decode.add_request(handoff)
    decoded = [t for out in decode.step() for t in out.new_token_ids]
    assert decode.drain_kv_events() == ([H0, H1], []), "imported full blocks are hashed once scattered in"
    while decode.has_unfinished():
        decoded += [t for out in decode.step() for t in out.new_token_ids]
    assert second.tokens + decoded == reference(tiny, prompt, 10)[0], "the hand-off diverged"
    follower = EngineRequest("d2", BASE[:36], greedy(5))  # shares both imported blocks
    check_parity(tiny, run(decode, [follower]), [follower])
    assert decode.stats()["prefix_cache_hits"] == 32 and decode.stats()["prefix_cache_queries"] == 36
    assert_all_free(decode)


@pytest.mark.parametrize("prompt_len,blocks", [(50, 3), (49, 3), (48, 2), (33, 1), (40, 1)])
def test_prefix_import_matches_fresh_computation(tiny, prompt_len: int, blocks: int) -> None:
    """KV fetched from a KV-store (whole blocks before the last prompt token) continues exactly."""
    prompt = (BASE + OTHER)[:prompt_len]
    donor = make_engine(tiny)
    exported = run(donor, [EngineRequest("src", prompt, greedy(2), prefill_only=True)])["src"].kv
    engine = make_engine(tiny)
    computed = count_computed(engine)
    results = run(engine, [EngineRequest("imp", prompt, greedy(6), kv=exported[:blocks].clone())])
    expected, _ = reference(tiny, prompt, 6)
    assert results["imp"].tokens == expected, f"{blocks} imported blocks of a {prompt_len}-token prompt diverged"
    # The uncached rest of the prompt, then one token per later output: nothing imported is recomputed.
    assert computed[0] == prompt_len - blocks * BS + 5, f"computed {computed[0]} tokens"
    assert_all_free(engine)


@pytest.mark.parametrize("prompt_len,blocks,resumed", [(50, 3, 2), (48, 3, 1), (33, 1, 4)])
def test_a_migrated_request_continues_exactly_from_a_prefix_import(tiny, prompt_len: int, blocks: int,
                                                                    resumed: int) -> None:
    """A migrated request comes back with the tokens its client already streamed and a KV-store's
    leading prompt blocks: the rest of the prompt and the resumed tokens are computed, and it goes
    on with the tokens it would have given, none of the imported ones computed again."""
    prompt = (BASE + OTHER)[:prompt_len]
    expected, _ = reference(tiny, prompt, 6)
    donor = make_engine(tiny)
    exported = run(donor, [EngineRequest("src", prompt, greedy(2), prefill_only=True)])["src"].kv
    engine = make_engine(tiny)
    computed = count_computed(engine)
    migrated = EngineRequest("mig", prompt, greedy(6), kv=exported[:blocks].clone(),
                             output_token_ids=expected[:resumed])
    results = run(engine, [migrated])
    assert expected[:resumed] + results["mig"].tokens == expected, (
        f"a migrated request with {resumed} resumed tokens and {blocks} imported blocks diverged")
    assert computed[0] == prompt_len - blocks * BS + 5, f"computed {computed[0]} tokens"
    assert_all_free(engine)


@pytest.mark.parametrize("prompt_len,outputs,blocks,taken", [
    (48, 1, 3, True),  # a hand-off: the prompt and the outputs but the last
    (50, 2, 2, True),  # a prefix of whole prompt blocks
    (48, 1, 4, False),  # past the hand-off's 3 blocks
    (40, 10, 3, False),  # past the prompt's 2 whole blocks, short of the hand-off's 4
])
def test_kv_with_output_tokens_is_a_whole_hand_off_or_a_prompt_prefix(tiny, prompt_len: int, outputs: int,
                                                                       blocks: int, taken: bool) -> None:
    kv = torch.zeros(blocks, *make_engine(tiny).runner.kv_cache.shape[1:])
    request = EngineRequest("x", (BASE + OTHER)[:prompt_len], greedy(outputs + 2), kv=kv,
                            output_token_ids=[1] * outputs)
    if taken:
        make_engine(tiny).add_request(request)
    else:
        with pytest.raises(ValueError, match="a hand-off's .* or a prefix"):
            make_engine(tiny).add_request(request)


@pytest.mark.parametrize("prompt_len,blocks", [(48, 4), (33, 4), (20, 0)])
def test_an_import_without_sampled_tokens_covers_at_most_the_prompt(tiny, prompt_len: int, blocks: int) -> None:
    kv = torch.zeros(blocks, *make_engine(tiny).runner.kv_cache.shape[1:])
    with pytest.raises(ValueError, match="covers at most the prompt"):
        make_engine(tiny).add_request(EngineRequest("x", (BASE + OTHER)[:prompt_len], greedy(2), kv=kv))


@pytest.mark.parametrize("prompt_len", [32, 33, 47])
def test_a_whole_prompt_imported_without_a_token_recomputes_only_its_last(tiny, prompt_len: int) -> None:
    """How a request with several outputs is handed off: the whole prompt's K/V and no sampled
    token. The last prompt token is computed again (for logits to sample from), nothing else."""
    prompt = (BASE + OTHER)[:prompt_len]
    donor = run(make_engine(tiny, caching=False), [EngineRequest("p", prompt, greedy(2), prefill_only=True)])
    engine = make_engine(tiny)
    computed = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch: computed.append(batch.num_batched_tokens) or launch(batch)
    results = run(engine, [EngineRequest("imp", prompt, greedy(6), kv=donor["p"].kv)])
    expected, _ = reference(tiny, prompt, 6)
    assert results["imp"].tokens == expected
    assert computed[0] == 1, f"computed {computed[0]} tokens of an imported prompt"


def test_hand_offs_sharing_a_prefix_share_its_blocks_and_match_reference(tiny) -> None:
    """Two prompts with a common 32-token prefix, prefilled elsewhere and imported one after the
    other: the second shares the first's cached blocks instead of writing them again."""
    prompts = [BASE[:32] + OTHER[:10], BASE[:32] + OTHER[20:27]]
    donor = make_engine(tiny, caching=False)
    exports = run(donor, [EngineRequest(f"p{i}", p, greedy(2), prefill_only=True) for i, p in enumerate(prompts)])
    engine = make_engine(tiny)
    handoff = [EngineRequest(f"d{i}", p, greedy(6), kv=exports[f"p{i}"].kv, output_token_ids=exports[f"p{i}"].tokens)
               for i, p in enumerate(prompts)]
    results = run(engine, handoff[:1])
    cached = engine.block_manager.find_cached_prefix(prompts[1])
    assert len(cached) == 2, "the first hand-off's two shared prompt blocks stay cached"
    engine.add_request(handoff[1])
    outputs = engine.step()
    assert engine.scheduler.requests["d1"].block_table[:2] == cached, "the import shares the cached blocks"
    tokens = [t for out in outputs for t in out.new_token_ids]
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    for i, later in enumerate((results["d0"].tokens, tokens)):
        expected, _ = reference(tiny, prompts[i], 6)
        assert exports[f"p{i}"].tokens + later == expected, f"hand-off {i} diverged from the reference"
    assert_all_free(engine)


def test_export_on_finish_returns_every_full_computed_block(tiny) -> None:
    prompt = BASE[:20]
    engine = make_engine(tiny)
    engine.add_request(EngineRequest("e", prompt, greedy(30), export_on_finish=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    tokens = [t for out in outputs for t in out.new_token_ids]
    last = outputs[-1]
    computed = len(prompt) + len(tokens) - 1  # the last sampled token has no K/V yet
    assert last.kv is not None and last.kv.shape[0] == computed // BS == 3
    assert last.kv_hashes == prefix_hashes(prompt + tokens, BS)[:3]
    fresh = make_engine(tiny)
    exported = run(fresh, [EngineRequest("f", (prompt + tokens)[:49], greedy(2), prefill_only=True)])["f"].kv
    torch.testing.assert_close(last.kv, exported[:3], msg="exported blocks hold the sequence's K/V")
    assert_all_free(engine)
