"""Triton kernels for the low-rank products of a mixed batch: BGMV (each row's slot read on the device,
graph-capturable, for decode) and SGMV (runs of rows sharing a slot, tiled GEMMs, for prefill).

They compute what :mod:`tandem.shared.lora.ops` computes (``add_gathered`` and ``add_segmented``, the
references), over the same stacks: ``a [slots, n*R, in]`` and ``b [slots, out, R]``, ``out`` updated
in place, float32 accumulation whatever the data's dtype. Each call is two launches (and a zeroing
of ``s`` where a ``tl.dot`` shrink splits ``in``, its splits adding atomically):

* shrink: ``s = x @ A[slot]^T``, float32, ``[n*R]`` a row. The ``in`` dimension is split across
  programs when the rows alone would leave SMs idle (a batch of one row still spreads over them);
* expand: ``out[:, cols] += s[:, proj(col)*R : +R] @ B[slot, cols]^T``, ``proj(col)`` the target whose
  columns hold ``col``: a block of columns may straddle two targets, each column takes its own
  target's ``R`` values.

:func:`add_bgmv` has two ways to find a row's adapter. ``rows``: a program per row (and target and
split, or block of columns), Punica's BGMV; each row reads its adapter's A and B whole, rows sharing
one meet in L2; the splits' partial sums go to planes of ``s [splits, T, n*R]`` that the expand adds
up as it reads them (no atomics, no zeroing). ``grouped``: a program per slot of the stack and block
of rows, which compares the block's ``token_slots`` with its slot and exits at once when no row
matches; otherwise the adapter's tiles are read once for all the matching rows, multiplied with
``tl.dot`` (rows of other slots masked), splits added atomically into a zeroed ``s``. The second
reads each adapter once per block of rows instead of once per row, at the cost of programs for
unused slots and multiplies over masked rows. :func:`add_sgmv` is the grouped kernels over runs.

A row (or run) whose slot is -1 is never touched: no program reads its weights, writes its ``s``
or its ``out``. Launch grids depend on shapes only (rows, features, stack size, the device's SM
count), never on device data, and ``s`` comes from ``torch.empty``/``torch.zeros``: ``add_bgmv``
captures in a CUDA graph and replays with new ``token_slots`` contents.

Importing never fails: without Triton ``HAS_TRITON`` is False and :func:`supports` says no (callers
use ``ops``). ``TRITON_INTERPRET=1``, set before ``triton`` is first imported, runs the kernels on
CPU tensors (tests/unit/lora/test_lora_kernels_interpret.py).
"""

from __future__ import annotations

import functools

import torch

from tandem.shared.infra.triton_runtime import HAS_TRITON, tl, triton
from tandem.shared.lora.groups import LoraGroup

MAX_TARGETS = 4  # targets a group may concatenate (q/k/v is three)
MAX_SPLITS = 32  # splits of ``in`` at most (the per-row expand reads every split's partial sums)
PROGRAMS_PER_SM = 4  # how many programs a shrink aims at per SM when it splits ``in``
GROUPED_FROM_ROWS = 8  # add_bgmv's "auto": the grouped kernels from this many rows, one program per row below


@triton.jit
def _first_target(col, BOUND1, BOUND2, BOUND3, TARGETS: tl.constexpr):
    """The target whose columns hold ``col`` (scalar or block): the boundaries it has passed."""
    proj = (col < 0).to(tl.int32)  # zero, shaped like col
    if TARGETS > 1:
        proj += (col >= BOUND1).to(tl.int32)
    if TARGETS > 2:
        proj += (col >= BOUND2).to(tl.int32)
    if TARGETS > 3:
        proj += (col >= BOUND3).to(tl.int32)
    return proj


# Pointers: what may pass 2**31 elements (a slot's offset in a stack, a row's in a long batch) is
# added as a 64-bit scalar; per-element offsets within a tile stay 32-bit (fewer registers).


@triton.jit
def _bgmv_shrink_kernel(X, A, Slots, S, stride_xt, stride_a0, stride_a1, stride_ss, stride_st, K, K_PER_SPLIT,
                        R: tl.constexpr, RP: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: one row, one target's R outputs, one split of ``in``."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.arange(0, RP)
    kk = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    a_rows = A + slot * stride_a0 + ((j * R + r) * stride_a1)[:, None]
    x_row = X + t * stride_xt
    acc = tl.zeros((RP, BLOCK_K), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs = k + kk
        kmask = offs < k_end
        xv = tl.load(x_row + offs, mask=kmask, other=0.0).to(tl.float32)
        av = tl.load(a_rows + offs[None, :], mask=(r < R)[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += av * xv[None, :]
    tl.store(S + split * stride_ss + t * stride_st + j * R + r, tl.sum(acc, axis=1), mask=r < R)


@triton.jit
def _bgmv_expand_kernel(Out, B, Slots, S, stride_ot, stride_b0, stride_b1, stride_ss, stride_st, N, SPLITS,
                        BOUND1, BOUND2, BOUND3, R: tl.constexpr, RP: tl.constexpr, SPLITS_P: tl.constexpr,
                        TARGETS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: one row, BLOCK_N output columns, the full R of each column's target in registers."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    r = tl.arange(0, RP)
    rmask = r < R
    b = tl.load(B + slot * stride_b0 + (cols * stride_b1)[:, None] + r[None, :], mask=cmask[:, None] & rmask[None, :],
                other=0.0).to(tl.float32)
    sp = tl.arange(0, SPLITS_P)
    s_rows = S + t * stride_st + (sp * stride_ss)[:, None] + r[None, :]
    smask = (sp < SPLITS)[:, None] & rmask[None, :]
    if TARGETS == 1:
        delta = tl.sum(b * tl.sum(tl.load(s_rows, mask=smask, other=0.0), axis=0)[None, :], axis=1)
    else:
        proj = _first_target(cols, BOUND1, BOUND2, BOUND3, TARGETS)
        first = _first_target(block * BLOCK_N, BOUND1, BOUND2, BOUND3, TARGETS)
        last = _first_target(tl.minimum(block * BLOCK_N + BLOCK_N, N) - 1, BOUND1, BOUND2, BOUND3, TARGETS)
        delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TARGETS):
            if (first <= j) & (last >= j):
                s_j = tl.sum(tl.load(s_rows + j * R, mask=smask, other=0.0), axis=0)  # the splits' sum
                delta = tl.where(proj == j, tl.sum(b * s_j[None, :], axis=1), delta)
    out = Out + t * stride_ot + cols
    tl.store(out, (tl.load(out, mask=cmask, other=0.0).to(tl.float32) + delta).to(Out.dtype.element_ty), mask=cmask)


@triton.jit
def _shrink_tile(X, A, S, row0, row_mask, slot, j, split, stride_xt, stride_a0, stride_a1, stride_st, K, K_PER_SPLIT,
                 R: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, ATOMIC: tl.constexpr):
    """``s[rows, j*R : +R] (+)= x[rows, split's in] @ A[slot, j*R : +R, split's in]^T`` for the rows
    ``row0 + i`` of ``row_mask``: each step's A tile serves all BLOCK_M rows (``tl.dot``); masked rows
    read nothing."""
    m = tl.arange(0, BLOCK_M)
    r = tl.arange(0, RP)
    rmask = r < R
    kk = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_rows = X + row0 * stride_xt + (m * stride_xt)[:, None]
    a_rows = A + slot * stride_a0 + ((j * R + r) * stride_a1)[:, None]
    acc = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs = k + kk
        kmask = offs < k_end
        xv = tl.load(x_rows + offs[None, :], mask=row_mask[:, None] & kmask[None, :], other=0.0)
        av = tl.load(a_rows + offs[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(xv, tl.trans(av), acc, input_precision=PRECISION)
    dest = S + row0 * stride_st + (m * stride_st)[:, None] + j * R + r[None, :]
    if ATOMIC:  # the splits of ``in`` add into one zeroed plane
        tl.atomic_add(dest, acc, mask=row_mask[:, None] & rmask[None, :], sem="relaxed")
    else:
        tl.store(dest, acc, mask=row_mask[:, None] & rmask[None, :])


@triton.jit
def _expand_tile(Out, B, S, row0, row_mask, slot, block, stride_ot, stride_b0, stride_b1, stride_st, N,
                 BOUND1, BOUND2, BOUND3, R: tl.constexpr, RP: tl.constexpr, TARGETS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """``out[rows, block's cols] += s[rows, proj*R : +R] @ B[slot, cols]^T`` for the rows ``row0 + i`` of
    ``row_mask``: one ``tl.dot`` per target whose columns the block holds (B's columns of the others
    zeroed for it)."""
    m = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    r = tl.arange(0, RP)
    rmask = r < R
    b = tl.load(B + slot * stride_b0 + (cols * stride_b1)[:, None] + r[None, :], mask=cmask[:, None] & rmask[None, :],
                other=0.0).to(tl.float32)
    s_rows = S + row0 * stride_st + (m * stride_st)[:, None] + r[None, :]
    smask = row_mask[:, None] & rmask[None, :]
    if TARGETS == 1:
        acc = tl.dot(tl.load(s_rows, mask=smask, other=0.0), tl.trans(b), input_precision=PRECISION)
    else:
        proj = _first_target(cols, BOUND1, BOUND2, BOUND3, TARGETS)
        first = _first_target(block * BLOCK_N, BOUND1, BOUND2, BOUND3, TARGETS)
        last = _first_target(tl.minimum(block * BLOCK_N + BLOCK_N, N) - 1, BOUND1, BOUND2, BOUND3, TARGETS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TARGETS):
            if (first <= j) & (last >= j):
                b_j = tl.where((proj == j)[:, None], b, 0.0)
                acc = tl.dot(tl.load(s_rows + j * R, mask=smask, other=0.0), tl.trans(b_j), acc,
                             input_precision=PRECISION)
    out = Out + row0 * stride_ot + (m * stride_ot)[:, None] + cols[None, :]
    omask = row_mask[:, None] & cmask[None, :]
    tl.store(out, (tl.load(out, mask=omask, other=0.0).to(tl.float32) + acc).to(Out.dtype.element_ty), mask=omask)


@triton.jit
def _sgmv_shrink_kernel(X, A, SegStarts, SegSlots, S, stride_xt, stride_a0, stride_a1, stride_st, K, K_PER_SPLIT,
                        R: tl.constexpr, RP: tl.constexpr, TARGETS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ATOMIC: tl.constexpr):
    """One program: the ``tile``-th BLOCK_M rows of one run, one target, one split of ``in``."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    slot = tl.load(SegSlots + seg).to(tl.int64)
    end = tl.load(SegStarts + seg + 1).to(tl.int64)
    row0 = tl.load(SegStarts + seg).to(tl.int64) + tile * BLOCK_M
    if (slot < 0) | (row0 >= end):
        return
    row_mask = tl.arange(0, BLOCK_M) < end - row0
    _shrink_tile(X, A, S, row0, row_mask, slot, tl.program_id(2) % TARGETS, tl.program_id(2) // TARGETS,
                 stride_xt, stride_a0, stride_a1, stride_st, K, K_PER_SPLIT, R, RP, BLOCK_M, BLOCK_K, PRECISION,
                 ATOMIC)


@triton.jit
def _sgmv_expand_kernel(Out, B, SegStarts, SegSlots, S, stride_ot, stride_b0, stride_b1, stride_st, N,
                        BOUND1, BOUND2, BOUND3, R: tl.constexpr, RP: tl.constexpr, TARGETS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One program: the ``tile``-th BLOCK_M rows of one run, BLOCK_N output columns."""
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    slot = tl.load(SegSlots + seg).to(tl.int64)
    end = tl.load(SegStarts + seg + 1).to(tl.int64)
    row0 = tl.load(SegStarts + seg).to(tl.int64) + tile * BLOCK_M
    if (slot < 0) | (row0 >= end):
        return
    row_mask = tl.arange(0, BLOCK_M) < end - row0
    _expand_tile(Out, B, S, row0, row_mask, slot, tl.program_id(2), stride_ot, stride_b0, stride_b1, stride_st, N,
                 BOUND1, BOUND2, BOUND3, R, RP, TARGETS, BLOCK_M, BLOCK_N, PRECISION)


@triton.jit
def _grouped_shrink_kernel(X, A, Slots, S, tokens, stride_xt, stride_a0, stride_a1, stride_st, K, K_PER_SPLIT,
                           R: tl.constexpr, RP: tl.constexpr, TARGETS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ATOMIC: tl.constexpr):
    """One program: one slot of the stack, those of BLOCK_M consecutive rows that use it (none: exit at
    once), one target, one split of ``in``. The slot's A is read once for all its rows in the block."""
    slot = tl.program_id(0)
    row0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    m = tl.arange(0, BLOCK_M)
    mine = tl.load(Slots + row0 + m, mask=m < tokens - row0, other=-1) == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    _shrink_tile(X, A, S, row0, mine, slot.to(tl.int64), tl.program_id(2) % TARGETS, tl.program_id(2) // TARGETS,
                 stride_xt, stride_a0, stride_a1, stride_st, K, K_PER_SPLIT, R, RP, BLOCK_M, BLOCK_K, PRECISION,
                 ATOMIC)


@triton.jit
def _grouped_expand_kernel(Out, B, Slots, S, tokens, stride_ot, stride_b0, stride_b1, stride_st, N,
                           BOUND1, BOUND2, BOUND3, R: tl.constexpr, RP: tl.constexpr, TARGETS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One program: one slot, its rows among BLOCK_M consecutive ones, BLOCK_N output columns."""
    slot = tl.program_id(0)
    row0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    m = tl.arange(0, BLOCK_M)
    mine = tl.load(Slots + row0 + m, mask=m < tokens - row0, other=-1) == slot
    if tl.max(mine.to(tl.int32), axis=0) == 0:
        return
    _expand_tile(Out, B, S, row0, mine, slot.to(tl.int64), tl.program_id(2), stride_ot, stride_b0, stride_b1,
                 stride_st, N, BOUND1, BOUND2, BOUND3, R, RP, TARGETS, BLOCK_M, BLOCK_N, PRECISION)


INTERPRETED = HAS_TRITON and type(_bgmv_shrink_kernel).__name__ == "InterpretedFunction"


def supports(x: torch.Tensor) -> bool:
    """Whether :func:`add_bgmv` and :func:`add_sgmv` run for ``x``: a CUDA tensor with Triton, or any
    tensor when the kernels were defined under ``TRITON_INTERPRET=1``; otherwise use ``ops``."""
    return HAS_TRITON and (x.is_cuda or INTERPRETED)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs_wanted(x: torch.Tensor) -> int:
    if not x.is_cuda:
        return 8  # the interpreter: few programs, quick tests
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return max(1, int(PROGRAMS_PER_SM * _sm_count(index)))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_k(k: int, programs: int, wanted: int, block_k: int) -> tuple[int, int]:
    """``(splits, k_per_split)``: enough splits of ``in`` (each a whole number of ``block_k``) that
    ``programs`` times them reaches ``wanted``, at most one split a ``block_k`` and :data:`MAX_SPLITS`."""
    splits = max(1, min(MAX_SPLITS, _cdiv(k, block_k), _cdiv(wanted, max(1, programs))))
    k_per_split = _cdiv(_cdiv(k, splits), block_k) * block_k
    return _cdiv(k, k_per_split), k_per_split


def _target_bounds(group: LoraGroup, out_features: int) -> tuple[int, int, int]:
    """Where targets 1, 2 and 3 start (``out_features`` past the last one), and the target count's check."""
    if not 1 <= len(group.out_sizes) <= MAX_TARGETS:
        raise ValueError(f"group {group.name!r} has {len(group.out_sizes)} targets; "
                         f"the kernels take 1 to {MAX_TARGETS}")
    if group.out_features != out_features:
        raise ValueError(f"group {group.name!r} has {group.out_features} output features; out has {out_features}")
    starts = list(group.out_offsets()[1:]) + [out_features] * MAX_TARGETS
    return starts[0], starts[1], starts[2]


def _check(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup, rank: int) -> None:
    targets = len(group.out_sizes)
    if a.shape[1] != targets * rank or a.shape[2] != x.shape[1]:
        raise ValueError(f"a is {tuple(a.shape)}; expected [slots, {targets * rank}, {x.shape[1]}]")
    if b.shape[1] != out.shape[1] or b.shape[2] != rank or b.shape[0] != a.shape[0]:
        raise ValueError(f"b is {tuple(b.shape)}; expected [{a.shape[0]}, {out.shape[1]}, {rank}]")
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x {x.shape[0]}")
    for name, tensor in (("out", out), ("x", x), ("a", a), ("b", b)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")


def _precision(x: torch.Tensor) -> str:
    """float32 data multiplies in full float32; half data's float32 operands (the fp32 ``s``) use tf32,
    which holds bf16/fp16 weights exactly."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _grouped_blocks(tokens: int, rank: int) -> tuple[int, int, int, int]:
    """``(RP, BLOCK_M, BLOCK_N, num_warps)`` of the ``tl.dot`` kernels: R padded to ``tl.dot``'s
    smallest inner dimension, row tiles as tall as the rows (16 to 64), output tiles of 64 or 128
    columns; eight warps from 32-row tiles or R 64 on (four spill registers there)."""
    rp = max(16, _next_pow2(rank))
    block_m = max(16, min(64, _next_pow2(tokens)))
    return rp, block_m, 128 if rp <= 32 else 64, 8 if block_m >= 32 or rp >= 64 else 4


def _add_rows(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int,
              token_slots: torch.Tensor, targets: int, bounds: tuple[int, int, int]) -> None:
    tokens, k, n = x.shape[0], x.shape[1], out.shape[1]
    rp = _next_pow2(rank)
    wanted = _programs_wanted(x)
    block_k = max(32, min(256, 2048 // rp))
    splits, k_per_split = _split_k(k, tokens * targets, wanted, block_k)
    s = torch.empty((splits, tokens, targets * rank), dtype=torch.float32, device=x.device)
    _bgmv_shrink_kernel[(tokens, targets, splits)](
        x, a, token_slots, s, x.stride(0), a.stride(0), a.stride(1), s.stride(0), s.stride(1), k, k_per_split,
        R=rank, RP=rp, BLOCK_K=block_k, num_warps=4,
    )
    block_n = min(256, max(16, 4096 // rp))
    while block_n > 64 and tokens * _cdiv(n, block_n) < wanted:
        block_n //= 2
    _bgmv_expand_kernel[(tokens, _cdiv(n, block_n))](
        out, b, token_slots, s, out.stride(0), b.stride(0), b.stride(1), s.stride(0), s.stride(1), n, splits,
        *bounds, R=rank, RP=rp, SPLITS_P=max(2, _next_pow2(splits)), TARGETS=targets, BLOCK_N=block_n,
        num_warps=4,
    )


def _add_grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int,
                 token_slots: torch.Tensor, targets: int, bounds: tuple[int, int, int]) -> None:
    tokens, k, n, slots = x.shape[0], x.shape[1], out.shape[1], a.shape[0]
    rp, block_m, block_n, warps = _grouped_blocks(tokens, rank)
    row_blocks = _cdiv(tokens, block_m)
    block_k = 64
    # The programs with rows to do: a row block holds at most min(slots, BLOCK_M) slots.
    busy = min(slots, block_m, tokens) * row_blocks * targets
    splits, k_per_split = _split_k(k, busy, _programs_wanted(x), block_k)
    precision = _precision(x)
    s = (torch.zeros if splits > 1 else torch.empty)((tokens, targets * rank), dtype=torch.float32, device=x.device)
    _grouped_shrink_kernel[(slots, row_blocks, targets * splits)](
        x, a, token_slots, s, tokens, x.stride(0), a.stride(0), a.stride(1), s.stride(0), k, k_per_split,
        R=rank, RP=rp, TARGETS=targets, BLOCK_M=block_m, BLOCK_K=block_k, PRECISION=precision, ATOMIC=splits > 1,
        num_warps=warps,
    )
    _grouped_expand_kernel[(slots, row_blocks, _cdiv(n, block_n))](
        out, b, token_slots, s, tokens, out.stride(0), b.stride(0), b.stride(1), s.stride(0), n, *bounds,
        R=rank, RP=rp, TARGETS=targets, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=warps,
    )


def add_bgmv(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup, rank: int,
             token_slots: torch.Tensor, method: str = "auto") -> None:
    """``ops.add_gathered``: ``out[t] += B[slot[t]] @ (A[slot[t]] @ x[t])`` target by target, for every row
    whose ``token_slots`` entry (device int tensor) is not -1. No host sync; graph-capturable.

    ``method``: ``"rows"``, a program per row (Punica's BGMV: each row reads its adapter's A and B,
    rows sharing one meet in L2), or ``"grouped"``, a program per slot of the stack and block of rows
    (its rows found by comparing ``token_slots``; the adapter's tiles read once for them all, ``tl.dot``
    over the block's rows; slots no row uses exit at once); ``"auto"``: ``grouped`` from
    :data:`GROUPED_FROM_ROWS` rows on."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    _check(out, x, a, b, group, rank)
    targets, bounds = len(group.out_sizes), _target_bounds(group, out.shape[1])
    if method == "auto":
        method = "grouped" if tokens >= GROUPED_FROM_ROWS else "rows"
    if method == "rows":
        _add_rows(out, x, a, b, rank, token_slots, targets, bounds)
    elif method == "grouped":
        _add_grouped(out, x, a, b, rank, token_slots, targets, bounds)
    else:
        raise ValueError(f"method {method!r}: expected 'auto', 'rows' or 'grouped'")


def add_sgmv(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: LoraGroup, rank: int,
             seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_segment_rows: int | None = None) -> None:
    """``ops.add_segmented`` over runs given on the device: run ``i`` is rows ``seg_starts[i]`` to
    ``seg_starts[i + 1]`` with slot ``seg_slots[i]`` (-1: skipped); ``seg_starts`` has one entry more than
    ``seg_slots``. Each run's rows go through the kernels ``BLOCK_M`` at a time (the adapter's tiles
    serve them all), one launch each for all runs. ``max_segment_rows``: the longest run, where the
    host knows it (fewer idle programs: the grid has a row tile per run for as many rows)."""
    tokens, segments = x.shape[0], seg_slots.shape[0]
    if tokens == 0 or segments == 0:
        return
    _check(out, x, a, b, group, rank)
    if seg_starts.shape[0] != segments + 1:
        raise ValueError(f"seg_starts has {seg_starts.shape[0]} entries for {segments} runs; expected {segments + 1}")
    targets, k, n = len(group.out_sizes), x.shape[1], out.shape[1]
    bounds = _target_bounds(group, n)
    longest = tokens if max_segment_rows is None else max(1, min(tokens, max_segment_rows))
    rp, block_m, block_n, warps = _grouped_blocks(longest, rank)
    tiles = _cdiv(longest, block_m)
    busy = min(tiles * segments, _cdiv(tokens, block_m) + segments) * targets  # programs with rows to do
    block_k = 64
    splits, k_per_split = _split_k(k, busy, _programs_wanted(x), block_k)
    precision = _precision(x)
    s = (torch.zeros if splits > 1 else torch.empty)((tokens, targets * rank), dtype=torch.float32, device=x.device)
    _sgmv_shrink_kernel[(tiles, segments, targets * splits)](
        x, a, seg_starts, seg_slots, s, x.stride(0), a.stride(0), a.stride(1), s.stride(0), k, k_per_split,
        R=rank, RP=rp, TARGETS=targets, BLOCK_M=block_m, BLOCK_K=block_k, PRECISION=precision, ATOMIC=splits > 1,
        num_warps=warps,
    )
    _sgmv_expand_kernel[(tiles, segments, _cdiv(n, block_n))](
        out, b, seg_starts, seg_slots, s, out.stride(0), b.stride(0), b.stride(1), s.stride(0), n, *bounds,
        R=rank, RP=rp, TARGETS=targets, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, num_warps=warps,
    )


__all__ = ["HAS_TRITON", "INTERPRETED", "add_bgmv", "add_sgmv", "supports"]
