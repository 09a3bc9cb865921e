"""Request and sequence records of the engine: the per-request state the scheduler moves between
its queues, and the request/output records the services exchange with it. Sampling parameters are
the protocol's :class:`~tandem.shared.protocol.serving.SamplingParams` (validated on construction).

A ``Sequence`` keeps one flat ``token_ids`` list (prompt followed by output). Its first
``num_computed_tokens`` tokens have their K/V in the paged cache, in the blocks of ``block_table``;
the leading ones may be prefix-cache blocks shared with other sequences (read-only).
"""

from __future__ import annotations

import enum
import reprlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import ValidationError

from tandem.shared.protocol.adapters import AdapterRef
from tandem.shared.protocol.base import first_error
from tandem.shared.protocol.embedding import PoolingParams
from tandem.shared.protocol.serving import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import torch

    from tandem.shared.engine.detokenizer import IncrementalDetokenizer
    from tandem.shared.engine.pooling import Pooling
    from tandem.shared.engine.prompt_logprobs import PromptLogprobs
    from tandem.shared.engine.sequence_group import SequenceGroup
    from tandem.shared.structured.output_grammar import OutputGrammar


@dataclass
class EngineRequest:
    """One request handed to ``LLMEngine.add_request``.

    A prefilled hand-off sets ``kv`` (CPU tensor ``[n_blocks, num_layers, 2, block_size, Hkv, D]``
    covering the prompt) and ``output_token_ids`` (the token(s) the prefill worker sampled). Those
    tokens were already reported by the prefill worker: this engine reports only later tokens, and
    its text deltas continue exactly where the prefill worker's stopped.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    kv: torch.Tensor | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_cumulative_logprob: float = 0.0  # the sum of ``output_token_ids``' logprobs, where they were sampled
    prefill_only: bool = False  # stop after the first sampled token and return the prompt's KV
    export_on_finish: bool = False  # return the K/V of every full computed block when it ends (for a KV-store)
    # An embedding: the prompt is prefilled and pooled, nothing sampled (``params`` unused); the
    # request ends with reason "embedded" and its vector (see ``pooling.py``). Method resolved.
    pooling: PoolingParams | None = None
    adapter: AdapterRef | None = None  # the LoRA adapter it runs with (None: the base model)


def checked_params(params: SamplingParams) -> SamplingParams:
    """``params`` validated again, or ``ValueError`` naming the first bad field. Construction
    already validates, but ``model_copy(update=...)`` and ``model_construct`` do not, and a value
    out of bounds inside an engine step would fail every request batched with it."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
    try:
        return SamplingParams.model_validate(params.model_dump())
    except ValidationError as exc:
        raise ValueError(f"invalid sampling parameters: {first_error(exc)} "
                         f"(got {reprlib.repr(exc.errors()[0]['input'])})") from None


def has_penalties(params: SamplingParams) -> bool:
    """Whether sampling with ``params`` reads the row's token history (``logits_processors``)."""
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


@dataclass
class RequestOutput:
    """What one ``step`` reports for one request: the new token and its stable text."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | "embedded" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    kv: torch.Tensor | None = None  # prompt KV on the engine's device, for prefill_only requests
    kv_hashes: list[int] | None = None  # with export_on_finish: the chained hash of each block of ``kv``
    # With finish_reason "error": why the engine ended this request alone (its own part of a step
    # raised; the rest of the batch went on), as "ExceptionType: message".
    error: str | None = None
    # With ``params.logprobs`` set: one entry per token of ``new_token_ids``; else None.
    logprobs: list[TokenLogprobs] | None = None
    # Which of the request's outputs this is (0 for single-output requests); for held outputs
    # (``params.holds_outputs``, reported whole when the request ends) its rank, best first.
    sample_index: int = 0
    cumulative_logprob: float | None = None  # with ``finished``: the sum of this output's token logprobs
    # ``finished`` ends this output; ``request_finished`` the request (its every output has ended).
    # Equal for single-output requests; None means the same as ``finished``.
    request_finished: bool | None = None
    # With ``params.prompt_logprobs`` set, on the request's first output: one entry per prompt token
    # (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With finish_reason "embedded": the pooled, L2-normalised vector (float32, on the host).
    embedding: torch.Tensor | None = None

    @property
    def ends_request(self) -> bool:
        return self.finished if self.request_finished is None else self.request_finished


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its computed K/V kept (host blocks, shared device blocks)
    FINISHED = "finished"


@dataclass(eq=False)  # identity equality: sequences live in deques and sets
class Sequence:
    """Engine-side state of one request."""

    request_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order; preemption frees the most recent arrival first
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full computed blocks
    prefill_only: bool = False
    export_on_finish: bool = False
    pending_kv: torch.Tensor | None = None  # imported prompt KV, kept on CPU until admitted
    prefix_cached_blocks: int = 0  # leading blocks claimed from this engine's prefix cache at admission
    imported_blocks: int = 0  # the blocks after those that came with an import (hand-off or KV-store)
    # The prompt logprobs this engine owes the request's first output, as its prefill computes them
    # (None: none asked, or computed upstream); see ``prompt_logprobs.owes_prompt_logprobs``.
    prompt_logprobs: PromptLogprobs | None = None
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    error: str | None = None  # with finish_reason "error": what its own part of a step raised
    # Several outputs of one request (n > 1, best_of, beams): the group and this output's index in it.
    group: SequenceGroup | None = None
    sample_index: int = 0
    # Samples the next logits of this sequence start: 1 for a plain sequence; a request's candidates
    # for the prompt of a sampling group (its first tokens come from one set of logits); 0 for a
    # group's prompt prefilled for a hand-off, whose first tokens the decode worker samples.
    fan_out: int = 1
    cumulative_logprob: float = 0.0  # of the output tokens (raw log_softmax), kept for groups
    # Held outputs (reported when the request ends) keep their per-token logprobs here.
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # A beam whose step has run: its top continuations ((token id, logprob), best first), waiting
    # for the group's other beams before the search picks the next beams.
    beam_candidates: list[tuple[int, float]] | None = None
    # With ``params.structured_output``: the output's matcher, which has taken every output token.
    grammar: OutputGrammar | None = None
    # An embedding sequence's pooled state (``pooling.py``); None for generation.
    pooling: Pooling | None = None
    # Its LoRA adapter, the root of its block-hash chain (``adapters.adapter_hash_root``: blocks are
    # shared only between sequences of one adapter) and the device slot it holds while running (-1: none).
    adapter: AdapterRef | None = None
    hash_root: int | None = None
    lora_slot: int = -1

    @property
    def key(self) -> str:
        """The scheduler's name for it: the request id, with the output's index for later outputs."""
        return self.request_id if self.sample_index == 0 else f"{self.request_id}#{self.sample_index}"

    @property
    def can_overlap(self) -> bool:
        """Whether its next step may be queued before its newest token is on the host (see
        ``overlap.py``): a forked sample's may (it goes on alone), not a beam's or a group's prompt's,
        whose next rows depend on the whole group; nor with penalties, which need that token in the
        row's history; nor an embedding's, which samples nothing."""
        alone = self.group is None or (not self.group.is_beam_search and self.fan_out == 1)
        return alone and not has_penalties(self.params) and self.pooling is None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def output_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
