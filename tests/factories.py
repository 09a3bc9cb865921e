"""Builders for the engine's parts with small defaults (in the manner of vLLM's tests/v1/core/utils.py),
and the helpers that drive an engine to the end. Unit tests import them: ``from factories import ...``.

Sizes: ``make_block_manager`` and ``make_scheduler`` default to blocks of 4 tokens (hand-countable
tables); ``make_engine`` to the engine's real block size of 16 over a model such as the ``tiny``
fixture. The short names the tests use (``budget``, ``max_seqs``, ``caching``) are the
``max_num_batched_tokens``, ``max_num_seqs`` and ``enable_prefix_caching`` of :class:`EngineConfig`;
``make_engine`` takes any other ``EngineConfig`` field by its own name.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.scheduler import Scheduler
from tandem.shared.engine.sequence import EngineRequest, Sequence
from tandem.shared.kvcache.block_manager import BlockManager
from tandem.shared.model.loader import LoadedModel
from tandem.shared.protocol.serving import SamplingParams
from tandem.shared.text.tokenizer import Tokenizer

# ---------------------------------------------------------------- building


def greedy(max_tokens: int = 8) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (eos does not end it early)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def make_block_manager(num_blocks: int = 16, block_size: int = 4, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, block_size, caching)


def make_scheduler(num_blocks: int = 16, block_size: int = 4, budget: int = 64, max_seqs: int = 8,
                   max_model_len: int = 1000, caching: bool = True) -> Scheduler:
    """A scheduler over its own block manager (no eos tokens, no finish callback)."""
    return Scheduler(make_block_manager(num_blocks, block_size, caching), max_seqs, budget, max_model_len)


def make_sequence(request_id: str, prompt_len: int = 4, arrival: int = 0, max_tokens: int = 4,
                  prompt: list[int] | None = None) -> Sequence:
    """A waiting sequence sampling ``max_tokens`` greedily. Without ``prompt``, ``prompt_len`` tokens
    that depend on ``arrival`` (sequences of different arrivals share no prefix by accident)."""
    prompt = prompt if prompt is not None else [(arrival * 31 + i) % 97 for i in range(prompt_len)]
    return Sequence(request_id, list(prompt), len(prompt), greedy(max_tokens), arrival)


# The engine tests' usual engine: small enough to preempt when asked to, with whole prompts in one step.
ENGINE_CONFIG = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=1000,
                             max_model_len=256)


def engine_config(base: EngineConfig = ENGINE_CONFIG, *, budget: int | None = None, max_seqs: int | None = None,
                  caching: bool | None = None, **fields) -> EngineConfig:
    """``base`` with the given fields changed (``budget``, ``max_seqs``, ``caching``: see the module docstring)."""
    short = {"max_num_batched_tokens": budget, "max_num_seqs": max_seqs, "enable_prefix_caching": caching}
    return dataclasses.replace(base, **{k: v for k, v in short.items() if v is not None}, **fields)


def make_engine(model: LoadedModel, config: EngineConfig = ENGINE_CONFIG, *, tokenizer: Tokenizer | None = None,
                device: str = "cpu", dtype: torch.dtype | None = None, budget: int | None = None,
                max_seqs: int | None = None, caching: bool | None = None, **fields) -> LLMEngine:
    """An ``LLMEngine`` over ``model`` (e.g. the ``tiny`` fixture) on CPU in the model's dtype, configured
    as ``config`` (default :data:`ENGINE_CONFIG`) with the given fields changed. ``tokenizer``
    replaces the model's own (a test's eos tokens, say)."""
    config = engine_config(config, budget=budget, max_seqs=max_seqs, caching=caching, **fields)
    return LLMEngine(model.model, tokenizer if tokenizer is not None else model.tokenizer, config, device, dtype)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 8, params: SamplingParams | None = None,
                 **fields) -> EngineRequest:
    """An engine request, sampling ``max_tokens`` greedily unless ``params`` says otherwise; ``fields``:
    the other ``EngineRequest`` fields (``kv``, ``output_token_ids``, ``prefill_only``, ...)."""
    return EngineRequest(request_id, list(prompt), params if params is not None else greedy(max_tokens), **fields)


PROMPT_LENGTHS = [1, 5, 15, 16, 17, 23, 24, 25, 32, 33, 47]  # on and around the edges of 16-token blocks


def make_prompts() -> list[list[int]]:
    """One prompt of random bytes per length in :data:`PROMPT_LENGTHS`, the same on every call."""
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


def mixed_requests() -> list[EngineRequest]:
    """One request per prompt of :func:`make_prompts`: greedy and seeded sampling, a stop string,
    stop token ids, eos, and a prefill-only hand-off (the workload every engine mode must agree on)."""
    prompts = make_prompts()
    kinds = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=11, stop=list("etaoinshrdlucmfw")),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop_token_ids=list(range(0, 256, 4))),
        SamplingParams(max_tokens=40, temperature=1.2, seed=9),
    ]
    requests = [EngineRequest(f"r{i}", prompt, kinds[i % len(kinds)]) for i, prompt in enumerate(prompts)]
    requests.append(EngineRequest("handoff", prompts[3], kinds[1], prefill_only=True))
    return requests


# ---------------------------------------------------------------- driving an engine


@dataclass
class Result:
    """Everything an engine reported for one request."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    kv: torch.Tensor | None = None


def run(engine: LLMEngine, requests: list[EngineRequest], max_steps: int = 5000) -> dict[str, Result]:
    """Add ``requests``, step until none is left and return what each got. Checks on the way that a
    request reports nothing after it finished, and at the end that the pool is entirely free."""
    for request in requests:
        engine.add_request(request)
    results: dict[str, Result] = {r.request_id: Result() for r in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            result = results[out.request_id]
            result.tokens += out.new_token_ids
            result.text += out.text_delta
            assert not result.finish_reason, f"{out.request_id} reported after finishing"
            if out.finished:
                result.finish_reason, result.kv = out.finish_reason, out.kv
            assert out.num_output_tokens >= len(result.tokens)
    assert not engine.has_unfinished(), "engine did not finish"
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0
    return results


def record_logits(engine: LLMEngine) -> dict[tuple[str, int], torch.Tensor]:
    """Wrap the runner so every sampled row's logits are kept, keyed by (request, output index),
    for steps run one at a time and for overlapped ones (``launch_decode`` + ``sample_async``)."""
    logged: dict[tuple[str, int], torch.Tensor] = {}
    runner = engine.runner
    launch, launch_decode, sample_async = runner.launch, runner.launch_decode, runner.sample_async

    def launch_and_note(batch):
        pending = launch(batch)
        if pending is not None:
            pending.keys = [(i.seq.request_id, i.seq.num_output_tokens) for i in batch.items if i.samples]
        return pending

    def launch_decode_and_note(seqs, prev_tokens, rows):
        pending = launch_decode(seqs, prev_tokens, rows)
        # The first len(rows) sequences' newest token is in flight; the rest are admitted hand-offs.
        pending.keys = [(seq.request_id, seq.num_output_tokens + (i < len(rows))) for i, seq in enumerate(seqs)]
        return pending

    def sample_async_and_log(pending, bitmask=None):  # every sampling goes through here (``sample`` waits on it)
        # Before the next step is queued: a graph's logits buffer is reused by the next replay.
        for key, row in zip(pending.keys, pending.logits):
            logged[key] = row.clone()
        return sample_async(pending, bitmask)

    runner.launch, runner.launch_decode, runner.sample_async = (
        launch_and_note, launch_decode_and_note, sample_async_and_log)
    return logged



@dataclass
class Outputs:
    """Everything an engine reported for one request with one or several outputs, by output index."""

    samples: dict[int, Result] = field(default_factory=dict)
    cumulative_logprobs: dict[int, float | None] = field(default_factory=dict)
    ended: bool = False

    def tokens(self) -> list[list[int]]:
        return [self.samples[i].tokens for i in sorted(self.samples)]


def run_outputs(engine: LLMEngine, requests: list[EngineRequest], max_steps: int = 5000,
                watch=None) -> dict[str, Outputs]:
    """``run`` for requests with several outputs: what each output of each request got, keyed by
    ``sample_index``. Checks on the way that no output reports after it finished and no request
    after it ended, that a request ends exactly once with its last output, and at the end that the
    pool is entirely free. ``watch(engine)`` is called after every step (to look at block counts)."""
    for request in requests:
        engine.add_request(request)
    results = {r.request_id: Outputs() for r in requests}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs = results[out.request_id]
            assert not outputs.ended, f"{out.request_id} reported after it ended"
            sample = outputs.samples.setdefault(out.sample_index, Result())
            assert not sample.finish_reason, f"{out.request_id}#{out.sample_index} reported after finishing"
            sample.tokens += out.new_token_ids
            sample.text += out.text_delta
            if out.finished:
                sample.finish_reason, sample.kv = out.finish_reason, out.kv
                outputs.cumulative_logprobs[out.sample_index] = out.cumulative_logprob
            outputs.ended = out.ends_request
        if watch is not None:
            watch(engine)
    assert not engine.has_unfinished(), "engine did not finish"
    assert all(o.ended for o in results.values()), "a request never ended"
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["running"] == stats["waiting"] == 0
    return results
