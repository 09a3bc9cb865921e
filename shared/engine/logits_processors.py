"""Logits processing: a batch's raw float32 logits ``[B, V]`` turned into the logits it samples from.

What a request asks for (``SamplingParams``), defined and ordered as in vLLM V1's sampler:

1. ``min_tokens``: while a row has fewer than ``min_tokens`` output tokens, its stop tokens (the
   tokenizer's eos ids, even with ``ignore_eos``, and the request's ``stop_token_ids``) get -inf,
   so it cannot end before then. The detokenizer does the same for stop strings (``check_stop``).
2. ``logit_bias``: each ``(token id, bias)`` pair adds its bias to that token's logit; a token listed
   twice counts once, with its last bias (the list stands for the map OpenAI's API takes).
3. Penalties on the row's history (its sequence's tokens so far, prompt then output): repetition
   divides a positive logit by the penalty, and multiplies a negative one, of every token seen in
   the prompt or the output; frequency subtracts ``penalty * count`` for each token occurring
   ``count`` times in the output; presence subtracts ``penalty`` once for each token in the output.

Processing changes what is sampled, nothing else: logprobs stay the raw ``log_softmax`` of the
model's logits (see ``sampling``). It runs on the logits' device and touches only the rows that
ask: when no row does, the logits come back as they are, with no tensor built and no copy made.
The host values a step needs (every history as one padded id matrix, the rows and tokens to bias or
mask, the penalties) reach the device in one copy per dtype, never one per token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.shared.engine.sequence import has_penalties
from tandem.shared.kvtransfer.devcopy import host_values_to
from tandem.shared.protocol.serving import SamplingParams

if TYPE_CHECKING:
    from tandem.shared.engine.sequence import Sequence as EngineSequence


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seqs: Sequence[EngineSequence],
    output_indices: Sequence[int],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """The logits to sample from for float32 ``logits[B, V]`` (see the module docstring).

    Row ``i`` samples with ``params[i]`` the output token of index ``output_indices[i]`` of
    ``seqs[i]``, whose ``token_ids`` must hold every token before it when ``params[i]`` has a
    penalty (``min_tokens`` reads the index, so a token still in flight does not matter to it).
    Returns ``logits`` itself when no row asks for anything, else a new tensor whose rows that ask
    nothing equal the input's bit for bit; ``logits`` is never written.
    """
    vocab = logits.shape[-1]
    masked = [(row, stop_ids) for row, (p, index) in enumerate(zip(params, output_indices))
              if index < p.min_tokens and (stop_ids := _stop_ids(p, eos_token_ids, vocab))]
    biased = [(row, dict(p.logit_bias)) for row, p in enumerate(params) if p.logit_bias]
    penalized = [row for row, p in enumerate(params) if has_penalties(p)]
    if not (masked or biased or penalized):
        return logits

    longs, floats = _HostValues(), _HostValues()
    bias_at = longs.add([row * vocab + token for row, bias in biased for token in bias])
    bias_by = floats.add([value for _, bias in biased for value in bias.values()])
    mask_at = longs.add([row * vocab + token for row, tokens in masked for token in tokens])
    penalties = _plan_penalties(penalized, params, seqs, output_indices, vocab, longs, floats)
    on_device_longs, on_device_floats = longs.send(logits.device, torch.long), floats.send(logits.device, torch.float32)

    processed = logits.clone(memory_format=torch.contiguous_format)
    flat = processed.view(-1)
    if biased:  # each (row, token) at most once: the dict above
        flat.index_add_(0, on_device_longs[bias_at], on_device_floats[bias_by])
    if masked:  # after the bias, so a biased stop token is still masked
        flat.index_fill_(0, on_device_longs[mask_at], float("-inf"))
    if penalties is not None:
        penalties.apply(processed, on_device_longs, on_device_floats)
    return processed


def _stop_ids(params: SamplingParams, eos_token_ids: Collection[int], vocab: int) -> list[int]:
    """The tokens ``min_tokens`` masks, each once; ids outside the vocabulary are never sampled anyway."""
    return sorted({t for t in (*eos_token_ids, *params.stop_token_ids) if t < vocab})


class _HostValues:
    """Host values gathered for one step, sent to the device in one copy; ``add`` says where each
    list will lie in the sent tensor."""

    def __init__(self) -> None:
        self.values: list = []

    def add(self, values: Sequence) -> slice:
        start = len(self.values)
        self.values.extend(values)
        return slice(start, len(self.values))

    def send(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        return host_values_to(device, self.values, dtype) if self.values else None


@dataclass
class _Penalties:
    """The penalized rows of one step, planned on the host: where their row indices, histories
    (``[R, num_prompt + num_output]``, padded with the id ``vocab``) and penalties lie in the step's
    sent values, and which penalties any of them uses."""

    rows: list[int]
    all_rows: bool  # the rows are the whole batch, in order: no gather, no scatter
    row_at: slice
    history_at: slice
    num_prompt: int
    num_output: int
    penalties_at: slice  # repetition, frequency, presence: R values each
    vocab: int
    uses_repetition: bool
    uses_frequency: bool
    uses_presence: bool

    def apply(self, logits: torch.Tensor, longs: torch.Tensor, floats: torch.Tensor) -> None:
        """Penalize ``logits``'s planned rows in place."""
        num_rows, vocab = len(self.rows), self.vocab
        # Padding is the id ``vocab``: it lands in one extra column, dropped before use.
        history = longs[self.history_at].view(num_rows, self.num_prompt + self.num_output)
        repetition, frequency, presence = floats[self.penalties_at].view(3, num_rows, 1)
        index = None if self.all_rows else longs[self.row_at]
        rows = logits if index is None else logits.index_select(0, index)

        counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=logits.device)
        outputs = history[:, self.num_prompt :]
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=counts.dtype))
        counts = counts[:, :vocab]
        in_output = counts > 0
        if self.uses_repetition:
            seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, history[:, : self.num_prompt], True)
            seen = seen[:, :vocab] | in_output
            rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
        if self.uses_frequency:
            rows = rows - frequency * counts
        if self.uses_presence:
            rows = rows - presence * in_output
        if index is None:
            logits.copy_(rows)
        else:
            logits.index_copy_(0, index, rows)


def _plan_penalties(rows: list[int], params: Sequence[SamplingParams], seqs: Sequence[EngineSequence],
                    output_indices: Sequence[int], vocab: int, longs: _HostValues,
                    floats: _HostValues) -> _Penalties | None:
    """Lay out the penalized ``rows``' histories and penalties in the step's host values: one
    ``[R, P + O]`` id matrix, each row's prompt padded to the longest prompt P among the rows with a
    repetition penalty (the others need none of it) and its output to the longest output O."""
    if not rows:
        return None
    if len(seqs) != len(params):
        raise ValueError(f"penalties need each row's sequence: {len(params)} rows, {len(seqs)} sequences")
    repeating = [params[row].repetition_penalty != 1.0 for row in rows]
    prompts = [seqs[row].token_ids[: seqs[row].num_prompt_tokens] if rep else [] for row, rep in zip(rows, repeating)]
    outputs = []
    for row in rows:
        seq, index = seqs[row], output_indices[row]
        if seq.num_output_tokens < index:  # a token in flight: the penalties would miss it
            raise ValueError(f"row {row} samples output {index} of {seq.request_id!r}, which holds only "
                             f"{seq.num_output_tokens}: penalties need every token before it")
        outputs.append(seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + index])
    num_prompt, num_output = max(map(len, prompts)), max(map(len, outputs))
    history: list[int] = []
    for prompt, output in zip(prompts, outputs):
        history += prompt
        history += [vocab] * (num_prompt - len(prompt))
        history += output
        history += [vocab] * (num_output - len(output))
    row_at = longs.add(rows)
    history_at = longs.add(history)
    chosen = [params[row] for row in rows]
    penalties_at = floats.add([p.repetition_penalty for p in chosen] + [p.frequency_penalty for p in chosen]
                              + [p.presence_penalty for p in chosen])
    return _Penalties(rows, rows == list(range(len(params))), row_at, history_at, num_prompt, num_output,
                      penalties_at, vocab, uses_repetition=any(repeating),
                      uses_frequency=any(p.frequency_penalty != 0.0 for p in chosen),
                      uses_presence=any(p.presence_penalty != 0.0 for p in chosen))
