"""Request and sequence records of the engine: sampling parameters, the per-request state the
scheduler moves between its queues, and the request/output messages the services exchange.

A ``Sequence`` keeps one flat ``token_ids`` list (prompt followed by output). Its first
``num_computed_tokens`` tokens have their K/V in the paged cache, in the blocks of ``block_table``;
the leading ones may be prefix-cache blocks shared with other sequences (read-only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.shared.engine.detokenizer import IncrementalDetokenizer


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept; 1 = off
    top_k: int = -1  # tokens kept; 0 or -1 = off
    seed: int | None = None  # per-request seed: samples depend only on (seed, output index)
    stop: list[str] = field(default_factory=list)  # stop strings, never part of the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")


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
    prefill_only: bool = False  # stop after the first sampled token and return the prompt's KV
    export_on_finish: bool = False  # return the K/V of every full computed block when it ends (for a KV-store)


@dataclass
class RequestOutput:
    """What one ``step`` reports for one request: the new token and its stable text."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | None
    num_prompt_tokens: int
    num_output_tokens: int
    kv: torch.Tensor | None = None  # prompt KV on the engine's device, for prefill_only requests
    kv_hashes: list[int] | None = None  # with export_on_finish: the chained hash of each block of ``kv``


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
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
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None

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
