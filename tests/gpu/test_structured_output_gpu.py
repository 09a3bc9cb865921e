"""Structured outputs on the GPU: masks filled on llguidance's threads while the device runs the
forward, applied on the device, with decode CUDA graphs and overlapped steps on (whose constrained
rows sample only once their grammars have the step before's tokens). Every output validates, and
the tokens equal those of the same engine one step at a time (their CPU twins:
tests/unit/engine/test_structured_output.py)."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.sequence import EngineRequest
from tandem.shared.model.loader import load_model
from tandem.shared.protocol.serving import SamplingParams, StructuredOutput

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CONFIG = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=512)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "bb", "ccc"]}}}}


def run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, tuple[list[int], str, str | None]]:
    for request in requests:
        engine.add_request(request)
    got = {r.request_id: ([], "", None) for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, text, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, text + out.text_delta, out.finish_reason)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return got


def requests() -> list[EngineRequest]:
    spec = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
    constrained = [EngineRequest(f"c{i}", list(b"record = "), SamplingParams(
        max_tokens=300, temperature=1.0, seed=i, structured_output=spec)) for i in range(24)]
    free = [EngineRequest(f"f{i}", list(b"def f():"), SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                     ignore_eos=True)) for i in range(8)]
    return constrained + free


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny", device="cuda", dtype=torch.float32)


@pytest.mark.gpu
@requires_cuda
def test_constrained_outputs_with_graphs_and_overlap_are_valid_and_exact(tiny_cuda) -> None:
    overlapped = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, CONFIG, "cuda")
    assert overlapped.runner.graphs is not None and overlapped.overlap_steps, "graphs and overlap should be on"
    got = run(overlapped, requests())
    assert overlapped.num_overlapped_steps > 0, "no step was overlapped: the test checks nothing"
    stepwise = LLMEngine(tiny_cuda.model, tiny_cuda.tokenizer, dataclasses.replace(CONFIG, overlap_steps=False),
                         "cuda")
    assert run(stepwise, requests()) == got, "overlapped steps changed the constrained outputs"
    for request_id, (_, text, reason) in got.items():
        if request_id.startswith("c"):
            assert reason == "stop", f"{request_id} ended {reason!r}: {text!r}"
            jsonschema.validate(json.loads(text), SCHEMA)
