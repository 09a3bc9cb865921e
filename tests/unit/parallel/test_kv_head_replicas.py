"""Fewer KV heads than ranks (``random:llama-test``: 4 query heads, 1 KV head, on 2 ranks): each
rank keeps the one KV head, as vLLM does; a hand-off leaves with the head once and arrives on both
ranks. Tokens and logits against one rank, as in test_tensor_parallel."""

from __future__ import annotations

import pytest
import torch
from factories import make_engine, make_request, record_logits, run
from tensor_parallel_support import sharded_model

from tandem.shared.model.loader import load_model

MODEL = "random:llama-test"


@pytest.fixture(scope="module")
def plain():
    return load_model(MODEL, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    with sharded_model(MODEL, 2, str(tmp_path_factory.mktemp("tp-data"))) as loaded:
        yield loaded


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 1000 for i in range(n)] for n in (5, 17, 40)]


def test_replicated_kv_heads_match_one_rank(plain, sharded) -> None:
    assert sharded.model.config.num_kv_heads == 1 and sharded.model.config.num_heads == 2
    one_engine = make_engine(plain, budget=32)
    one_logits = record_logits(one_engine)
    one = run(one_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts())])
    tp_engine = make_engine(sharded, budget=32)
    tp_logits = record_logits(tp_engine)
    tp = run(tp_engine, [make_request(f"r{i}", p, 12) for i, p in enumerate(prompts())])
    assert {k: r.tokens for k, r in tp.items()} == {k: r.tokens for k, r in one.items()}
    for key, logits in one_logits.items():
        assert torch.allclose(tp_logits[key], logits, atol=1e-4), f"logits of {key} differ"


def test_a_replicated_head_leaves_once_and_arrives_on_both_ranks(plain, sharded) -> None:
    prompt = prompts()[2]
    whole = run(make_engine(plain), [make_request("h", prompt, 8, prefill_only=True)])["h"]
    from_two = run(make_engine(sharded), [make_request("h", prompt, 8, prefill_only=True)])["h"]
    assert from_two.kv.shape == whole.kv.shape and from_two.kv.shape[4] == 1
    assert torch.allclose(from_two.kv, whole.kv, atol=1e-4)
    reference = run(make_engine(plain), [make_request("h", prompt, 8)])["h"].tokens
    continued = run(make_engine(sharded), [make_request("h", prompt, 8, kv=whole.kv, output_token_ids=whole.tokens)])
    assert whole.tokens + continued["h"].tokens == reference, "the imported head did not reach both ranks"
