"""Beam search's choices, step by step, as transformers' ``generate(num_beams=k, do_sample=False)``
makes them (its ``_beam_search``): host arithmetic over each beam's best continuations; the engine
owns the sequences and their blocks and carries the choices out (fork, extend, free).

One step, given every live beam's score (sum of its tokens' logprobs) and its top ``K`` next tokens
(``K = max(2, 1 + number of stop tokens) * k``, enough that ``k`` beams go on even if the best
candidates all stop):
1. the ``K`` best (beam, token) continuations of all beams, by beam score + token logprob;
2. the next beams: the ``k`` best of those that do not stop (a stop token, or the length limit);
3. finished hypotheses: of the ``k`` best continuations, those that stop, scored
   ``sum of logprobs / generated_length ** length_penalty``, merged into the ``k`` best so far,
   unless the search can no longer improve (below) or, with ``early_stopping=True``, already holds
   ``k`` hypotheses;
4. whether to go on: the best live beam could still beat the worst kept hypothesis (its score over
   the current generated length, or over the longest possible one with ``early_stopping="never"``
   and a positive length penalty); with ``early_stopping=True`` not once ``k`` hypotheses are kept;
   and not when every continuation stopped.

Scores add in float32, as transformers' tensors do, so near ties rank the same way.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.shared.protocol.serving import TokenLogprobs


def _f32(value: float) -> float:
    return array("f", (value,))[0]


@dataclass
class BeamHypothesis:
    """A finished beam: its output tokens and how it scored."""

    token_ids: list[int]
    score: float  # sum of logprobs / generated_length ** length_penalty: the ranking
    cumulative_logprob: float
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stopped: bool = True  # ended on a stop token (else at the length limit)


@dataclass
class Continuation:
    """Beam ``parent`` (an index into the step's beams) extended by ``token_id``."""

    parent: int
    token_id: int
    logprob: float
    score: float  # the parent's score plus ``logprob``, in float32
    rank: int  # its place among the step's candidates (0: the best)


@dataclass
class BeamStep:
    """What one step decided: the next beams (best first) and whether the search has ended."""

    next_beams: list[Continuation]
    done: bool


class BeamSearch:
    """The search state of one request: its kept hypotheses and whether it can still improve."""

    def __init__(self, beam_width: int, length_penalty: float, early_stopping: bool | str, max_new_tokens: int,
                 stop_token_ids: Sequence[int]) -> None:
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.candidates_per_step = max(2, 1 + len(self.stop_token_ids)) * beam_width
        self.hypotheses: list[BeamHypothesis] = []  # at most beam_width, best first
        self.can_improve = True

    def step(self, scores: Sequence[float], candidates: Sequence[Sequence[tuple[int, float]]],
             outputs: Sequence[tuple[list[int], list[TokenLogprobs]]], num_generated: int,
             keep_logprobs: int | None = None) -> BeamStep:
        """One step. Beam ``b`` has score ``scores[b]``, its best continuations ``candidates[b]``
        ((token id, logprob), best first, at least ``candidates_per_step`` unless the vocabulary is
        smaller) and its output so far ``outputs[b]`` (token ids, their logprobs); every beam has
        ``num_generated`` output tokens. ``keep_logprobs``: the alternatives each kept token's
        logprobs entry lists (None: keep none)."""
        k = self.beam_width
        ranked = sorted(
            ((_f32(scores[b] + logprob), b, j, token) for b, row in enumerate(candidates)
             for j, (token, logprob) in enumerate(row[: self.candidates_per_step])),
            key=lambda c: (-c[0], c[1], c[2]))[: self.candidates_per_step]
        step = [Continuation(b, token, candidates[b][j][1], score, rank)
                for rank, (score, b, j, token) in enumerate(ranked)]
        length = num_generated + 1
        stops = [c.token_id in self.stop_token_ids or length >= self.max_new_tokens for c in step]

        # Finished hypotheses first: they are judged with the search's state before this step.
        full = len(self.hypotheses) == k
        if self.can_improve and not (full and self.early_stopping is True):
            for cont, stopped in zip(step[:k], stops[:k]):
                if stopped:
                    tokens, logprobs = outputs[cont.parent]
                    self._keep(BeamHypothesis(
                        token_ids=[*tokens, cont.token_id],
                        score=_f32(cont.score / (length ** self.length_penalty)),
                        cumulative_logprob=cont.score,
                        logprobs=[*logprobs, *token_entry(cont, candidates, keep_logprobs)],
                        stopped=cont.token_id in self.stop_token_ids))
        going_on = [c for c, stopped in zip(step, stops) if not stopped][:k]
        if len(going_on) < k:  # transformers keeps k beams whatever happens; they can only lose from here
            going_on += [c for c, stopped in zip(step, stops) if stopped][: k - len(going_on)]

        if self.can_improve and len(self.hypotheses) == k and going_on:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_new_tokens
            else:
                best_length = length
            best_possible = going_on[0].score / (best_length ** self.length_penalty)
            self.can_improve = best_possible > self.hypotheses[-1].score
        done = (not self.can_improve or (len(self.hypotheses) == k and self.early_stopping is True)
                or all(stops))
        return BeamStep(going_on, done)

    def best(self, n: int) -> list[BeamHypothesis]:
        """The ``n`` best kept hypotheses, best first."""
        return self.hypotheses[:n]

    def _keep(self, hypothesis: BeamHypothesis) -> None:
        self.hypotheses.append(hypothesis)
        self.hypotheses.sort(key=lambda h: -h.score)  # stable: an equal score keeps the earlier one
        del self.hypotheses[self.beam_width:]


def token_entry(cont: Continuation, candidates: Sequence[Sequence[tuple[int, float]]],
                keep_logprobs: int | None) -> list[TokenLogprobs]:
    """The logprobs entry of ``cont``'s token: one ``TokenLogprobs`` with its parent's best
    ``keep_logprobs`` alternatives, or none when none are kept."""
    if keep_logprobs is None:
        return []
    top = list(candidates[cont.parent][:keep_logprobs])
    return [TokenLogprobs.model_construct(logprob=cont.logprob, top=top)]
