"""Preemption by swap on the tiny model (CPU, float32): token-exact outputs and matching logits under
a pool small enough to preempt, with swapping forced, recompute forced and the cost rule choosing,
against a pool roomy enough never to preempt; what was swapped (stats, host blocks, blocks kept
shared); a full swap space falling back to recompute; an abort of a swapped sequence; blocks held
only by swapped sequences; the cost rule itself. Every run ends with every device block free (or
cached) and the swap space empty."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import greedy, make_engine, make_prompts, make_request, make_scheduler, make_sequence, record_logits, run

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.preemption_cost import PreemptionCosts
from tandem.shared.engine.sequence import SequenceStatus
from tandem.shared.engine.swapping import Swapper
from tandem.shared.kvcache.cache import kv_cache_bytes_per_block
from tandem.shared.kvcache.swap_space import GIB, SwapSpace
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.meta import PRESETS
from tandem.shared.protocol.serving import SamplingParams

BLOCK_BYTES = 4 * 2 * 16 * 4 * 32 * 4  # the tiny model's block: 4 layers, K and V, 16 tokens, 4 x 32, float32
TINY_POOL = dict(num_blocks=8, budget=64)  # 128 tokens for 11 sequences of up to 91: preempts often
SWAP_GIB = 64 * BLOCK_BYTES / GIB  # 64 host blocks: room for every victim


def workload() -> list:
    """Greedy and seeded sampling rows over prompts on and around block edges."""
    requests = []
    for i, prompt in enumerate(make_prompts()):
        params = (greedy(24 + 2 * i) if i % 2 else
                  SamplingParams(max_tokens=24 + 2 * i, temperature=1.0, top_k=40, seed=i, ignore_eos=True))
        requests.append(make_request(f"r{i}", prompt, params=params))
    return requests


def check_drained(engine: LLMEngine) -> None:
    """Nothing swapped and every block back: device blocks free (cached ones included), host blocks free."""
    stats = engine.stats()
    assert stats["swapped"] == 0 and not engine.scheduler.swapped
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)
    if engine.swap_space is not None:
        assert stats["free_swap_blocks"] == stats["swap_blocks"] and not engine.swap_space.holders
        assert not engine.scheduler.swapper.tables


_roomy: dict[bool, tuple[dict, dict]] = {}


def roomy_run(tiny, caching: bool) -> tuple[dict, dict]:
    """The workload's results and logits on a pool that never preempts (memoized)."""
    if caching not in _roomy:
        engine = make_engine(tiny, budget=64, caching=caching)
        logged = record_logits(engine)
        results = run(engine, workload())
        assert engine.stats()["preemptions"] == 0
        _roomy[caching] = results, logged
    return _roomy[caching]


def check_same_as_roomy(tiny, caching: bool, results: dict, logged: dict) -> None:
    expected, expected_logits = roomy_run(tiny, caching)
    for request_id, result in expected.items():
        assert results[request_id].tokens == result.tokens, f"{request_id} diverged"
        assert results[request_id].finish_reason == result.finish_reason
    assert logged.keys() == expected_logits.keys()
    for key, row in expected_logits.items():
        assert torch.allclose(logged[key], row, atol=1e-4, rtol=1e-4), f"logits of {key}"


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_tiny_pool_matches_roomy_pool(tiny, mode: str, caching: bool) -> None:
    engine = make_engine(tiny, **TINY_POOL, caching=caching, swap_space_gib=SWAP_GIB, preemption_mode=mode)
    logged = record_logits(engine)
    results = run(engine, workload())
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["swaps"] + stats["recomputes"] == stats["preemptions"]
    if mode == "swap":
        assert stats["swaps"] == stats["preemptions"], "every victim fits the swap space: every one swaps"
    elif mode == "recompute":
        assert stats["swaps"] == 0 and stats["swap_fallbacks"] == 0
    elif not caching:
        # Tiny model, CPU rates: a block copies out and back in ~13 us, a token recomputes in ~20 us.
        assert stats["swaps"] == stats["preemptions"]
    check_same_as_roomy(tiny, caching, results, logged)
    check_drained(engine)


def test_swapping_with_overlapped_steps_and_async_output(tiny) -> None:
    """Steps queued ahead (overlap.py) stop while a sequence is swapped: its swap-in is the scheduler's."""
    engine = make_engine(tiny, **TINY_POOL, caching=False, swap_space_gib=SWAP_GIB, preemption_mode="swap",
                         overlap_steps=True, async_output=True)
    logged = record_logits(engine)
    results = run(engine, workload())
    assert engine.stats()["swaps"] > 0 and engine.num_overlapped_steps > 0
    check_same_as_roomy(tiny, False, results, logged)
    check_drained(engine)


def test_auto_decides_each_victim_by_the_cost_rule(tiny) -> None:
    """With a copy rate at which a block out and back costs as much as recomputing 15 tokens, both
    kinds happen, each as the rule says (a victim of 28 tokens in 2 blocks recomputes, one of 32
    swaps)."""
    engine = make_engine(tiny, **TINY_POOL, caching=False, swap_space_gib=SWAP_GIB)
    costs = engine.preemption_costs
    rate = costs.swap_s(1) * costs.copy_bytes_per_s / costs.recompute_s(15)  # swap_s(1) == recompute_s(15)
    costs = dataclasses.replace(costs, copy_bytes_per_s=rate)
    engine.scheduler.swap_is_cheaper = costs.swap_is_cheaper
    decisions = []
    preempt = engine.scheduler.preempt

    def preempt_and_note(seq):
        tokens, blocks = seq.num_computed_tokens, -(-seq.num_computed_tokens // 16)
        swaps_before = engine.scheduler.num_swaps
        preempt(seq)
        decisions.append((tokens, blocks, engine.scheduler.num_swaps > swaps_before))

    engine.scheduler.preempt = preempt_and_note
    logged = record_logits(engine)
    results = run(engine, workload())
    assert {swapped for _, _, swapped in decisions} == {True, False}, decisions
    for tokens, blocks, swapped in decisions:
        assert swapped == costs.swap_is_cheaper(tokens, 0, blocks), (tokens, blocks, swapped)
    check_same_as_roomy(tiny, False, results, logged)
    check_drained(engine)


def test_a_full_swap_space_recomputes() -> None:
    """Swapping is chosen only when the swap space has room for the victim's private blocks."""
    scheduler = make_scheduler(num_blocks=4, budget=100, caching=False)
    scheduler.swapper = Swapper(scheduler.block_manager, SwapSpace(1, (1,), torch.float32))
    scheduler.preemption_mode = "swap"
    a, b = make_sequence("a", 4, arrival=0, max_tokens=12), make_sequence("b", 8, arrival=1, max_tokens=12)
    for seq in (a, b):
        scheduler.add(seq)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [1, 1])  # a: 1 block, b: 2 blocks, 1 free
    assert scheduler.swapper.can_swap_out(a) and not scheduler.swapper.can_swap_out(b)
    scheduler.preempt(b)
    assert b.status is SequenceStatus.WAITING and (scheduler.num_swaps, scheduler.num_recomputes) == (0, 1)
    scheduler.preempt(a)
    assert a.status is SequenceStatus.SWAPPED and scheduler.num_swaps == 1
    assert scheduler.swapper.swap_space.blocks_of(a) == [0] and a.block_table == []


def test_shared_prefix_blocks_stay_on_the_device(tiny) -> None:
    """Two requests claim one cached prompt prefix; the younger is swapped out: the shared blocks
    stay (it keeps its references) and are never copied, and the other's output is unchanged."""
    prefix = (make_prompts()[-1] + make_prompts()[-2])[:48]  # three full blocks
    first, second = [*prefix, 1, 2, 3, 4, 5], [*prefix, 9, 8, 7, 6, 5, 4, 3]
    roomy = make_engine(tiny)
    run(roomy, [make_request("warm", prefix + [0], 1)])
    expected = run(roomy, [make_request("a", first, 40), make_request("b", second, 40)])
    engine = make_engine(tiny, num_blocks=8, swap_space_gib=SWAP_GIB, preemption_mode="swap")
    run(engine, [make_request("warm", prefix + [0], 1)])
    shared = engine.block_manager.find_cached_prefix(prefix)
    assert len(shared) == 3
    swapper, seen = engine.scheduler.swapper, []
    swap_out = swapper.swap_out

    def swap_out_and_note(seq):
        table = list(seq.block_table)
        pairs = swap_out(seq)
        seen.append((seq.request_id, table, pairs, swapper.tables[seq]))
        return pairs

    swapper.swap_out = swap_out_and_note
    copied = []
    runner_swap_out = engine.runner.swap_out
    engine.runner.swap_out = lambda pairs: (copied.extend(pairs), runner_swap_out(pairs))
    results = run(engine, [make_request("a", first, 40), make_request("b", second, 40)])
    assert results["a"].tokens == expected["a"].tokens and results["b"].tokens == expected["b"].tokens
    assert seen and {request_id for request_id, *_ in seen} == {"b"}, "only the younger request is swapped"
    for _, table, pairs, swapped in seen:
        assert table[:3] == shared and {swapped.shared[i] for i in range(3)} == set(shared), "kept, not freed"
        assert not {device for device, _ in pairs} & set(shared), "a shared block was copied"
        assert swapped.cached and swapped.host, "b's own full blocks went back to the cache, its last to the host"
    assert copied and not {device for device, _ in copied} & set(shared)
    check_drained(engine)


def test_abort_of_a_swapped_sequence_frees_its_host_blocks(tiny) -> None:
    engine = make_engine(tiny, **TINY_POOL, caching=False, swap_space_gib=SWAP_GIB, preemption_mode="swap")
    for request in workload():
        engine.add_request(request)
    outputs = []
    while not engine.scheduler.swapped:
        outputs += engine.step()
    seq = engine.scheduler.swapped[0]
    space = engine.swap_space
    held = space.blocks_of(seq)
    assert held and seq.status is SequenceStatus.SWAPPED and not seq.block_table
    free_before = space.num_free_blocks
    assert engine.abort(seq.request_id)
    assert space.blocks_of(seq) == [] and space.num_free_blocks == free_before + len(held)
    assert seq not in engine.scheduler.swapped and seq not in engine.scheduler.swapper.tables
    while engine.has_unfinished():
        outputs += engine.step()
    ends = {out.request_id: out.finish_reason for out in outputs if out.finished}
    assert ends[seq.request_id] == "abort" and len(ends) == len(workload())
    check_drained(engine)


def test_blocks_held_only_by_swapped_sequences_never_block_the_pool() -> None:
    """b shares a's blocks (as a forked sample does) and is swapped, keeping them; a is recomputed.
    With nothing running, a cannot fit beside b's kept blocks: b is recomputed too, and both finish."""
    scheduler = make_scheduler(num_blocks=3, budget=100, caching=False)
    scheduler.swapper = Swapper(scheduler.block_manager, SwapSpace(4, (1,), torch.float32))
    a = make_sequence("a", 8, arrival=0, max_tokens=4)
    scheduler.add(a)
    scheduler.postprocess(scheduler.schedule(), [1])  # a: 9 tokens, blocks 0 and 1 computed
    b = make_sequence("b", 0, arrival=1, max_tokens=4, prompt=a.token_ids[:8])
    b.token_ids.append(2)
    b.block_table, b.num_computed_tokens, b.status = scheduler.block_manager.fork(a.block_table), 8, a.status
    scheduler.running.append(b)
    scheduler.requests[b.key] = b
    scheduler.preemption_mode = "swap"
    scheduler.preempt(b)
    assert scheduler.swapper.tables[b].shared == {0: a.block_table[0], 1: a.block_table[1]}
    scheduler.preemption_mode = "recompute"
    scheduler.preempt(a)
    assert scheduler.block_manager.num_free_blocks == 1, "b's references keep a's blocks"
    batch = scheduler.schedule()
    assert [item.seq for item in batch.items] == [a] and scheduler.num_swap_fallbacks == 1
    assert b.status is SequenceStatus.WAITING and not scheduler.swapper.tables
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [3] * sum(item.samples for item in batch.items))
    assert a.num_output_tokens == b.num_output_tokens == 4
    assert scheduler.block_manager.num_free_blocks == 3 and scheduler.swapper.swap_space.num_free_blocks == 4


def test_runner_copies_blocks_out_and_back_bit_exact(tiny) -> None:
    engine = make_engine(tiny, num_blocks=8, swap_space_gib=SWAP_GIB)
    runner = engine.runner
    runner.kv_cache.normal_()
    before = runner.kv_cache.clone()
    runner.swap_out([(1, 0), (2, 1), (5, 3)])  # two runs: blocks 1-2 to 0-1, block 5 to 3
    runner.kv_cache[[1, 2, 5]] = 0.0
    runner.swap_in([(6, 0), (7, 1), (3, 3)])
    assert torch.equal(runner.kv_cache[[6, 7, 3]], before[[1, 2, 5]])
    assert torch.equal(runner.kv_cache[[0, 4]], before[[0, 4]]), "other blocks untouched"


# ---------------------------------------------------------------- the cost rule

def costs_of(config: ModelConfig, dtype: torch.dtype, rates: tuple[float, float]) -> PreemptionCosts:
    block_bytes = kv_cache_bytes_per_block(config.num_layers, 16, config.num_kv_heads, config.head_dim, dtype)
    return PreemptionCosts.for_model(config, block_bytes, *rates)


def first_swap(costs: PreemptionCosts, up_to: int = 2048) -> int | None:
    """The fewest uncached tokens (in whole and partial blocks) that swap; checks that every longer
    sequence swaps too."""
    decisions = [costs.swap_is_cheaper(tokens, 0, -(-tokens // 16)) for tokens in range(1, up_to + 1)]
    if True not in decisions:
        return None
    crossover = decisions.index(True)
    assert all(decisions[crossover:]), "short recomputes, long swaps: one crossover"
    return crossover + 1


def test_short_sequences_recompute_and_long_ones_swap() -> None:
    # An 8B model on a GPU: ~14 GFLOP per token at 400 TFLOP/s against 2 MiB blocks at 25 GB/s.
    costs = costs_of(PRESETS["llama3-8b"], torch.bfloat16, (400e12, 25e9))
    assert costs.block_bytes == 2 << 20 and costs.flops_per_token == pytest.approx(2 * 6.98e9, rel=0.01)
    assert 2 <= first_swap(costs) <= 8
    assert not costs.swap_is_cheaper(0, 0, 0), "nothing to do either way: recompute, holding no host memory"
    assert not costs.swap_is_cheaper(0, 1000, 1), "nothing uncached to recompute: a copy costs more"
    assert not costs.swap_is_cheaper(4, 0, 1) and costs.swap_is_cheaper(4, 8000, 1), "attention over a cached context"
    # The tiny model: on a CPU its tokens cost more to recompute than its blocks to copy (swap from
    # the first token); on a GPU the copy costs more than any context it serves.
    assert first_swap(costs_of(ModelConfig.tiny(), torch.float32, (300e9, 10e9))) == 1
    assert first_swap(costs_of(ModelConfig.tiny(), torch.bfloat16, (400e12, 25e9))) is None


def test_engine_settings_name_the_modes() -> None:
    config = EngineConfig(num_blocks=4, swap_space_gib=0.5, preemption_mode="swap")
    assert (config.swap_space_gib, config.preemption_mode) == (0.5, "swap")
    assert EngineConfig(num_blocks=4).preemption_mode == "auto" and EngineConfig(num_blocks=4).swap_space_gib == 0
    with pytest.raises(ValueError):
        EngineConfig(num_blocks=4, preemption_mode="sometimes")
    with pytest.raises(ValueError):
        EngineConfig(num_blocks=4, swap_space_gib=-1)
