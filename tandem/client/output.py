"""What a request returns: its chunks as they stream, and the whole :class:`Completion`
assembled from them (several outputs, best first)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.shared.protocol.serving import (
    SamplingParams,
    TokenLogprobs,
)


@dataclass
class Chunk:
    """New tokens of one output and their text, in order within that output; ``finish_reason`` is
    set on that output's last one. A request with several outputs interleaves their chunks."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    # With ``logprobs=N`` asked: one entry per token of ``token_ids`` (its logprob and the top N).
    logprobs: list[TokenLogprobs] | None = None
    # Which output (0..n-1); for held outputs (beam search, best_of > n) its rank, best first.
    sample_index: int = 0
    cumulative_logprob: float | None = None  # on an output's last chunk, when the workers sent it
    # With ``prompt_logprobs=N`` asked, on the request's first chunk: one entry per prompt token (None first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class CompletionOutput:
    """One output of a request, whole."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    # The sum of its tokens' logprobs: of ``logprobs`` when asked, else the workers' figure (None if none came).
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None  # with ``logprobs=N`` asked: one entry per token
    sample_index: int = 0  # as the workers numbered it (held outputs: their rank)
    token_times: list[float] = field(default_factory=list, repr=False)


@dataclass
class Completion:
    """A finished request. ``outputs`` holds every output, best first; the fields beside it
    (``text``, ``token_ids``, ``finish_reason``, ``logprobs``, ``cumulative_logprob``,
    ``token_times``, ``tpot_s``) are the best output's, so a one-output request reads as it always did."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None  # to the request's first token, of any output
    tpot_s: float | None  # mean time per output token after the first (the best output's)
    request_id: str = ""
    decode_worker: str = ""  # where the router placed it (after a migration: the last placement)
    prefill_worker: str | None = None
    token_times: list[float] = field(default_factory=list, repr=False)
    # With ``logprobs=N`` asked: one entry per output token, and the sum of their logprobs.
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    # With ``prompt_logprobs=N`` asked: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    migrations: int = 0  # times it was placed again after its worker died


@dataclass
class _OutputParts:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None


class OutputAssembly:
    """The chunks of one request, as :class:`RequestStream` yields them, put together into its outputs."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.parts: dict[int, _OutputParts] = {}  # by sample index
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.first_token_at: float | None = None

    def add(self, chunk: Chunk, now: float) -> None:
        part = self.parts.setdefault(chunk.sample_index, _OutputParts())
        part.text.append(chunk.text)
        part.token_ids.extend(chunk.token_ids)
        part.token_times.extend([now] * len(chunk.token_ids))
        part.logprobs.extend(chunk.logprobs or ())
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = now
        if chunk.finish_reason is not None:
            part.finish_reason = chunk.finish_reason
        if chunk.cumulative_logprob is not None:
            part.cumulative_logprob = chunk.cumulative_logprob
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs

    def outputs(self) -> list[CompletionOutput]:
        """Every output, best first: held outputs in the order the workers ranked them (a beam's
        rank comes from its length-penalised score, not from its sum of logprobs); streamed samples
        by cumulative logprob, highest first, any without one after them in sample order."""
        asked = self.params.logprobs is not None
        outputs = []
        for index, part in sorted(self.parts.items()):
            # With logprobs asked, their sum: it agrees with the entries returned whatever worker
            # sampled which token (a prefill worker samples the first); else the workers' figure.
            cumulative = sum(entry.logprob for entry in part.logprobs) if asked else part.cumulative_logprob
            outputs.append(CompletionOutput("".join(part.text), part.token_ids, part.finish_reason, cumulative,
                                            part.logprobs if asked else None, index, part.token_times))
        if not self.params.holds_outputs:
            outputs.sort(key=lambda o: (o.cumulative_logprob is None, -(o.cumulative_logprob or 0.0), o.sample_index))
        return outputs
