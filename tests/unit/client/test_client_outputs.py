"""``tandem.client`` with several outputs per request, on real ``StreamChunk`` messages through the
session's real nats-server, the router played by the test (``scripted_router``): chunks interleaved
and out of order, held outputs arriving whole and ranked, an error ending every output, prompt
logprobs, and the one-output request reading as it always did.

Run: ``python3 -m pytest -q tests/unit/client/test_client_outputs.py``.
"""

from __future__ import annotations

import pytest
from scripted_router import PROBE, ScriptedRouter, chunk, entries, error_chunk

from tandem.client import Chunk, InvalidRequestError, RequestTimeoutError, WorkerFailureError
from tandem.shared.protocol.serving import TokenLogprobs


def three_samples(request):
    """Three outputs interleaved, each one's chunks out of order; output 1 ends last, after a pause."""
    return [
        chunk(request, 2, 1, [99], finish_reason="length", cumulative_logprob=-3.0),
        chunk(request, 0, 0, [97]),
        chunk(request, 1, 0, [98]),
        chunk(request, 2, 0, [99]),
        chunk(request, 0, 1, [97], finish_reason="stop", cumulative_logprob=-5.0),
        0.3,  # two outputs have ended: the stream must wait for the third
        chunk(request, 1, 1, [98, 98], finish_reason="length", cumulative_logprob=-1.0),
    ]


async def test_a_stream_of_three_outputs_ends_when_all_three_have(scripted):
    client, router = await scripted(three_samples)
    seen: list[Chunk] = [c async for c in client.generate("abc", n=3, max_tokens=3, temperature=1.0, seed=7)]
    assert router.requests[0].params.n == 3 and router.requests[0].params.seed == 7
    by_output = {i: [(c.token_ids, c.finish_reason) for c in seen if c.sample_index == i] for i in range(3)}
    assert by_output == {0: [([97], None), ([97], "stop")], 1: [([98], None), ([98, 98], "length")],
                         2: [([99], None), ([99], "length")]}, "each output in its own token order"
    assert seen[-1].sample_index == 1 and seen[-1].finish_reason == "length", "the last output to end ends the stream"
    assert seen[-1].cumulative_logprob == -1.0


async def test_priority_goes_with_the_request_and_is_bounded(scripted):
    client, router = await scripted(lambda r: [chunk(r, 0, 0, [97], finish_reason="stop")])
    await client.complete("abc", max_tokens=1, priority=-5)
    assert router.requests[0].priority == -5
    with pytest.raises(InvalidRequestError) as caught:
        client.generate("abc", priority=500)
    assert caught.value.param == "priority", caught.value


async def test_tandem_generate_sends_its_priority(nats_server, tmp_path):
    """``tandem generate --priority`` (a real process) puts the value on the request the router takes."""
    import asyncio

    from cli_support import TANDEM, tandem_env

    router = await ScriptedRouter.start(nats_server.url, lambda r: [chunk(r, 0, 0, [97], finish_reason="stop")])
    try:
        proc = await asyncio.create_subprocess_exec(
            *TANDEM, "generate", "abc", "--max-tokens", "1", "--priority", "-7", "--nats-url", nats_server.url,
            env=tandem_env(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await router.close()
    assert proc.returncode == 0, err.decode()
    assert out.decode() == "a\n" and [r.priority for r in router.requests] == [-7]


async def test_complete_returns_every_output_best_first(scripted):
    client, _ = await scripted(three_samples)
    result = await client.complete("abc", n=3, max_tokens=3)
    assert [(o.sample_index, o.text, o.finish_reason, o.cumulative_logprob) for o in result.outputs] == [
        (1, "bbb", "length", -1.0), (2, "cc", "length", -3.0), (0, "aa", "stop", -5.0)]
    assert (result.text, result.token_ids, result.finish_reason, result.cumulative_logprob) == \
        ("bbb", [98, 98, 98], "length", -1.0), "the fields beside outputs are the best output's"
    assert result.prompt_token_ids == list(b"abc") and result.ttft_s > 0
    assert all(o.logprobs is None for o in result.outputs), "logprobs were not asked for"


def held_beams(request):
    """Beam search's outputs: whole, at the end, ranked by length-penalised score, which is not
    the order of their sums of logprobs."""
    return [chunk(request, 1, 0, [66, 66, 66, 66], finish_reason="length", cumulative_logprob=-2.0),
            chunk(request, 0, 0, [65, 65, 65, 65, 65, 65], finish_reason="stop", cumulative_logprob=-2.5)]


async def test_beam_search_keeps_the_workers_ranking(scripted):
    client, router = await scripted(held_beams)
    result = await client.beam_search("x", beam_width=2, max_tokens=6, length_penalty=1.5)
    params = router.requests[0].params
    assert (params.beam_width, params.n, params.length_penalty, params.holds_outputs) == (2, 2, 1.5, True)
    assert [(o.sample_index, o.text) for o in result.outputs] == [(0, "AAAAAA"), (1, "BBBB")], \
        "held outputs come ranked: sample_index is the rank, not to be re-sorted by cumulative logprob"
    assert result.text == "AAAAAA" and result.cumulative_logprob == -2.5


@pytest.mark.parametrize("probed", [True, False], ids=["probed", "silent"])
async def test_a_held_request_lives_as_long_as_the_decode_worker_probes_it(scripted, probed):
    """Held outputs come only at the end: a search longer than the request's timeout is alive while
    its decode worker probes the client (every 2 s in a real one), and times out when nothing comes."""
    def slow_search(request):
        waiting = [PROBE, 0.4] * 5 if probed else [2.0]
        return [*waiting, *held_beams(request)]

    client, _ = await scripted(slow_search)
    if probed:
        result = await client.beam_search("x", beam_width=2, max_tokens=6, timeout_s=1.0)
        assert [o.text for o in result.outputs] == ["AAAAAA", "BBBB"]
    else:
        with pytest.raises(RequestTimeoutError, match="no output for 1s"):
            await client.beam_search("x", beam_width=2, max_tokens=6, timeout_s=1.0)


async def test_best_of_more_than_n_is_held_and_ranked(scripted):
    client, router = await scripted(held_beams)
    result = await client.complete("x", n=2, best_of=4, max_tokens=6)
    assert router.requests[0].params.holds_outputs
    assert [o.sample_index for o in result.outputs] == [0, 1]


async def test_an_error_ends_every_output(scripted):
    def failing(request):
        return [chunk(request, 0, 0, [97]), chunk(request, 1, 0, [98]), error_chunk(request, "the model fell over")]

    client, _ = await scripted(failing)
    stream = client.generate("abc", n=2, max_tokens=4)
    seen = []
    with pytest.raises(WorkerFailureError, match="the model fell over"):
        async for piece in stream:
            seen.append(piece.sample_index)
    assert sorted(seen) == [0, 1] and stream.finished, "the workers ended it: no cancel to send"


async def test_with_logprobs_asked_an_outputs_score_is_their_sum(scripted):
    """Whatever the workers' own figure says (a decode worker's may leave out the token the prefill
    worker sampled), the cumulative logprob agrees with the entries returned."""
    prompt_entries = [None, TokenLogprobs(logprob=-0.5, top=[(98, -0.5)]), TokenLogprobs(logprob=-1.5, top=[])]

    def with_logprobs(request):
        return [chunk(request, 0, 0, [120], logprobs=entries(-0.25), prompt_logprobs=prompt_entries),
                chunk(request, 1, 0, [121], logprobs=entries(-0.75)),
                chunk(request, 1, 1, [121], "", "length", logprobs=entries(-1.0), cumulative_logprob=-1.0),
                chunk(request, 0, 1, [120], "", "length", logprobs=entries(-0.5))]

    client, router = await scripted(with_logprobs)
    result = await client.complete("abc", n=2, max_tokens=2, logprobs=1, prompt_logprobs=1)
    assert router.requests[0].params.prompt_logprobs == 1
    assert result.prompt_logprobs == prompt_entries
    assert [(o.sample_index, o.cumulative_logprob) for o in result.outputs] == [(0, -0.75), (1, -1.75)], \
        "the sum of each output's logprobs ranks it"
    assert [e.logprob for e in result.outputs[1].logprobs] == [-0.75, -1.0]


async def test_streamed_samples_without_scores_keep_their_order(scripted):
    def plain(request):
        return [chunk(request, 1, 0, [98], finish_reason="stop"), chunk(request, 0, 0, [97], finish_reason="stop")]

    client, _ = await scripted(plain)
    result = await client.complete("abc", n=2, max_tokens=1)
    assert [(o.sample_index, o.cumulative_logprob) for o in result.outputs] == [(0, None), (1, None)]


async def test_one_output_reads_as_it_always_did(scripted):
    def single(request):
        return [chunk(request, 0, 1, [98, 99], finish_reason="length"), chunk(request, 0, 0, [97])]

    client, _ = await scripted(single)
    seen = [c async for c in client.generate("abc", max_tokens=3)]
    assert [(c.token_ids, c.sample_index) for c in seen] == [([97], 0), ([98, 99], 0)], "index order restored"
    result = await client.complete("abc", max_tokens=3)
    assert (result.text, result.token_ids, result.finish_reason, result.logprobs, result.cumulative_logprob) == \
        ("abc", [97, 98, 99], "length", None, None)
    assert len(result.outputs) == 1 and result.outputs[0].text == result.text
    assert len(result.token_times) == 3 and result.tpot_s is not None


async def test_a_chunk_of_an_output_the_request_does_not_have_is_dropped(scripted):
    def stray(request):
        return [chunk(request, 5, 0, [122], finish_reason="stop"), chunk(request, 0, 0, [97], finish_reason="stop")]

    client, _ = await scripted(stray)
    result = await client.complete("abc", max_tokens=1)
    assert [o.text for o in result.outputs] == ["a"]


async def test_logit_bias_as_a_mapping_goes_out_as_pairs(scripted):
    client, router = await scripted(lambda r: [chunk(r, 0, 0, [97], finish_reason="stop")])
    await client.complete("abc", max_tokens=1, logit_bias={97: 5.0, 98: -100})
    assert router.requests[0].params.logit_bias == [(97, 5.0), (98, -100.0)]


@pytest.mark.parametrize(("params", "param", "says"), [
    ({"n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
    ({"beam_width": 2, "n": 3}, "n", "n (3) must not exceed beam_width (2)"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens (9) must not exceed max_tokens (4)"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias", "logit_bias"),
    ({"n": 65}, "n", "n: Input should be less than or equal to 64"),
], ids=["best_of<n", "n>beams", "min>max", "bias-key", "n=65"])
async def test_bad_params_are_refused_before_sending_naming_the_field(params, param, says):
    from tandem.client import Client

    class NoBus:
        def __getattr__(self, name: str):
            raise AssertionError(f"the client used NATS ({name}) for a request it should have refused")

    with pytest.raises(InvalidRequestError, match="invalid sampling parameters") as caught:
        await Client(NoBus()).complete("hello", **params)
    assert caught.value.param == param and says in str(caught.value), str(caught.value)
