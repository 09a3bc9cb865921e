"""The multi-LoRA Triton kernels (``shared/lora/triton_bgmv.py``) on CUDA at the 8B preset's shapes.

``add_bgmv`` (both ways, ``rows`` and ``grouped``) and ``add_sgmv`` in bf16 against the float32
reference (``ops.add_gathered``/``ops.add_segmented`` over the same weights cast up), within bf16's
rounding of the result: the kernels accumulate in float32 and round once. Rows and runs of slot -1
must come back bit for bit. A CUDA graph captured around ``add_bgmv`` and replayed after the
``token_slots`` (and ``x``) buffers got new contents must give the new batch's result: the kernels
read the slots on the device and size their grids from shapes only.

The same kernels under Triton's interpreter, in float32 on small shapes:
tests/unit/lora/test_lora_kernels_interpret.py. Timing: benchmarks/lora_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from tandem.shared.lora import ops
from tandem.shared.lora.groups import LoraGroup, lora_groups
from tandem.shared.lora.triton_bgmv import HAS_TRITON, INTERPRETED, add_bgmv, add_sgmv, supports
from tandem.shared.model.meta import PRESETS

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")

# qkv 4096 -> 6144 (three targets), o 4096 -> 4096, gate_up 4096 -> 28672 (two), down 14336 -> 4096
GROUPS = lora_groups(PRESETS["llama3-8b"])
SLOTS = 8
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def stacks(group: LoraGroup, rank: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's ``a``/``b`` stacks, scaled so that the products are of the order of one."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    n = len(group.out_sizes)
    a = torch.randn(SLOTS, n * rank, group.in_features, generator=generator, device="cuda") / group.in_features ** 0.5
    b = torch.randn(SLOTS, group.out_features, rank, generator=generator, device="cuda") / rank ** 0.5
    return a.to(dtype), b.to(dtype)


def row_slots(tokens: int, seed: int) -> torch.Tensor:
    """Every slot in use (from nine rows on), a row in nine without an adapter, the order shuffled."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.arange(tokens) % (SLOTS + 1) - 1  # -1, 0, 1, ..., 7, -1, ...
    if tokens == 1:
        slots[0] = 3
    return slots[torch.randperm(tokens, generator=generator)].cuda()


def reference_gathered(before: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup,
                       rank: int, token_slots: torch.Tensor) -> torch.Tensor:
    out = before.float()
    ops.add_gathered(out, x.float(), a.float(), b.float(), group, rank, token_slots)
    return out


def check(out: torch.Tensor, reference: torch.Tensor, before: torch.Tensor, untouched: torch.Tensor,
          what: str) -> None:
    tolerance = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance,
                               msg=lambda m: f"{what}: the kernel differs from the float32 reference\n{m}")
    assert torch.equal(out[untouched], before[untouched]), f"{what}: a row without an adapter changed"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method", ["rows", "grouped"])
@pytest.mark.parametrize("tokens", [1, 7, 32, 256])
@pytest.mark.parametrize("group_name", list(GROUPS))
def test_bgmv_matches_the_float32_reference(group_name: str, tokens: int, method: str) -> None:
    group, rank = GROUPS[group_name], 16
    a, b = stacks(group, rank, torch.bfloat16, seed=tokens)
    x = torch.randn(tokens, group.in_features, device="cuda").to(torch.bfloat16)
    before = torch.randn(tokens, group.out_features, device="cuda").to(torch.bfloat16)
    token_slots = row_slots(tokens, seed=tokens)
    out = before.clone()
    add_bgmv(out, x, a, b, group, rank, token_slots, method=method)
    check(out, reference_gathered(before, x, a, b, group, rank, token_slots), before, token_slots < 0,
          f"{method} {group_name} x{tokens}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method", ["rows", "grouped"])
@pytest.mark.parametrize(("rank", "dtype"), [(8, torch.bfloat16), (32, torch.bfloat16), (64, torch.bfloat16),
                                             (16, torch.float16), (16, torch.float32)])
def test_bgmv_other_ranks_and_dtypes(rank: int, dtype: torch.dtype, method: str) -> None:
    group, tokens = GROUPS["qkv"], 37
    a, b = stacks(group, rank, dtype, seed=rank)
    x = torch.randn(tokens, group.in_features, device="cuda").to(dtype)
    before = torch.randn(tokens, group.out_features, device="cuda").to(dtype)
    token_slots = row_slots(tokens, seed=rank)
    out = before.clone()
    add_bgmv(out, x, a, b, group, rank, token_slots, method=method)
    check(out, reference_gathered(before, x, a, b, group, rank, token_slots), before, token_slots < 0,
          f"{method} rank {rank} {dtype}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("known_longest", [False, True])
@pytest.mark.parametrize("group_name", list(GROUPS))
def test_sgmv_matches_the_float32_reference(group_name: str, known_longest: bool) -> None:
    group, rank, tokens = GROUPS[group_name], 16, 1500
    runs = [(0, 0, 300), (-1, 300, 310), (3, 310, 1100), (5, 1100, 1101), (0, 1101, 1101), (7, 1101, 1490)]
    # rows 1490.. belong to no run: left alone
    a, b = stacks(group, rank, torch.bfloat16, seed=1)
    x = torch.randn(tokens, group.in_features, device="cuda").to(torch.bfloat16)
    before = torch.randn(tokens, group.out_features, device="cuda").to(torch.bfloat16)
    starts = torch.tensor([start for _, start, _ in runs] + [runs[-1][2]], dtype=torch.int32, device="cuda")
    slots = torch.tensor([slot for slot, _, _ in runs], dtype=torch.int64, device="cuda")
    out = before.clone()
    add_sgmv(out, x, a, b, group, rank, starts, slots,
             max_segment_rows=max(end - start for _, start, end in runs) if known_longest else None)
    reference = before.float()
    ops.add_segmented(reference, x.float(), a.float(), b.float(), group, rank, [run for run in runs if run[0] >= 0])
    untouched = torch.ones(tokens, dtype=torch.bool, device="cuda")
    for slot, start, end in runs:
        if slot >= 0:
            untouched[start:end] = False
    check(out, reference, before, untouched, f"sgmv {group_name}")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method", ["rows", "grouped"])
@pytest.mark.parametrize("tokens", [1, 32])
def test_graph_replay_reads_the_new_slots(tokens: int, method: str) -> None:
    """Capture once; replay with other slots (and inputs) in the same buffers: the new batch's sums."""
    group, rank = GROUPS["qkv"], 16
    a, b = stacks(group, rank, torch.bfloat16, seed=2)
    x = torch.randn(tokens, group.in_features, device="cuda").to(torch.bfloat16)
    before = torch.randn(tokens, group.out_features, device="cuda").to(torch.bfloat16)
    token_slots = row_slots(tokens, seed=3)
    out = before.clone()
    add_bgmv(out, x, a, b, group, rank, token_slots, method=method)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(before)
        add_bgmv(out, x, a, b, group, rank, token_slots, method=method)
    for seed in (4, 5):
        new_slots = (token_slots + seed) % (SLOTS + 1) - 1 if tokens > 1 else torch.full_like(token_slots, seed)
        token_slots.copy_(new_slots)
        x.copy_(torch.randn(tokens, group.in_features, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference_gathered(before, x, a, b, group, rank, token_slots), before, token_slots < 0,
              f"{method} replay {seed}")
    token_slots.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, before), "a batch without adapters changed the output"


@pytest.mark.gpu
@requires_cuda
def test_supports_cuda_tensors() -> None:
    assert supports(torch.zeros(1, device="cuda"))
    assert supports(torch.zeros(1)) == INTERPRETED  # CPU tensors only under the interpreter
