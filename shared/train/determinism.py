"""Bit-exact training steps on CUDA: the kernels whose reduction order is fixed, for the span of a step.

Backward kernels of a training step accumulate with atomics by default on CUDA, so a rerun (or a
resumed run) drifts in the last bits from the first step on: the embedding gradient (``index_add_``:
duplicate token ids race) and attention's dQ (split over key blocks; cuDNN's kernel for causal rows
and the memory-efficient one used with a packing mask both say they are non-deterministic).
PyTorch's deterministic mode replaces each with a fixed-order version: ``index_add_`` becomes the
sorted, segment-by-segment ``index_put_`` and the attention kernels accumulate per split and reduce
afterwards. cuBLAS is deterministic on one stream
once its workspace is fixed (``CUBLAS_WORKSPACE_CONFIG``), which is set before the first handle is
made. The mode is global in PyTorch, so it is switched on for the step's launches only and put back
after: another model in the same process (a test, a served engine) keeps its own choice.

The cost is measured by ``benchmarks/train_offload.py --runs 3b:auto/auto+atomics`` (docs/measurements.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.utils.deterministic

CUBLAS_WORKSPACE = ":4096:8"  # 8 buffers of 4 MiB, PyTorch's documented choice for reproducibility


def fix_cublas_workspace() -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` unless the user did; it takes effect for cuBLAS handles made
    after this (a process's first matmul on a device), and quiets deterministic mode's check."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """PyTorch's deterministic algorithms on while the block runs (``enabled``), the previous mode after.

    Not ``warn_only``: with it, cuDNN's and the memory-efficient attention backward only warn and
    keep their atomics (PyTorch's dispatcher may pick cuDNN for the causal rows on a GPU that has it). An op with no
    deterministic version would then fail the step; the CUDA cases of
    tests/unit/train/test_train_resume.py show none is left in it."""
    if not enabled:
        yield
        return
    was_on, was_warn_only = (torch.are_deterministic_algorithms_enabled(),
                             torch.is_deterministic_algorithms_warn_only_enabled())
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    # The mode would also fill every torch.empty with NaN: a pass over memory the step writes before
    # it reads, at a measurable cost on the layers' activation buffers.
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling
