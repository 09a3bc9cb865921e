"""Batched token sampling from float32 logits ``[B, V]``, on the logits' device.

Greedy rows (temperature 0, or below ``GREEDY_TEMPERATURE``, where dividing by it would overflow
the logits) take the argmax. Other rows are scaled by their temperature, masked to
their top-k tokens and then to the smallest set whose probability mass reaches top-p (the most
likely token is always kept), and sampled with the exponential-race trick: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. draws index i with probability p_i.

Seeded rows draw their noise from a generator seeded with ``mix(seed, output_index)``, so a token
depends only on the request's seed, the index of the output token and its logits, never on the
batch it is sampled in or the worker sampling it: a prefill worker sampling token 0 and a decode
worker sampling tokens 1.. reproduce a single worker. Unseeded rows share one global generator.

That independence also lets a batch whose sampling raised be sampled again row by row
(``sample_rows_alone``): the rows at fault are found and the others keep their tokens.

Logprobs (``SamplingParams.logprobs``, ``gather_logprobs``) are the raw ``log_softmax`` of the
model's logits, as vLLM V1 returns them by default: not of the distribution after temperature,
top-k and top-p, so greedy and sampled rows report the same kind of number and a token's logprob
does not depend on how it was drawn. They are computed on the device, only for the rows that ask
and only when some row of the batch does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.shared.kvtransfer.devcopy import host_values_to
from tandem.shared.protocol.serving import GREEDY_TEMPERATURE, SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, output_index: int) -> int:
    """Stable 63-bit seed for (seed, output_index): two SplitMix64 rounds (same on every machine)."""
    state = (seed & _MASK64) ^ ((output_index * 0x9E3779B97F4A7C15) & _MASK64)
    for _ in range(2):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1  # torch.Generator.manual_seed takes it on every version


def _top_k_top_p_mask(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (one descending sort per row)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), vocab)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token; the most likely token always survives (even a top_p that
    # rounds to 0 in float32). Rows with top_p = 1 skip the mask: rounding could push the cumsum
    # past 1.0 in the tail.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_ps[:, None]) & (top_ps < 1.0)[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return sampled token ids ``LongTensor[B]`` for float32 ``logits[B, V]``.

    ``output_indices[i]`` is the index (0-based, among the request's output tokens) of the token
    row i samples; ``generator`` serves unseeded rows (torch's default one when None).
    """
    device = logits.device
    greedy_ids = logits.argmax(dim=-1)
    if all(p.temperature < GREEDY_TEMPERATURE for p in params):
        return greedy_ids

    temps = host_values_to(device, [p.temperature if p.temperature >= GREEDY_TEMPERATURE else 0.0 for p in params],
                           torch.float32)
    greedy = temps == 0.0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_ks = host_values_to(device, [p.top_k for p in params], torch.long)
        top_ps = host_values_to(device, [p.top_p for p in params], torch.float32)
        scaled = _top_k_top_p_mask(scaled, top_ks, top_ps)
    probs = scaled.softmax(dim=-1)

    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, (p, index) in enumerate(zip(params, output_indices)):
        if p.seed is not None and p.temperature >= GREEDY_TEMPERATURE:
            row_gen = torch.Generator(device=device)
            row_gen.manual_seed(mix_seed(p.seed, index))
            noise[row] = torch.empty_like(probs[row]).exponential_(generator=row_gen)
    # Exp(1) draws can underflow to 0; a tiny floor keeps p / E finite and zero-probability rows at 0.
    sampled = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, sampled)


@dataclass
class SampledLogprobs:
    """Logprobs of one sampled batch's rows that asked for them: ``rows`` (their batch rows, in
    order) and ``top_counts`` (each one's N) are host lists; the tensors may be on the device."""

    rows: list[int]
    top_counts: list[int]
    chosen: torch.Tensor  # float32 [R]: the sampled token's logprob
    top_ids: torch.Tensor  # long [R, K], K = max(top_counts): most likely first
    top_values: torch.Tensor  # float32 [R, K]

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> SampledLogprobs:
        """The same record with each tensor replaced by ``move(tensor)`` (a copy to the host, say)."""
        return SampledLogprobs(self.rows, self.top_counts, move(self.chosen), move(self.top_ids), move(self.top_values))

    def per_row(self, num_rows: int) -> list[TokenLogprobs | None]:
        """One entry per batch row (None for rows that did not ask); the tensors must be readable."""
        entries: list[TokenLogprobs | None] = [None] * num_rows
        chosen, top_ids, top_values = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        for i, (row, count) in enumerate(zip(self.rows, self.top_counts)):
            # model_construct: the values come from the model, not from a peer; no need to validate them.
            entries[row] = TokenLogprobs.model_construct(
                logprob=chosen[i], top=list(zip(top_ids[i][:count], top_values[i][:count])))
        return entries


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                    params: Sequence[SamplingParams]) -> SampledLogprobs | None:
    """Logprobs of ``token_ids`` (``LongTensor[B]``, sampled from float32 ``logits[B, V]``) and each
    row's top ``params[i].logprobs`` alternatives, for the rows that ask; None, with no device
    work, when none does. Raw ``log_softmax`` of the logits (see the module docstring)."""
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    if len(rows) < len(params):
        index = host_values_to(logits.device, rows, torch.long)
        logits, token_ids = logits.index_select(0, index), token_ids.index_select(0, index)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    top_counts = [min(params[row].logprobs, logits.shape[-1]) for row in rows]
    top_values, top_ids = logprobs.topk(max(top_counts), dim=-1)
    return SampledLogprobs(rows, top_counts, chosen, top_ids, top_values)


def sample_rows_alone(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """``sample`` one row at a time, for a batch whose ``sample`` raised: ``(ids, failed)``, where
    ``failed`` maps each row whose own sampling raises to what it raised (its id is a placeholder 0).

    Greedy and seeded rows get the tokens the batch would have given them (a row's token depends
    only on its logits, parameters, seed and output index); unseeded rows draw other noise from
    ``generator``, as in any other batch. One ``sample`` per row: only for the rare failed batch.
    """
    ids: list[torch.Tensor] = []
    failed: dict[int, Exception] = {}
    for row, (p, index) in enumerate(zip(params, output_indices)):
        try:
            ids.append(sample(logits[row : row + 1], [p], [index], generator))
        except Exception as exc:
            failed[row] = exc
            ids.append(torch.zeros(1, dtype=torch.long, device=logits.device))
    return torch.cat(ids), failed
