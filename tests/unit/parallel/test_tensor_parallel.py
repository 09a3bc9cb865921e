"""A tensor-parallel engine on CPU: rank 0 in this process, rank 1 a follower process, gloo between
them. Against the same engine on one rank: the same tokens (greedy and seeded sampling, chunked
prefill, preemption by swap, several samples sharing blocks through copy-on-write), the same
logits to float32 rounding, and KV hand-offs in the whole model's layout in both directions.

The sums of the two ranks' partial products round differently from one whole product (about
1e-6 here), so a greedy token may only differ where the single-rank logits were that close to a
tie; the tests say so when they see one."""

from __future__ import annotations

import pytest
import torch
from factories import greedy, make_engine, make_prompts, make_request, mixed_requests, record_logits, run, run_outputs
from tensor_parallel_support import sharded_model

from tandem.shared.infra.config import EngineSettings
from tandem.shared.model.loader import load_model
from tandem.shared.parallel.group import TensorParallelError
from tandem.shared.parallel.sharding import shard_config
from tandem.shared.protocol.serving import SamplingParams

LOGIT_TOLERANCE = 1e-4  # the tiny model's logits are O(1); rounding differences are ~1e-6
TINY_BLOCK_BYTES = 4 * 2 * 16 * 4 * 32 * 4


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The tiny model as one rank loads it (an empty data dir: the shipped weights, as the followers)."""
    return load_model("tiny", device="cpu", dtype=torch.float32, data_dir=tmp_path_factory.mktemp("tp-data"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Rank 0's half of the tiny model, rank 1 following in its own process."""
    with sharded_model("tiny", 2, str(tmp_path_factory.mktemp("tp-data"))) as loaded:
        yield loaded


def same_tokens(tp: dict, one: dict, one_logits: dict) -> None:
    """Every request's tokens equal, or the first difference sits on a near tie of the one-rank logits."""
    for request_id, expected in one.items():
        got = tp[request_id].tokens
        if got == expected.tokens:
            continue
        at = next(i for i, (a, b) in enumerate(zip(got, expected.tokens)) if a != b)
        logits = one_logits[(request_id, at)]
        margin = float(logits[expected.tokens[at]] - logits[got[at]])
        assert margin < LOGIT_TOLERANCE, (f"{request_id}: token {at} is {got[at]} on two ranks, "
                                          f"{expected.tokens[at]} on one, whose logits separate them by "
                                          f"{margin:.2e}: not a rounding tie")


def test_the_shard_shape_and_refusals(plain) -> None:
    part = shard_config(plain.config, 2)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == (4, 2, 352)
    assert shard_config(plain.config, 8).num_kv_heads == 1, "8 ranks over 4 KV heads: each head on two ranks"
    with pytest.raises(TensorParallelError, match="does not divide the model's num_heads"):
        shard_config(plain.config, 3)


def test_mixed_requests_match_one_rank(plain, sharded) -> None:
    """Greedy and seeded rows, stop strings and ids, a prefill-only hand-off, chunked prefill
    (a 40-token budget): the tokens and the logits of every sampled row agree."""
    one_engine = make_engine(plain, budget=40)
    one_logits = record_logits(one_engine)
    one = run(one_engine, mixed_requests())
    tp_engine = make_engine(sharded, budget=40)
    tp_logits = record_logits(tp_engine)
    tp = run(tp_engine, mixed_requests())
    same_tokens(tp, one, one_logits)
    for key, logits in one_logits.items():
        if key in tp_logits:
            assert torch.allclose(tp_logits[key], logits, atol=LOGIT_TOLERANCE), f"logits of {key} differ"
    kv_one, kv_tp = one["handoff"].kv, tp["handoff"].kv
    assert kv_tp.shape == kv_one.shape, "a hand-off leaves in the whole model's layout, every KV head"
    assert torch.allclose(kv_tp, kv_one, atol=LOGIT_TOLERANCE), "the gathered heads are not the one-rank K/V"


def test_a_hand_off_from_one_rank_continues_on_two(plain, sharded) -> None:
    """Prefill on one rank, decode on two (the import scatters each rank's heads) and the reverse."""
    prompt = make_prompts()[6]
    reference_engine = make_engine(plain)
    reference_logits = record_logits(reference_engine)
    reference = run(reference_engine, [make_request("r", prompt, 16)])
    for source, target in ((plain, sharded), (sharded, plain)):
        prefilled = run(make_engine(source), [make_request("r", prompt, 16, prefill_only=True)])["r"]
        continued = run(make_engine(target), [make_request("r", prompt, 16, kv=prefilled.kv,
                                                           output_token_ids=prefilled.tokens)])
        continued["r"].tokens = prefilled.tokens + continued["r"].tokens
        same_tokens(continued, reference, reference_logits)


@pytest.mark.slow  # 5 s on 2 cores; the other sharded engine tests stay in the default run
def test_preemption_by_swap_matches_one_rank(plain, sharded) -> None:
    """A pool of 8 blocks for 11 sequences: victims swap out and back on both ranks in step."""
    swap_gib = 64 * TINY_BLOCK_BYTES / 2**30
    requests = [make_request(f"r{i}", p, params=greedy(20 + 2 * i) if i % 2 else
                             SamplingParams(max_tokens=20 + 2 * i, temperature=1.0, top_k=40, seed=i, ignore_eos=True))
                for i, p in enumerate(make_prompts())]
    one_engine = make_engine(plain, num_blocks=8, budget=64, swap_space_gib=swap_gib, preemption_mode="swap")
    one_logits = record_logits(one_engine)
    one = run(one_engine, requests)
    tp_engine = make_engine(sharded, num_blocks=8, budget=64, swap_space_gib=swap_gib / 2, preemption_mode="swap")
    tp = run(tp_engine, [make_request(r.request_id, r.prompt_token_ids, params=r.params) for r in requests])
    assert tp_engine.stats()["swaps"] > 0, "the pool was meant to preempt by swap"
    same_tokens(tp, one, one_logits)


def test_several_samples_share_blocks_with_copy_on_write(plain, sharded) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.5, n=3, seed=21, ignore_eos=True)
    prompt = make_prompts()[5]  # 23 tokens: the last block is partly filled and copied on first write
    one = run_outputs(make_engine(plain), [make_request("g", prompt, params=params)])
    tp_engine = make_engine(sharded)
    tp = run_outputs(tp_engine, [make_request("g", prompt, params=params)])
    assert tp_engine.stats()["cow_copies"] > 0
    assert tp["g"].tokens() == one["g"].tokens(), "the samples differ from one rank's"


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s weights moved by about 1% (a training step's worth), tied ones kept tied."""
    generator = torch.Generator().manual_seed(seed)
    state = {name: tensor + 0.01 * tensor.abs().mean() * torch.randn(tensor.shape, generator=generator)
             for name, tensor in model.state_dict().items()}
    if "lm_head.weight" in state and model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def test_a_weight_reload_reaches_every_rank(plain, sharded, tmp_path) -> None:
    """New whole-model weights into a two-rank engine (a hot reload): its tokens and logits are one
    rank's on the new weights (the same prompts ran before it: K/V cached from the old weights would
    show), and a reload whose shapes do not fit is refused before any rank changes."""
    prompts = make_prompts()[:4]
    new = perturbed(plain.model, seed=5)
    reference = load_model("tiny", device="cpu", dtype=torch.float32, data_dir=tmp_path)
    reference.model.load_state_dict(new)
    one_engine = make_engine(reference)
    one_logits = record_logits(one_engine)
    one = run(one_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])

    tp_engine = make_engine(sharded)
    before = run(tp_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    try:
        tp_engine.load_weights(new)
        tp_logits = record_logits(tp_engine)
        after = run(tp_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
        same_tokens(after, one, one_logits)
        for key, logits in one_logits.items():
            assert torch.allclose(tp_logits[key], logits, atol=LOGIT_TOLERANCE), \
                f"logits of {key} are not one rank's on the new weights: a rank kept its old share"
        misfit = dict(new)
        misfit["model.layers.0.mlp.down_proj.weight"] = new["model.layers.0.mlp.down_proj.weight"][:, :-2]
        with pytest.raises(ValueError, match="down_proj.weight"):
            tp_engine.load_weights(misfit)
        again = run(tp_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
        assert [again[k].tokens for k in sorted(again)] == [after[k].tokens for k in sorted(after)], \
            "a refused reload changed a rank's weights"
    finally:
        tp_engine.load_weights(plain.model.state_dict())  # the module's other tests expect the shipped weights
    restored = run(tp_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    assert [restored[k].tokens for k in sorted(restored)] == [before[k].tokens for k in sorted(before)]


def test_follower_settings_round_trip() -> None:
    """The engine section goes to a follower as JSON and comes back as the same settings."""
    import dataclasses
    import json

    settings = EngineSettings(num_blocks=12, block_size=8, tensor_parallel_size=2)
    assert EngineSettings(**json.loads(json.dumps(dataclasses.asdict(settings)))) == settings
