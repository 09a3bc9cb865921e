"""Block snapshots (services/common/block_snapshot.py) on a real engine: block states, block tables, and
how many leading blocks came from the prefix cache or an import; taken on the engine thread.

Run: ``python3 -m pytest -q tests/unit/console/test_console_blocks.py``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from factories import greedy, make_engine

from tandem.services.common.block_snapshot import CACHED, FREE, IN_USE, SHARED, take_snapshot
from tandem.services.common.engine_thread import EngineThread
from tandem.shared.engine.engine import LLMEngine
from tandem.shared.engine.engine_view import KVPoolView, SequenceView
from tandem.shared.engine.sequence import EngineRequest

BS = 16
PREFIX = list(range(1, 41))  # 40 tokens: 2 full blocks and 8 tokens


def engine_of(tiny, num_blocks: int = 32) -> LLMEngine:
    return make_engine(tiny, block_size=BS, num_blocks=num_blocks, budget=256, max_model_len=512)


def finish(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_states_and_prefix_cached_blocks(tiny):
    engine = engine_of(tiny)
    engine.add_request(EngineRequest("warm", PREFIX, greedy(1)))
    finish(engine)
    snap = take_snapshot(engine, "w")
    assert snap.states.count(CACHED) == 2 and snap.states.count(IN_USE) == 0 and snap.sequences == []
    engine.add_request(EngineRequest("a", PREFIX + [50] * 10, greedy(20)))
    engine.add_request(EngineRequest("b", PREFIX + [60] * 30, greedy(20)))
    engine.step()
    snap = take_snapshot(engine, "w")
    seqs = {s.request_id: s for s in snap.sequences}
    assert (seqs["a"].prefix_cached_blocks, seqs["a"].imported_blocks) == (2, 0)
    assert (seqs["b"].prefix_cached_blocks, seqs["b"].imported_blocks) == (2, 0)
    assert seqs["a"].block_table[:2] == seqs["b"].block_table[:2], "both claim the cached prefix"
    for block in seqs["a"].block_table[:2]:
        assert snap.states[block] == SHARED
    own = set(seqs["a"].block_table[2:]) | set(seqs["b"].block_table[2:])
    assert all(snap.states[b] == IN_USE for b in own)
    assert list(snap.ref_counts) == [b.ref_count for b in engine.block_manager.blocks], "every block's ref count"
    assert [snap.ref_counts[b] for b in seqs["a"].block_table[:2]] == [2, 2]
    assert snap.cow_copies == getattr(engine.block_manager, "num_cow_copies", 0)
    assert snap.states.count(FREE) + snap.states.count(CACHED) == engine.block_manager.num_free_blocks
    assert (snap.num_blocks, snap.block_size, len(snap.states)) == (32, BS, 32)
    engine.scheduler.preempt(engine.scheduler.requests["b"])  # recompute: nothing is cached or imported any more
    seq = engine.scheduler.requests["b"]
    assert (seq.prefix_cached_blocks, seq.imported_blocks) == (0, 0)


def test_imported_blocks_of_a_hand_off(tiny):
    prefill = engine_of(tiny)
    prefill.add_request(EngineRequest("h", PREFIX, greedy(8), prefill_only=True))
    outputs = []
    while prefill.has_unfinished():
        outputs += prefill.step()
    out = next(o for o in outputs if o.finished)
    decode = engine_of(tiny)
    decode.add_request(EngineRequest("h", PREFIX, greedy(8), kv=out.kv.cpu(), output_token_ids=out.new_token_ids))
    decode.step()
    seq = take_snapshot(decode, "d").sequences[0]
    assert (seq.prefix_cached_blocks, seq.imported_blocks) == (0, 3), "the prompt's 3 blocks came with the hand-off"
    finish(decode)
    decode.add_request(EngineRequest("h2", PREFIX, greedy(8), kv=out.kv.cpu(), output_token_ids=out.new_token_ids))
    decode.step()
    seq = take_snapshot(decode, "d").sequences[0]
    assert (seq.prefix_cached_blocks, seq.imported_blocks) == (2, 1), "the full blocks are cached here now"


def test_copy_on_write_copies_are_counted(tiny):
    """The block manager's counter of blocks copied because a forked table wrote into a shared one."""
    engine = engine_of(tiny)
    engine.block_manager.num_cow_copies = 7  # as forked samples' writes would have left it
    assert take_snapshot(engine, "w").cow_copies == 7


def test_ref_counts_saturate_and_samples_are_named():
    """A block every sample of 300 requests shares shows 255; a request's outputs keep their index."""
    pool = KVPoolView(num_blocks=4, block_size=BS, ref_counts=(0, 1, 2, 300), cached=(False,) * 4, cow_copies=0)
    sequences = [SequenceView(request_id="r", sample_index=i, status="running", num_tokens=20, num_output_tokens=4,
                              block_table=(1, 3), prefix_cached_blocks=0, imported_blocks=0) for i in range(2)]
    engine = SimpleNamespace(kv_pool=lambda: pool, sequences=lambda limit=None: sequences[:limit])  # an EngineView
    snap = take_snapshot(engine, "w")
    assert list(snap.ref_counts) == [0, 1, 2, 255] and list(snap.states) == [FREE, IN_USE, SHARED, SHARED]
    assert [s.sample_index for s in snap.sequences] == [0, 1] and snap.cow_copies == 0


async def test_snapshot_on_the_engine_thread_while_it_steps(tiny):
    engine = engine_of(tiny, num_blocks=64)
    loop = asyncio.get_running_loop()
    thread = EngineThread(engine, loop, lambda outputs: None, lambda ids, exc: None)
    thread.start()
    try:
        await thread.add(EngineRequest("long", PREFIX, greedy(400)))
        sizes = []
        for _ in range(5):
            snap = await thread.call(lambda e: take_snapshot(e, "t"))
            if snap.sequences and snap.sequences[0].block_table:  # (still waiting: no blocks yet)
                seq = snap.sequences[0]
                assert len(seq.block_table) * BS >= seq.num_tokens - 1, "the table covers every computed token"
                assert snap.states.count(IN_USE) == len(seq.block_table)
                sizes.append(seq.num_tokens)
            await asyncio.sleep(0.05)
        assert sizes and sizes == sorted(sizes), f"the sequence grows between snapshots: {sizes}"
        with pytest.raises(ZeroDivisionError):
            await thread.call(lambda e: 1 / 0)
    finally:
        thread.abort("long")
        await loop.run_in_executor(None, thread.stop)
