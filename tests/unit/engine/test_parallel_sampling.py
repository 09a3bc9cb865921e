"""Several outputs per request (n, best_of): the prompt computed once, its blocks shared through ref
counts, the partly filled last block copied on first write, each sample with its own randomness."""

from __future__ import annotations

import pytest
import torch
from factories import make_block_manager, make_engine, make_request, run, run_outputs

from tandem.shared.engine.sequence_group import candidate_seed
from tandem.shared.protocol.serving import SamplingParams


def sampled(max_tokens: int = 10, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.5, ignore_eos=True, **fields)


def prompt_of(length: int, offset: int = 3) -> list[int]:
    return [(offset + 7 * i) % 250 + 1 for i in range(length)]


def test_copy_on_write_keeps_the_original_for_the_other_holders() -> None:
    """The issue's example: three tables map logical block 0 to physical block 5 (ref count 3);
    sample 1 writes into it and gets a copy, samples 2 and 3 keep block 5 (ref count 2)."""
    manager = make_block_manager(num_blocks=16, block_size=4)
    manager.grow([], 0)
    other = []
    manager.grow(other, 20)  # blocks 0..4 are taken, so the prompt's block is 5
    parent: list[int] = []
    manager.grow(parent, 3)  # a 3-token prompt: one partly filled block
    samples = [parent, manager.fork(parent), manager.fork(parent)]
    assert samples == [[5], [5], [5]] and manager.blocks[5].ref_count == 3

    assert manager.copy_on_write(samples[0], 3) == (5, 6), "the writer gets a fresh block to copy into"
    assert samples == [[6], [5], [5]]
    assert manager.blocks[5].ref_count == 2 and manager.blocks[6].ref_count == 1
    assert manager.copy_on_write(samples[1], 3) == (5, 7)
    assert manager.copy_on_write(samples[2], 3) is None, "the last holder writes in place"
    assert samples == [[6], [7], [5]] and manager.num_cow_copies == 2
    for table in [*samples, other]:
        manager.free(table)
    assert manager.num_free_blocks == 16


def test_engine_copies_on_first_write_with_exact_block_ids(tiny) -> None:
    """The same through the engine, one decode row per step (budget 1) so that one sample's first
    write is seen alone; the copy holds the prompt's K/V."""
    engine = make_engine(tiny, caching=False)
    run(engine, [make_request("before", prompt_of(80, 11), max_tokens=1)])  # blocks 0..4 go to the free list's end
    engine.add_request(make_request("g", prompt_of(10), params=sampled(n=3, seed=1)))
    engine.step()  # the prompt's 10 tokens, then three first tokens from one set of logits
    group = engine.groups["g"]
    assert [seq.block_table for seq in group.live] == [[5], [5], [5]]
    assert engine.block_manager.blocks[5].ref_count == 3
    engine.scheduler.max_num_batched_tokens = 1
    engine.step()
    assert [seq.block_table for seq in group.live] == [[6], [5], [5]]
    assert engine.block_manager.blocks[5].ref_count == 2
    cache = engine.runner.kv_cache
    assert torch.equal(cache[6][:, :, :10], cache[5][:, :, :10]), "the copy holds the prompt's K/V"


@pytest.mark.parametrize("prompt_len", [5, 16, 17, 40])
@pytest.mark.parametrize("n", [2, 5])
def test_seeded_samples_match_independent_requests(tiny, prompt_len: int, n: int) -> None:
    """Sample i of a seeded request is token-exact with a lone request seeded
    ``candidate_seed(seed, i)``, with other requests in the batch or not (so copy-on-write copied
    the right K/V and each sample's randomness is its own)."""
    prompt = prompt_of(prompt_len)
    grouped = run_outputs(make_engine(tiny), [make_request("g", prompt, params=sampled(n=n, seed=42)),
                                              make_request("other", prompt_of(23, 5), params=sampled(seed=3))])
    lone = [run(make_engine(tiny), [make_request("s", prompt, params=sampled(seed=candidate_seed(42, i)))])["s"].tokens
            for i in range(n)]
    assert grouped["g"].tokens() == lone
    assert len({tuple(t) for t in lone}) == n, "the samples differ (their seeds do)"


def test_greedy_samples_all_equal_the_single_output(tiny) -> None:
    prompt = prompt_of(21)
    single = run(make_engine(tiny), [make_request("s", prompt, max_tokens=12)])["s"].tokens
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=3)
    assert run_outputs(make_engine(tiny), [make_request("g", prompt, params=params)])["g"].tokens() == [single] * 3


def test_best_of_returns_the_n_best_by_cumulative_logprob_at_the_end(tiny) -> None:
    prompt = prompt_of(19)
    lone = []
    for i in range(5):
        params = sampled(seed=candidate_seed(8, i), logprobs=0)
        engine = make_engine(tiny)
        engine.add_request(make_request("s", prompt, params=params))
        tokens, total = [], 0.0
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                total += sum(entry.logprob for entry in out.logprobs or [])
        lone.append((total, tokens))
    best = sorted(lone, key=lambda c: -c[0])[:2]

    engine = make_engine(tiny)
    engine.add_request(make_request("g", prompt, params=sampled(n=2, best_of=5, seed=8)))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [out.sample_index for out in outputs] == [0, 1], "held outputs come once each, at the end, ranked"
    assert all(out.finished for out in outputs) and [out.ends_request for out in outputs] == [False, True]
    assert [out.new_token_ids for out in outputs] == [tokens for _, tokens in best]
    assert [out.cumulative_logprob for out in outputs] == pytest.approx([total for total, _ in best], abs=1e-4)
    assert outputs[0].logprobs is None, "logprobs were not asked for"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_one_prompt_for_eight_samples_takes_the_blocks_of_one_plus_the_copies(tiny) -> None:
    """KV blocks in use: n = 8 shares the prompt's two full blocks and copies only the partly filled
    third (10 blocks), where 8 independent requests of the same prompt, all admitted at once, hold 24."""
    prompt = prompt_of(40)
    peak = {}

    def watch(name):
        def note(engine):
            stats = engine.stats()
            peak[name] = max(peak.get(name, 0), stats["num_blocks"] - stats["free_blocks"])
        return note

    run_outputs(make_engine(tiny, caching=False), [make_request("g", prompt, params=sampled(8, n=8, seed=2))],
                watch=watch("n=8"))
    run_outputs(make_engine(tiny, caching=False),
                [make_request(f"r{i}", prompt, params=sampled(8, seed=candidate_seed(2, i))) for i in range(8)],
                watch=watch("8 requests"))
    assert peak == {"n=8": 10, "8 requests": 24}


@pytest.mark.parametrize("params", [sampled(n=3, seed=4), sampled(n=2, best_of=4, seed=4),
                                    SamplingParams(max_tokens=10, beam_width=3, n=2)],
                         ids=["n", "best_of", "beams"])
def test_a_group_handed_off_continues_as_on_one_engine(tiny, params: SamplingParams) -> None:
    """A prefill worker computes a group's prompt and samples nothing; the decode worker imports its
    K/V, recomputes the last prompt token and samples every output: the same outputs as one engine."""
    prompt = prompt_of(37)
    whole = run_outputs(make_engine(tiny), [make_request("g", prompt, params=params)])["g"]
    prefill = run_outputs(make_engine(tiny), [make_request("g", prompt, params=params, prefill_only=True)])["g"]
    assert prefill.samples[0].tokens == [] and prefill.samples[0].finish_reason == "prefilled"
    kv = prefill.samples[0].kv
    assert kv is not None and kv.shape[0] == 3, "the whole prompt's blocks travel once"
    decoded = run_outputs(make_engine(tiny), [make_request("g", prompt, params=params, kv=kv.cpu())])["g"]
    assert decoded.tokens() == whole.tokens()
    assert decoded.cumulative_logprobs == pytest.approx(whole.cumulative_logprobs)


def test_groups_survive_preemption_token_exact(tiny) -> None:
    """A pool too small for every sample at once: samples are preempted (recomputed, their prompt
    blocks found again in the prefix cache) and still give the outputs of an ample pool."""
    requests = [make_request(f"g{i}", prompt_of(30, i), params=sampled(24, n=3, seed=i)) for i in range(3)]
    ample = run_outputs(make_engine(tiny), requests)
    small = make_engine(tiny, num_blocks=10)
    tight = run_outputs(small, [make_request(r.request_id, r.prompt_token_ids, params=r.params) for r in requests])
    assert small.stats()["preemptions"] > 0, "the pool was meant to run out"
    assert {k: v.tokens() for k, v in tight.items()} == {k: v.tokens() for k, v in ample.items()}


def test_abort_ends_every_output_and_frees_the_blocks(tiny) -> None:
    engine = make_engine(tiny)
    engine.add_request(make_request("g", prompt_of(33), params=sampled(50, n=4, seed=1)))
    for _ in range(3):
        engine.step()
    assert len(engine.groups["g"].live) == 4
    assert engine.abort("g")
    outputs = engine.step()
    assert [(o.finish_reason, o.ends_request) for o in outputs] == [("abort", True)]
    assert not engine.has_unfinished() and not engine.groups
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_output,overlap", [(True, False), (True, True), (False, True)])
def test_groups_beside_async_output_and_overlapped_steps(tiny, async_output: bool, overlap: bool) -> None:
    """Forked samples take part in overlapped steps once they go on alone (not the step that
    forks them, nor one whose write needs a copy first); the outputs are those of every engine
    option off."""
    requests = [make_request("g", prompt_of(20), params=sampled(12, n=3, seed=6)),
                make_request("plain", prompt_of(26, 9), params=sampled(30, seed=2))]
    plain = run_outputs(make_engine(tiny, async_output=False, overlap_steps=False), requests)
    engine = make_engine(tiny, async_output=async_output, overlap_steps=overlap)
    other = run_outputs(engine, [make_request(r.request_id, r.prompt_token_ids, params=r.params) for r in requests])
    assert {k: v.tokens() for k, v in other.items()} == {k: v.tokens() for k, v in plain.items()}
    assert (engine.num_overlapped_steps > 0) == overlap


def test_a_group_refuses_tokens_sampled_elsewhere(tiny) -> None:
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="several outputs"):
        engine.add_request(make_request("g", prompt_of(8), params=sampled(n=2), output_token_ids=[5]))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("params", [sampled(n=2, best_of=3, seed=4), SamplingParams(max_tokens=6, beam_width=2)],
                         ids=["best_of", "beams"])
def test_held_outputs_bring_the_prompt_logprobs_once(tiny, params: SamplingParams) -> None:
    engine = make_engine(tiny)
    engine.add_request(make_request("g", prompt_of(12), params=params.model_copy(update={"prompt_logprobs": 1})))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    entries = [out.prompt_logprobs for out in outputs]
    assert entries[0] is not None and len(entries[0]) == 12 and entries[0][0] is None
    assert all(e is None for e in entries[1:]), "only the request's first output carries them"
