"""Structured outputs in the engine: every output a spec constrains is one the spec admits, and the
matcher follows its sequence through everything the engine does to it.

The tiny model samples at temperature 1.0 over several seeds (it knows nothing of JSON, so without
the mask almost no output would parse): every output must end "stop" and validate. Then the same seeded requests must
come out token-exact whatever runs them: overlapped steps (whose masks wait for the step before's
tokens), text now or later, preemption by recompute or swap, a prefill -> decode hand-off and a
migration resumed at any token (the new worker's matcher rebuilt from the tokens already sent).

Run: ``python3 -m pytest -q tests/unit/engine/test_structured_output.py``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from factories import make_engine, make_prompts

from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.protocol.serving import SamplingParams, StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer"}, "city": {"type": "string",
                                                                                        "maxLength": 10}},
                    "required": ["zip", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "code", "address"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema": StructuredOutput(kind="json_schema", spec=json.dumps(PERSON)),
    "json_object": StructuredOutput(kind="json_object"),
    "regex": StructuredOutput(kind="regex", spec=r"(yes|no), [0-9]{1,3} (apples|pears)\."),
    "choice": StructuredOutput(kind="choice", choices=["red", "green", "blue", "light blue"]),
    "lark": StructuredOutput(kind="lark", spec='start: "f(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,4}/'),
    "gbnf": StructuredOutput(kind="gbnf", spec='root ::= "[" item ("," item)? "]"\nitem ::= [a-z]{1,5}'),
}


def admitted(kind: str, text: str) -> bool:
    """Whether ``text`` is an output ``SPECS[kind]`` admits, checked without the grammar library."""
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "choice":
        return text in SPECS["choice"].choices
    pattern = {"regex": SPECS["regex"].spec, "lark": r"f\([0-9]{1,4}(,[0-9]{1,4})*\)",
               "gbnf": r"\[[a-z]{1,5}(,[a-z]{1,5})?\]"}[kind]
    return re.fullmatch(pattern, text) is not None


def params(kind: str, seed: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=400, temperature=1.0, seed=seed, structured_output=SPECS[kind], **fields)


def outputs_of(engine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], str, str | None]]:
    """Each request's tokens, text and finish reason, stepping ``engine`` until all end."""
    for request in requests:
        engine.add_request(request)
    got = {r.request_id: ([], "", None) for r in requests}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens, text, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, text + out.text_delta, out.finish_reason)
    assert not engine.has_unfinished(), "the engine did not finish"
    return got


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.slow) if kind == "json_object" else kind
                                  for kind in SPECS])
def test_every_sampled_output_is_one_the_spec_admits(tiny, kind: str) -> None:
    """Bounded specs always end; ``json_object`` strings are unbounded, so a sample may run out of
    tokens inside one (as with any server): the outputs that end must be JSON objects."""
    prompt = list(b"def main():\n    ")
    requests = [EngineRequest(f"s{seed}", prompt, params(kind, seed)) for seed in range(8)]
    got = outputs_of(make_engine(tiny, max_model_len=1024, num_blocks=400), requests)
    ended = {request_id: text for request_id, (_, text, reason) in got.items() if reason == "stop"}
    for request_id, (tokens, text, reason) in got.items():
        assert reason == "stop" or kind == "json_object", \
            f"{kind} {request_id}: ended {reason!r} after {len(tokens)} tokens: {text!r}"
    assert len(ended) >= len(got) // 2, f"{kind}: only {len(ended)} of {len(got)} outputs ended"
    for request_id, text in ended.items():
        assert admitted(kind, text), f"{kind} {request_id}: {text!r} is not an output the spec admits"
    assert len(set(ended.values())) > 1, f"{kind}: every seed gave the same output"


def test_outputs_are_free_until_start_after_appears(tiny) -> None:
    """With ``start_after`` (a reasoning section's end), tokens before it are the model's own."""
    spec = StructuredOutput(kind="choice", choices=["yes", "no"], start_after=list(b"\n"))
    engine = make_engine(tiny)
    got = outputs_of(engine, [EngineRequest(f"s{seed}", list(b"x = 1"), SamplingParams(
        max_tokens=200, temperature=1.0, seed=seed, structured_output=spec)) for seed in range(6)])
    for request_id, (_, text, reason) in got.items():
        head, newline, answer = text.partition("\n")
        assert newline and reason == "stop" and answer in ("yes", "no"), f"{request_id}: {text!r} ({reason})"


MODES = {
    "overlapped": dict(overlap_steps=True),
    "text later": dict(async_output=True),
    "recompute preemption": dict(num_blocks=12, swap_space_gib=0.0),
    "swap preemption": dict(num_blocks=12, swap_space_gib=0.01, preemption_mode="swap"),
}


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=pytest.mark.slow) if mode == "swap preemption" else mode
                                  for mode in MODES])
def test_engine_modes_give_the_same_constrained_tokens(tiny, mode: str) -> None:
    prompts = make_prompts()
    kinds = ["json_schema", "regex", "lark", "choice", "gbnf"] * 2
    requests = lambda: [EngineRequest(f"r{i}", prompts[i], params(kind, seed=i))  # noqa: E731
                        for i, kind in enumerate(kinds)]
    plain = outputs_of(make_engine(tiny), requests())
    engine = make_engine(tiny, **MODES[mode])
    got = outputs_of(engine, requests())
    assert got == plain, f"{mode}: outputs differ from one step at a time"
    if mode == "overlapped":
        assert engine.num_overlapped_steps > 0, "no step was overlapped: the test checks nothing"
    if "preemption" in mode:
        assert engine.stats()["preemptions"] > 0, "nothing was preempted: the test checks nothing"


def test_several_samples_each_follow_their_own_matcher(tiny) -> None:
    request = EngineRequest("n", list(b"# data\n"), params("json_schema", seed=3, n=3, best_of=4))
    engine = make_engine(tiny)
    engine.add_request(request)
    texts: dict[int, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.sample_index] = texts.get(out.sample_index, "") + out.text_delta
    assert len(texts) == 3
    for index, text in texts.items():
        assert admitted("json_schema", text), f"sample {index}: {text!r}"


@pytest.mark.parametrize("cut", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(9, marks=pytest.mark.slow),
                                 17])
def test_a_hand_off_or_a_migration_goes_on_token_exact(tiny, cut: int) -> None:
    """The decode worker's matcher takes the prefill worker's token, a migrated request's takes the
    tokens already delivered: either way the rest comes out as in one undisturbed run."""
    prompt = make_prompts()[5]
    whole = outputs_of(make_engine(tiny), [EngineRequest("whole", prompt, params("json_schema", seed=7))])["whole"]
    tokens, text, reason = whole
    assert cut < len(tokens) - 1, "the undisturbed run is too short for this cut"
    # A prefill worker resumes the migrated request and samples one token; the decode worker goes on.
    prefill = make_engine(tiny)
    prefill.add_request(EngineRequest("m", prompt, params("json_schema", seed=7), output_token_ids=tokens[:cut],
                                      prefill_only=True))
    handed = []
    while prefill.has_unfinished():
        handed += [out for out in prefill.step() if out.finished]
    assert handed[0].finish_reason == "prefilled" and handed[0].new_token_ids == [tokens[cut]]
    decode = make_engine(tiny)
    rest = outputs_of(decode, [EngineRequest("m", prompt, params("json_schema", seed=7), kv=handed[0].kv,
                                             output_token_ids=tokens[: cut + 1])])["m"]
    assert tokens[: cut + 1] + rest[0] == tokens and rest[2] == reason, "the resumed run differs"


def test_resumed_tokens_the_spec_refuses_are_a_value_error(tiny) -> None:
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match="does not continue the output"):
        engine.add_request(EngineRequest("bad", list(b"x"), params("choice", seed=1),
                                         output_token_ids=list(b"purple")))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput(kind="json_schema", spec='{"type": "string", "minLength": 5, "maxLength": 2}'), "Unsatisfiable"),
    (StructuredOutput(kind="regex", spec="[a-"), "regex"),
    (StructuredOutput(kind="lark", spec="start: missing_rule"), "unknown name"),
])
def test_a_spec_that_does_not_compile_is_a_value_error_and_the_engine_goes_on(tiny, spec, message) -> None:
    engine = make_engine(tiny)
    with pytest.raises(ValueError, match=message):
        engine.add_request(EngineRequest("bad", list(b"x"), SamplingParams(structured_output=spec)))
    got = outputs_of(engine, [EngineRequest("good", list(b"x"), params("choice", seed=2))])
    assert got["good"][1] in SPECS["choice"].choices


def test_a_spec_compiles_once_per_engine(tiny) -> None:
    engine = make_engine(tiny)
    outputs_of(engine, [EngineRequest(f"s{seed}", list(b"x"), params("regex", seed)) for seed in range(5)])
    assert (engine.grammars.stats.compiled, engine.grammars.stats.reused) == (1, 4)


def test_unconstrained_rows_beside_constrained_ones_are_untouched(tiny) -> None:
    """A batch mixing free and constrained rows samples the free ones exactly as a free batch does."""
    free = [EngineRequest(f"f{i}", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True))
            for i, prompt in enumerate(make_prompts()[:3])]
    alone = outputs_of(make_engine(tiny), free)
    constrained = [EngineRequest(f"c{i}", list(b"y = "), params("regex", seed=i)) for i in range(3)]
    mixed = outputs_of(make_engine(tiny), [*free, *constrained])
    assert {k: v for k, v in mixed.items() if k.startswith("f")} == alone


def test_the_vocabulary_table_can_be_built_before_the_first_structured_request(tiny) -> None:
    engine = make_engine(tiny)
    engine.prepare_structured_outputs()
    table = engine.grammars._vocabulary
    assert table is not None and table.vocab_size == engine.vocab_size
    outputs_of(engine, [EngineRequest("c", list(b"x"), params("choice", seed=0))])
    assert engine.grammars._vocabulary is table, "the first structured request built the table again"
