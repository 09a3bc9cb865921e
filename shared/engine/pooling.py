"""Embeddings (``EngineRequest.pooling``): a sequence whose prompt is prefilled and pooled, never sampled.

What is pooled is the model's final hidden states, the final norm's output (what feeds the LM
head): ``last`` takes the last prompt position's row, ``mean`` the mean of every position's row.
The vector is then L2-normalised (as vLLM's pooler does for embeddings by default); with
``dimensions`` only its first N components are kept and normalised again.

A prompt may span several steps (chunked prefill), so each step adds its chunk: ``mean`` keeps a
running float32 sum of the rows on the device, ``last`` only the final chunk's last row. A chunk
that starts again from position 0 (a sequence preempted by recompute) starts the sum again; one
that starts anywhere but where the sum stops raises, so a gap can never pass for a vector. The
last chunk's vector is copied to the host without waiting (on CUDA an event marks it) and the
engine hands it out on the request's one :class:`RequestOutput`, finish reason "embedded".

A ``mean`` sequence claims no cached prefix (a cached block has K/V, not the hidden rows the sum
needs: the scheduler asks :func:`pools_every_position`); a ``last`` one does, since the last row is
computed here whatever came from the cache. Embedding sequences are never sampled (their
``fan_out`` is 0), never take part in overlapped steps and are never handed off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.shared.protocol.embedding import PoolingParams

if TYPE_CHECKING:
    from tandem.shared.engine.sequence import Sequence

FINISH_REASON = "embedded"


@dataclass
class Pooling:
    """One embedding sequence's pooled state, chunk by chunk, and its vector once the prompt is done."""

    method: str  # "last" or "mean"
    dimensions: int | None = None
    total: torch.Tensor | None = None  # mean: float32 sum of the rows of positions 0 .. pooled - 1
    pooled: int = 0  # positions summed so far (mean)
    vector: torch.Tensor | None = None  # the final vector on the host (readable once ``done``)
    done: torch.cuda.Event | None = None

    @classmethod
    def of(cls, params: PoolingParams) -> Pooling:
        return cls(params.method, params.dimensions)

    def add(self, rows: torch.Tensor, start: int, last: bool, to_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the hidden ``rows`` of positions ``start ..``; with ``last`` (the prompt's final
        chunk) make the vector."""
        if self.method == "mean":
            if start == 0:
                self.total, self.pooled = None, 0
            if start != self.pooled:
                raise RuntimeError(f"pooling: a chunk starts at position {start}, but positions are pooled up to "
                                   f"{self.pooled}")
            chunk = rows.float().sum(0)
            self.total = chunk if self.total is None else self.total + chunk
            self.pooled += rows.shape[0]
        if not last:
            return
        pooled = self.total / self.pooled if self.method == "mean" else rows[-1].float()
        if self.dimensions is not None:
            pooled = pooled[: self.dimensions]
        self.vector = to_host(torch.nn.functional.normalize(pooled, dim=0))
        self.total = None
        if self.vector.device.type == "cpu" and rows.device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()

    def result(self) -> torch.Tensor:
        """The vector (float32, on the host, unit L2 norm), once its copy is done."""
        if self.vector is None:
            raise RuntimeError("pooling: the prompt's last chunk has not run")
        if self.done is not None:
            self.done.synchronize()
        return self.vector


def pools_every_position(seq: Sequence) -> bool:
    """Whether ``seq``'s vector needs the hidden row of every prompt position (mean pooling), so it
    must compute them all here: no cached prefix, no imported K/V."""
    return seq.pooling is not None and seq.pooling.method == "mean"


@dataclass
class PooledRows:
    """``count`` hidden rows of one batch, from ``first_row`` on: ``seq``'s chunk from position
    ``seq.num_computed_tokens``; ``last`` when it ends the prompt."""

    seq: Sequence
    first_row: int
    count: int
    last: bool


def pool_rows(hidden: torch.Tensor, wanted: list[PooledRows], to_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Add each of ``wanted``'s chunks of ``hidden`` (``[T, H]``, one batch's) to its sequence's pooling."""
    for want in wanted:
        rows = hidden[want.first_row : want.first_row + want.count]
        want.seq.pooling.add(rows, want.seq.num_computed_tokens, want.last, to_host)
