"""One request with several outputs: ``n`` samples drawn from ``best_of`` candidates, or a beam
search. The group holds its sequences; the engine steps them (see ``LLMEngine``) and the scheduler
forks them, so they share their blocks until one writes (copy on write).

Sampling: the prompt is computed once, into one sequence. The logits of its last token start every
candidate (one row each, with the candidate's own seed), then the candidates fork from it and go on
as independent sequences sharing the prompt's blocks. Candidate ``i`` of a seeded request draws with
seed ``candidate_seed(seed, i)`` (candidate 0 with the request's seed itself), so its tokens depend
only on (seed, i) and the output index, never on the batch or the other candidates.

Beam search: every beam is a sequence; a step computes each beam's next-token logprobs, and when all
beams of the group have theirs, :class:`~tandem.shared.engine.beam_search.BeamSearch` picks the next
beams. A beam picked once goes on in place, picked again it forks (sharing every block), not picked
it is freed at once.

A group's prompt prefilled for a hand-off (``prefill_only``) samples nothing: the decode worker
recomputes the last prompt token and samples every candidate's first token itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.shared.engine.beam_search import BeamSearch
from tandem.shared.engine.sampling import mix_seed
from tandem.shared.engine.sequence import Sequence
from tandem.shared.protocol.serving import SamplingParams

_CANDIDATE_SEED_SALT = 0x6A09E667F3BCC909  # keeps candidate seeds apart from the per-token seed stream


def candidate_seed(seed: int, index: int) -> int:
    """The seed of candidate ``index`` of a request seeded with ``seed`` (candidate 0 keeps it)."""
    return seed if index == 0 else mix_seed(seed ^ _CANDIDATE_SEED_SALT, index)


@dataclass(eq=False)
class SequenceGroup:
    """The sequences of one request with several outputs."""

    request_id: str
    params: SamplingParams  # as the request asked
    # Each candidate's own sampling parameters: its seed, and logprobs always on (at least the
    # chosen token's, for ranking and cumulative_logprob). A beam's: greedy, with the search's
    # candidates as its top logprobs.
    candidate_params: list[SamplingParams]
    beams: BeamSearch | None = None
    live: list[Sequence] = field(default_factory=list)  # unfinished, in sample or beam order
    ended: list[Sequence] = field(default_factory=list)  # finished samples, for the ranking at the end
    next_index: int = 1  # the index the next forked sequence takes

    @classmethod
    def create(cls, request_id: str, params: SamplingParams, stop_token_ids: frozenset[int],
               max_new_tokens: int) -> SequenceGroup:
        if params.beam_width > 1:
            beams = BeamSearch(params.beam_width, params.length_penalty, params.early_stopping, max_new_tokens,
                               stop_token_ids)
            row = params.model_copy(update={"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": None,
                                            "logprobs": max(beams.candidates_per_step, params.logprobs or 0)})
            return cls(request_id, params, [row], beams)
        wants = params.logprobs if params.logprobs is not None else 0
        candidates = [
            params.model_copy(update={"logprobs": wants,
                                      "seed": None if params.seed is None else candidate_seed(params.seed, i)})
            for i in range(params.num_candidates)
        ]
        return cls(request_id, params, candidates)

    @property
    def is_beam_search(self) -> bool:
        return self.beams is not None

    def first_params(self) -> list[SamplingParams]:
        """The rows the prompt's logits start: one per candidate (a beam search starts from one)."""
        return self.candidate_params

    def prompt_fan_out(self, prefill_only: bool) -> int:
        """``Sequence.fan_out`` of the group's prompt sequence."""
        if prefill_only:
            return 0
        return 1 if self.is_beam_search else len(self.candidate_params)

    def ranked_samples(self) -> list[Sequence]:
        """The ``n`` best finished samples, by cumulative logprob, best first."""
        return sorted(self.ended, key=lambda seq: -seq.cumulative_logprob)[: self.params.n]
