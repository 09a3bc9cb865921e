"""Serving LoRA adapters in the engine: logits equal ``peft``'s on the same Hugging Face directory and
adapter (CPU, float32), with rows of several adapters and of none in one batch, across a prefill ->
decode hand-off; adapters' prefixes are never shared; slots are evicted least recently used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories import make_engine, make_request, run
from lora_support import ALL_TARGETS, peft_logits, served_adapters
from model_support import VOCAB

from tandem.shared.lora.peft_format import AdapterError, check_adapter
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.adapters import AdapterRef
from tandem.shared.protocol.serving import SamplingParams

TOLERANCE = 1e-5
ADAPTERS = {  # name -> (rank, targets, seed)
    "all-r8": (8, ALL_TARGETS, 1),
    "attn-r4": (4, ["q_proj", "v_proj", "o_proj"], 2),
    "mlp-r16": (16, ["gate_proj", "up_proj", "down_proj"], 3),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A Llama 3 checkpoint, three PEFT adapters of it, and the transformers model itself."""
    return served_adapters(tmp_path_factory.mktemp("lora"), ADAPTERS)


def spy_logits(engine) -> dict[str, list[torch.Tensor]]:  # noqa: ANN001
    """Record each sampled row's raw logits per request, in step order (wraps the runner's sampling)."""
    seen: dict[str, list[torch.Tensor]] = {}
    sample_async = engine.runner.sample_async

    def recording(pending, bitmask=None):  # noqa: ANN001
        for row, seq in enumerate(pending.seqs):
            seen.setdefault(seq.request_id, []).append(pending.logits[row].clone())
        return sample_async(pending, bitmask)

    engine.runner.sample_async = recording
    return seen


PROMPTS = [[1, 5, 9, 14, 3, 77, 42, 8, 60, 31, 19, 4, 90, 12, 7, 66, 23, 50, 2, 11],
           [4, 8, 15, 16, 23, 42], [50, 51, 52], [3] * 17]


def check_against_peft(hf_model, refs, prompt: list[int], tokens: list[int], logits: list[torch.Tensor],  # noqa: ANN001
                       adapter: str | None, what: str) -> None:
    expected = peft_logits(hf_model, None if adapter is None else Path(refs[adapter].path), prompt + tokens)
    if adapter is not None:  # the comparison means something only where the adapter changes the logits
        effect = (expected - peft_logits(hf_model, None, prompt + tokens)).abs().max().item()
        assert effect > 0.1, f"adapter {adapter} barely changes peft's logits ({effect:.2e}): a weak test"
    rows = expected[len(prompt) - 1 : len(prompt) - 1 + len(logits)]
    actual = torch.stack(logits)
    error = (actual - rows).abs().max().item()
    assert error < TOLERANCE, f"{what}: adapter {adapter}: max |logit - peft's| = {error:.2e}"
    assert tokens == rows.argmax(-1).tolist()[: len(tokens)], f"{what}: adapter {adapter}: greedy tokens differ"


@pytest.mark.parametrize("max_loras", [3, 2])  # 2: one adapter waits for a slot, one slot is reused
def test_mixed_batch_matches_peft(served, max_loras: int) -> None:
    hf_model, base_dir, refs = served
    engine = make_engine(load_model(str(base_dir)), max_loras=max_loras, max_lora_rank=16)
    seen = spy_logits(engine)
    names = [None, "all-r8", "attn-r4", "mlp-r16", "all-r8", None, "mlp-r16", "attn-r4"]
    requests = [make_request(f"r{i}", PROMPTS[i % len(PROMPTS)], max_tokens=6,
                             adapter=None if name is None else refs[name]) for i, name in enumerate(names)]
    results = run(engine, requests)
    for i, name in enumerate(names):
        check_against_peft(hf_model, refs, PROMPTS[i % len(PROMPTS)], results[f"r{i}"].tokens, seen[f"r{i}"], name,
                           f"request r{i} of a mixed batch")
    assert engine.adapters.slot_writes >= 3
    if max_loras == 2:
        assert engine.adapters.slot_writes > 3 or engine.adapters.loads == 3, "a slot was reused"


def test_handoff_with_adapter_matches_peft(served) -> None:
    """Prefilled on one engine, decoded on another: the K/V and the first token computed with the
    adapter on the prefill side continue with it on the decode side."""
    hf_model, base_dir, refs = served
    loaded = load_model(str(base_dir))
    prefill, decode = make_engine(loaded, max_loras=2), make_engine(load_model(str(base_dir)), max_loras=2)
    prefill_seen, decode_seen = spy_logits(prefill), spy_logits(decode)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cases = [("h0", PROMPTS[0], "all-r8"), ("h1", PROMPTS[3], None), ("h2", PROMPTS[1], "attn-r4")]
    handed = run(prefill, [make_request(rid, prompt, params=params, prefill_only=True,
                                        adapter=None if name is None else refs[name]) for rid, prompt, name in cases])
    decoded = run(decode, [make_request(rid, prompt, params=params, kv=handed[rid].kv.cpu(),
                                        output_token_ids=handed[rid].tokens,
                                        adapter=None if name is None else refs[name]) for rid, prompt, name in cases])
    for rid, prompt, name in cases:
        tokens = handed[rid].tokens + decoded[rid].tokens
        check_against_peft(hf_model, refs, prompt, tokens, prefill_seen[rid] + decode_seen[rid], name,
                           f"hand-off {rid}")


def test_prefix_cache_is_per_adapter(served) -> None:
    """The same prompt under two adapters and none: no block computed with one is claimed by another,
    while a second request of the same adapter does claim them."""
    _, base_dir, refs = served
    engine = make_engine(load_model(str(base_dir)), max_loras=2)
    prompt = list(range(3, 3 + 40))
    order = [("a", refs["all-r8"]), ("b", refs["attn-r4"]), ("c", None), ("d", refs["all-r8"])]
    hits = []
    for rid, ref in order:
        before = engine.block_manager.prefix_hits
        run(engine, [make_request(rid, prompt, max_tokens=2, adapter=ref)])
        hits.append(engine.block_manager.prefix_hits - before)
    assert hits[:3] == [0, 0, 0], f"a prefix was shared across adapters: hits per request {hits}"
    assert hits[3] == 32, f"the second request of one adapter claimed {hits[3]} tokens, expected its 2 full blocks"


def test_bad_adapters_are_one_line_errors(served, tmp_path: Path) -> None:
    hf_model, base_dir, refs = served
    loaded = load_model(str(base_dir))
    engine = make_engine(loaded, max_loras=1, max_lora_rank=8)
    bad = tmp_path / "bad"
    bad.mkdir()
    cases = {
        "missing": (AdapterRef(name="x", version="1", path=str(tmp_path / "nowhere")), "does not exist"),
        "empty dir": (AdapterRef(name="x", version="1", path=str(bad)), "adapter_config.json"),
        "rank above limit": (refs["mlp-r16"], "raise --max-lora-rank"),
    }
    for what, (ref, words) in cases.items():
        with pytest.raises(AdapterError) as caught:
            engine.add_request(make_request(what, [1, 2, 3], adapter=ref))
        message = str(caught.value)
        assert words in message and "\n" not in message, f"{what}: {message!r}"
    # a running request is untouched by those refusals
    results = run(engine, [make_request("fine", [1, 2, 3], max_tokens=4, adapter=refs["all-r8"])])
    assert len(results["fine"].tokens) == 4
    no_lora = make_engine(loaded)
    with pytest.raises(ValueError, match="--max-loras"):
        no_lora.add_request(make_request("y", [1, 2, 3], adapter=refs["all-r8"]))


def test_adapter_checks_name_what_to_change(served, tmp_path: Path) -> None:
    hf_model, base_dir, refs = served
    config = load_model(str(base_dir)).config
    source = Path(refs["attn-r4"].path)
    cases = {
        "use_dora": (True, "use_dora"),
        "target_modules": (["q_proj", "lm_head"], "'lm_head' is not a projection"),
        "r": (0, "r must be a positive integer"),
    }
    for key, (value, words) in cases.items():
        broken = tmp_path / key
        broken.mkdir()
        raw = json.loads((source / "adapter_config.json").read_text())
        raw[key] = value
        (broken / "adapter_config.json").write_text(json.dumps(raw))
        (broken / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
        with pytest.raises(AdapterError, match=words):
            check_adapter(broken, config)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    (truncated / "adapter_model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        check_adapter(truncated, config)
    assert VOCAB == config.vocab_size
