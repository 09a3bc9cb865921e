"""What services may read of an engine (shared/engine/engine_view.py), checked against the engine's
own parts on the tiny model: the stats' keys, the running request ids, the sequences in queue order
(running, waiting, swapped) with their blocks, the KV pool's blocks, the KV block layout; and that
``LLMEngine`` offers everything ``EngineView`` names.

Run: ``python3 -m pytest -q tests/unit/engine/test_engine_view.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from factories import greedy, make_engine, make_prompts, make_request

from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.engine_view import EngineStats, EngineView
from tandem.shared.protocol.serving import SamplingParams

BLOCK_BYTES = 4 * 2 * 16 * 4 * 32 * 4  # the tiny model's block: 4 layers, K and V, 16 tokens, 4 x 32, float32


def step_until(engine: LLMEngine, done, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise AssertionError(f"the engine did not get there in {limit} steps")


def test_llm_engine_offers_every_name_of_the_view(tiny) -> None:
    engine = make_engine(tiny)
    names = {name for name in vars(EngineView) if not name.startswith("_")} | set(EngineView.__annotations__)
    missing = sorted(name for name in names if not hasattr(engine, name))
    assert not missing, f"LLMEngine lacks {missing}, which EngineView promises the services"


def test_stats_carry_exactly_the_named_figures(tiny) -> None:
    assert set(make_engine(tiny).stats()) == set(EngineStats.__annotations__), \
        "LLMEngine.stats() and EngineStats name different figures: change both together"


def test_sequences_and_running_ids_follow_the_queues(tiny) -> None:
    engine = make_engine(tiny, max_seqs=2)
    for i, prompt in enumerate(make_prompts()[:4]):
        engine.add_request(make_request(f"r{i}", prompt, max_tokens=6))
    engine.step()
    views = engine.sequences()
    assert [v.request_id for v in views] == [s.request_id for s in [*engine.scheduler.running,
                                                                     *engine.scheduler.waiting]]
    assert [v.status for v in views] == ["running", "running", "waiting", "waiting"]
    assert engine.running_request_ids() == ["r0", "r1"]
    for view, seq in zip(views, [*engine.scheduler.running, *engine.scheduler.waiting]):
        assert view.block_table == tuple(seq.block_table), f"{view.request_id}'s block table"
        assert (view.num_tokens, view.num_output_tokens) == (seq.num_tokens, seq.num_output_tokens)
    assert all(not v.block_table for v in views if v.status == "waiting"), "a waiting sequence holds no blocks"
    assert [v.request_id for v in engine.sequences(limit=3)] == ["r0", "r1", "r2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        views[0].num_tokens = 0
    step_until(engine, lambda: not engine.has_unfinished())
    assert engine.sequences() == [] and engine.running_request_ids() == []


def test_a_request_with_several_outputs_runs_once_in_the_ids(tiny) -> None:
    engine = make_engine(tiny)
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    engine.add_request(make_request("g", make_prompts()[0], params=params))
    engine.add_request(make_request("solo", make_prompts()[1], max_tokens=6))
    step_until(engine, lambda: len(engine.sequences()) == 4)
    assert engine.running_request_ids() == ["g", "solo"]
    assert sorted(v.sample_index for v in engine.sequences() if v.request_id == "g") == [0, 1, 2]


def test_swapped_sequences_come_last_with_no_device_blocks(tiny) -> None:
    engine = make_engine(tiny, num_blocks=8, budget=64, swap_space_gib=64 * BLOCK_BYTES / 2**30,
                         preemption_mode="swap")
    for i, prompt in enumerate(make_prompts()):
        engine.add_request(make_request(f"r{i}", prompt, max_tokens=24 + 2 * i))
    step_until(engine, lambda: engine.stats()["swapped"] > 0)
    statuses = [v.status for v in engine.sequences()]
    order = {"running": 0, "waiting": 1, "swapped": 2}
    assert statuses == sorted(statuses, key=order.__getitem__), "running, then waiting, then swapped"
    swapped = [v for v in engine.sequences() if v.status == "swapped"]
    assert len(swapped) == engine.stats()["swapped"] and all(not v.block_table for v in swapped)
    step_until(engine, lambda: not engine.has_unfinished(), limit=2000)


def test_kv_pool_shows_every_block(tiny) -> None:
    engine = make_engine(tiny, caching=True)
    prompt = list(range(1, 41))  # two full blocks and a part
    engine.add_request(make_request("warm", prompt, max_tokens=1))
    step_until(engine, lambda: not engine.has_unfinished())
    engine.add_request(make_request("a", prompt + [50] * 5, max_tokens=8))
    engine.add_request(make_request("b", prompt + [60] * 5, max_tokens=8))
    engine.step()
    pool, stats = engine.kv_pool(), engine.stats()
    blocks = engine.block_manager.blocks
    assert pool.ref_counts == tuple(block.ref_count for block in blocks)
    assert pool.cached == tuple(block.block_hash is not None for block in blocks)
    assert (pool.num_blocks, pool.block_size) == (stats["num_blocks"], engine.config.block_size)
    assert pool.ref_counts.count(0) == stats["free_blocks"]
    assert sum(1 for refs, cached in zip(pool.ref_counts, pool.cached) if cached and not refs) == stats["cached_blocks"]
    shared = [refs for refs in pool.ref_counts if refs > 1]
    assert shared == [2, 2], "a and b share the two cached prefix blocks"
    assert pool.cow_copies == stats["cow_copies"]


def test_kv_layout_is_the_shape_of_an_exported_block(tiny) -> None:
    engine = make_engine(tiny)
    engine.add_request(make_request("p", make_prompts()[0], params=greedy(4), prefill_only=True))
    kvs = []
    while engine.has_unfinished():
        kvs += [out.kv for out in engine.step() if out.kv is not None]
    assert len(kvs) == 1, "a prefill-only request hands its K/V off once"
    assert tuple(kvs[0].shape[1:]) == engine.kv_layout, "kv_layout is one block of a hand-off's kv"
