"""End to end through real processes: router, prefill and decode over a real nats-server.

Greedy parity against the contiguous-KV reference, concurrency, every block returned, the
decode-only path, cancellation and vanished clients.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
import torch
from factories import make_engine, run, run_outputs
from support import PARITY_LENGTHS, assert_pools_free, prompt_of, worker_beats

from tandem.client import Client, connect
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.reference import reference_generate, reference_logits
from tandem.shared.protocol.serving import SamplingParams

PREFILL_CHUNK = 32
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["ring", "nats"], ids=["kv-via-shm-ring", "kv-via-nats-frames"])
def system(request, start_system):
    """Prefill hands KV to decode through decode's shared-memory ring, or (ring off) as NATS frames."""
    ring = [] if request.param == "ring" else ["--kv-ring-mib", "0"]
    system = start_system(
        prefill=1, decode=1,
        prefill_args=["--max-num-batched-tokens", str(PREFILL_CHUNK)],
        decode_args=["--num-blocks", "400", *ring],
    )
    system.kv_path = request.param
    yield system
    system.stop_all()  # the other path's system must not share the bus with this one


async def test_greedy_parity_through_disaggregated_path(system, tiny):
    prompts = [prompt_of(n, salt=i) for i, n in enumerate(PARITY_LENGTHS)]
    async with connect(system.url) as client:
        results = await asyncio.gather(*(
            client.complete(p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in prompts
        ))
    mismatches = []
    for prompt, result in zip(prompts, results):
        assert result.prompt_token_ids == tiny.tokenizer.encode(prompt)
        expected, _ = reference_generate(tiny.model, result.prompt_token_ids, NEW_TOKENS)
        if result.token_ids != list(expected):
            mismatches.append((len(result.prompt_token_ids), result.token_ids, list(expected)))
        assert result.finish_reason == "length"
    assert not mismatches, f"token ids differ from the contiguous reference (len, got, want): {mismatches}"


async def test_hand_offs_took_the_expected_path(system):
    async with connect(system.url) as client:
        await client.complete(prompt_of(40), max_tokens=3, temperature=0.0, ignore_eos=True)
    (beat,) = [b for i, b in (await worker_beats(system.url)).items() if i.startswith("decode")]
    used = {"ring": beat.kv_transfers_ring, "nats": beat.kv_transfers_nats}
    assert used[system.kv_path] > 0 and sum(used.values()) == used[system.kv_path], f"hand-offs by path: {used}"


async def test_64_concurrent_requests_complete_and_free_every_block(system):
    async with connect(system.url) as client:
        results = await asyncio.gather(*(
            client.complete(prompt_of(20 + 3 * i, salt=i), max_tokens=16, temperature=0.8, seed=i, ignore_eos=True)
            for i in range(64)
        ))
    assert all(r.finish_reason == "length" and len(r.token_ids) == 16 for r in results), \
        [(r.finish_reason, len(r.token_ids)) for r in results if r.finish_reason != "length"]
    await assert_pools_free(system.url)


async def test_seeded_sampling_is_reproducible_across_workers(system):
    async with connect(system.url) as client:
        a = await client.complete(prompt_of(40), max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
        b = await client.complete(prompt_of(40), max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids, "the same seed must give the same tokens"


async def test_stream_chunks_arrive_in_order_and_join_to_completion(system):
    async with connect(system.url) as client:
        chunks = [c async for c in client.generate(prompt_of(33), max_tokens=20, temperature=0.0, ignore_eos=True)]
        whole = await client.complete(prompt_of(33), max_tokens=20, temperature=0.0, ignore_eos=True)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


async def test_breaking_out_of_a_stream_cancels_it(system):
    async with connect(system.url) as client:
        seen = 0
        async for chunk in client.generate(prompt_of(50), max_tokens=1500, temperature=0.0, ignore_eos=True):
            seen += len(chunk.token_ids)
            if seen >= 3:
                break
    await assert_pools_free(system.url)


async def test_vanished_client_leaks_nothing(system):
    nc = await nats.connect(system.url)
    client = Client(nc)
    stream = client.generate(prompt_of(60), max_tokens=1500, temperature=0.0, ignore_eos=True)
    await stream.__anext__()
    await nc.close()  # gone without a word: no cancel is sent, so the workers' probes must notice
    await assert_pools_free(system.url, timeout_s=15)



async def test_stop_string_ends_output_before_it(system):
    params = dict(max_tokens=40, temperature=0.9, seed=11, ignore_eos=True)
    async with connect(system.url) as client:
        free = await client.complete(prompt_of(24), **params)
        start = next(i for i in range(3, len(free.text) - 1)
                     if all(c.isascii() and c.isprintable() for c in free.text[i : i + 2]))
        stop = free.text[start : start + 2]
        stopped = await client.complete(prompt_of(24), stop=[stop], **params)
    assert stopped.finish_reason == "stop", f"{stop!r} in {free.text!r} did not stop generation"
    assert stopped.text == free.text[: free.text.index(stop)], "text must end right before the stop string"
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)], "same seed, same tokens up to the stop"


async def test_penalties_and_prompt_logprobs_through_prefill_and_decode(system, tiny):
    """The prefill worker samples token 0 and scores the prompt, the decode worker goes on with
    token 0 in the penalties' history: the tokens of one in-process engine, the prompt's logprobs
    of a full forward."""
    params = dict(max_tokens=16, temperature=0.8, seed=5, min_tokens=16, repetition_penalty=1.4,
                  frequency_penalty=0.6, presence_penalty=0.3, logit_bias=[[32, 2.0]])
    async with connect(system.url) as client:
        result = await client.complete(prompt_of(45), prompt_logprobs=2, **params)
    assert result.prefill_worker is not None, "the prompt should have gone through the prefill worker"
    ids = result.prompt_token_ids
    local = run(make_engine(tiny, budget=PREFILL_CHUNK), [EngineRequest("r", ids, SamplingParams(**params))])["r"]
    assert result.token_ids == local.tokens
    expected = torch.log_softmax(reference_logits(tiny.model, ids), dim=-1)
    entries = result.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry.logprob == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-4)
        assert [value for _, value in entry.top] == pytest.approx(expected[position - 1].topk(2).values.tolist(),
                                                                 abs=1e-4)



@pytest.mark.parametrize("params", [
    dict(n=3, temperature=1.5, seed=21),
    dict(n=2, best_of=4, temperature=1.5, seed=21),
    dict(beam_width=3, n=2),
], ids=["n", "best_of", "beams"])
async def test_several_outputs_through_prefill_and_decode(system, tiny, params):
    """The prefill worker computes the prompt once and samples nothing; the decode worker imports
    its K/V and samples every output (forks sharing the prompt's blocks): the outputs of one
    in-process engine, best first, and every block back afterwards."""
    params = dict(max_tokens=12, ignore_eos=True, **params)
    async with connect(system.url) as client:
        result = await client.complete(prompt_of(45), **params)
    assert result.prefill_worker is not None, "the prompt should have gone through the prefill worker"
    local = run_outputs(make_engine(tiny, budget=PREFILL_CHUNK),
                        [EngineRequest("r", result.prompt_token_ids, SamplingParams(**params))])["r"]
    ranked = sorted(local.samples, key=lambda i: -local.cumulative_logprobs[i])
    assert [o.token_ids for o in result.outputs] == [local.samples[i].tokens for i in ranked]
    assert [o.cumulative_logprob for o in result.outputs] == pytest.approx(
        [local.cumulative_logprobs[i] for i in ranked], abs=1e-4)
    await assert_pools_free(system.url)
