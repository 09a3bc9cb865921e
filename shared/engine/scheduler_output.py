"""What crosses from the scheduler to the model runner each step: the batch to run and the block
work that must happen before its forward.

The scheduler (``scheduler.py``) builds a :class:`ScheduledBatch`; the engine queues its swaps,
copies and imports (``LLMEngine._apply_swaps`` / ``_scatter_imports``) and hands it to the runner
(``ModelRunner.launch``), whose inputs it describes. The scheduler keeps every decision; this module
only carries them, so the runner and the engine depend on these records and not on the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.shared.engine.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One row group of a step: ``seq`` computes ``num_query_tokens`` tokens from its
    ``num_computed_tokens`` on."""

    seq: Sequence
    num_query_tokens: int  # tokens computed this step, from seq.num_computed_tokens on
    samples: bool  # this step computes the last known token, so a new token is sampled


@dataclass
class ScheduledBatch:
    """One step's work, empty (falsy) when nothing is to run."""

    items: list[ScheduledSequence] = field(default_factory=list)
    # Admitted hand-offs: scatter each CPU kv into seq.block_table before running the batch.
    # (sequence, K/V blocks to scatter, index of its first block they go to: blocks before it were cached)
    imports: list[tuple[Sequence, torch.Tensor, int]] = field(default_factory=list)
    # (source block, destination block): copy-on-write copies to make before the forward.
    copies: list[tuple[int, int]] = field(default_factory=list)
    # (device block, host block): swaps to queue before anything else of the batch, swap-outs first
    # (a swap-in or a copy may land in device blocks a swap-out freed; every swap-out of a batch was
    # decided before its swap-ins).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.items)
