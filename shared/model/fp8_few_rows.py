"""fp8 weights times a few bf16/fp16 rows, in one Triton kernel: the decode step at small batch.

At batch 1 to 16 a decode step's linears are bound by reading their weights, so fp8 codes should
take half of bf16's time. The ``_scaled_mm`` path (``fp8.py``) does not get there at few rows: it
spends a kernel quantizing the activations per token, and cuBLASLt's fp8 GEMM pads the rows to 16
and is tuned for large products. This kernel reads each weight code once, widens it to the
activation dtype in registers and multiplies by the rows as they are (no activation quantization:
weight-only, so the result is closer to the dequantize reference than ``_scaled_mm``'s), applying
the output channel's float32 scale and the bias once at the end:

    out[m, n] = scale[n] * sum_k x[m, k] * codes[n, k] + bias[n]

One program owns ``BLOCK_N`` output channels and ``K / split`` of the inner axis. Three forms
(:class:`Tile`): the rows padded to 16 inside registers for ``tl.dot`` on either side of it, or
plain float32 multiply-adds for one to four rows, where widening the codes costs less than feeding
the tensor cores. Split-K (``split`` > 1) is for the 4,096-channel projections at few rows: 256
programs walking all of K each leave HBM idle while they start and drain, and splitting K shortens
that ramp (``benchmarks/fp8_linears.py`` times each projection against the HBM rate). Each program
stores its float32 partial and counts itself in on its column block's counter; the last to arrive
sums the partials in split order (so the bits do not depend on which program came last), applies
scale and bias, and sets the counter back to zero for the next launch. No float atomics: the same
inputs give the same bits. The form and tile are
chosen per weight shape and row bucket (1, 2-4, 5-16) by timing the candidates once
(:func:`tune`), before any CUDA graph is captured; a shape met first inside a capture takes the
first candidate that fits instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tandem.shared.infra.device_timing import graph_microseconds
from tandem.shared.infra.triton_runtime import HAS_TRITON, tl, triton

log = logging.getLogger("tandem.model")

MAX_ROWS = 16  # the rows one tl.dot tile holds: past it, _scaled_mm's tensor-core GEMM is the better path
ROW_BUCKETS = (1, 4, MAX_ROWS)  # a tile is tuned for each: 1 row, 2-4 rows, 5-16 rows
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # float32 would make tl.dot round through tf32
FORMS = ("dot", "dot_swapped", "fma")


@dataclass(frozen=True)
class Tile:
    """A kernel form and its tile. ``dot``: rows x codes^T on the tensor cores, the codes read as
    [BLOCK_K, BLOCK_N]; ``dot_swapped``: codes x rows^T (the codes the row-major left operand, the
    rows padded to 16 on the right); ``fma``: no tensor cores, each code widened to float32 and
    multiplied on the CUDA cores, for at most ``max_rows`` rows (one accumulator tile per row)."""

    form: str
    block_n: int
    block_k: int
    warps: int
    stages: int
    max_rows: int = MAX_ROWS
    split: int = 1  # programs per column block, each over K / split

    def fits(self, n: int, k: int, rows: int = 1) -> bool:
        return n % self.block_n == 0 and k % (self.block_k * self.split) == 0 and rows <= self.max_rows


# Candidates for a data-centre GPU of about 132 SMs: enough programs to cover every SM at 4,096 output channels
# (16 or 32 a program) up to wide tiles for the 28,672-channel gate/up projection, each with a few
# K steps in flight per program; the last two take any K that is a multiple of 64 or of 16 (small
# models: the tiny one's 256 and 704), which _scaled_mm's alignment already requires.
CANDIDATES = (
    Tile("dot", 16, 512, 4, 4),
    Tile("dot", 32, 256, 4, 4),
    Tile("dot", 64, 256, 4, 4),
    Tile("dot", 128, 256, 8, 3),
    Tile("dot_swapped", 16, 256, 4, 4),
    Tile("dot_swapped", 32, 256, 4, 4),
    Tile("dot_swapped", 64, 256, 4, 4),
    Tile("dot_swapped", 128, 128, 8, 4),
    Tile("fma", 16, 256, 4, 4, max_rows=1),
    Tile("fma", 32, 256, 4, 3, max_rows=1),
    Tile("fma", 64, 128, 4, 4, max_rows=1),
    Tile("fma", 16, 256, 4, 3, max_rows=4),
    Tile("fma", 32, 128, 4, 3, max_rows=4),
    Tile("dot", 16, 64, 4, 4),
    Tile("dot", 16, 16, 4, 2),
    # split-K: what wins at 1 and 4 rows of the 8B model's qkv, o and down projections (benchmarks/fp8_linears.py)
    Tile("fma", 16, 256, 4, 4, max_rows=1, split=8),
    Tile("fma", 32, 512, 4, 4, max_rows=1, split=8),
    Tile("dot", 32, 256, 4, 4, split=2),
    Tile("dot", 32, 256, 4, 4, split=4),
    Tile("dot", 32, 128, 4, 4, split=8),
    Tile("dot", 64, 128, 4, 4, split=8),
)
COUNTER_BLOCK = min(tile.block_n for tile in CANDIDATES)  # counters: one per column block of the narrowest tile
TUNE_BYTES = 256 << 20  # several times a large GPU's L2, so each timed call reads its codes from HBM
_CHOSEN: dict[tuple[int, int, torch.dtype, int, int], Tile] = {}


@triton.jit
def _finish_split(Part, Count, Scale, Bias, Out, rows, stride_o, N, pid_n,
                  BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """After a program stored its partial ``Part[split, rows, N]``: the last of its column block's
    ``SPLIT`` programs sums them in split order, scales, adds the bias, stores, and resets the counter."""
    tl.debug_barrier()  # every thread's partial is written before the count says so
    arrived = tl.atomic_add(Count + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        offs_m = tl.arange(0, 16)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs_m[:, None] < rows
        ptrs = Part + offs_m[:, None] * N + offs_n[None, :]
        total = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # .cg: the other programs' partials, past this SM's L1
            total += tl.load(ptrs + s * rows * N, mask=mask, other=0.0, cache_modifier=".cg")
        total = total * tl.load(Scale + offs_n)[None, :]
        if HAS_BIAS:
            total += tl.load(Bias + offs_n).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None] * stride_o + offs_n[None, :], total.to(Out.dtype.element_ty), mask=mask)
        tl.atomic_xchg(Count + pid_n, 0)


@triton.jit
def _dot_kernel(X, W, Scale, Bias, Out, Part, Count, rows, stride_x, stride_o, N,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, SWAPPED: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    SPAN: tl.constexpr = K // SPLIT  # a multiple of BLOCK_K (Tile.fits): no masks on the codes
    offs_k = tl.program_id(1) * SPAN + tl.arange(0, BLOCK_K)
    part = Part + tl.program_id(1) * rows * N
    if SWAPPED:
        # out^T [BLOCK_N, BLOCK_M] = codes [BLOCK_N, BLOCK_K] x rows^T [BLOCK_K, BLOCK_M]
        row_mask = offs_m[None, :] < rows
        x_ptrs = X + offs_m[None, :] * stride_x + offs_k[:, None]
        w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, SPAN, BLOCK_K):
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
            acc += tl.dot(tl.load(w_ptrs).to(x.dtype), x)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SPLIT == 1:
            acc = acc * tl.load(Scale + offs_n)[:, None]
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n).to(tl.float32)[:, None]
            tl.store(Out + offs_m[None, :] * stride_o + offs_n[:, None], acc.to(Out.dtype.element_ty),
                     mask=row_mask)
        else:
            tl.store(part + offs_m[None, :] * N + offs_n[:, None], acc, mask=row_mask)
    else:
        row_mask = offs_m[:, None] < rows
        x_ptrs = X + offs_m[:, None] * stride_x + offs_k[None, :]
        # The codes [N, K] row-major read as a [BLOCK_K, BLOCK_N] tile: K is the contiguous axis.
        w_ptrs = W + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, SPAN, BLOCK_K):
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
            acc += tl.dot(x, tl.load(w_ptrs).to(x.dtype))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SPLIT == 1:
            acc = acc * tl.load(Scale + offs_n)[None, :]
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n).to(tl.float32)[None, :]
            tl.store(Out + offs_m[:, None] * stride_o + offs_n[None, :], acc.to(Out.dtype.element_ty),
                     mask=row_mask)
        else:
            tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=row_mask)
    if SPLIT > 1:
        _finish_split(Part, Count, Scale, Bias, Out, rows, stride_o, N, pid_n, BLOCK_N, SPLIT, HAS_BIAS)


@triton.jit
def _fma_kernel(X, W, Scale, Bias, Out, Part, Count, rows, stride_x, stride_o, N,
                K: tl.constexpr, MAX_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    SPAN: tl.constexpr = K // SPLIT
    offs_k = tl.program_id(1) * SPAN + tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    part = Part + tl.program_id(1) * rows * N
    scale = tl.load(Scale + offs_n)
    for m in tl.static_range(MAX_M):
        if m < rows:
            # One row at a time over the same codes: the second and later passes read them from L2,
            # which at four rows at most costs less than holding four accumulator tiles.
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k in range(0, SPAN, BLOCK_K):
                x = tl.load(X + m * stride_x + k + offs_k).to(tl.float32)
                acc += tl.load(w_ptrs + k).to(tl.float32) * x[None, :]
            if SPLIT == 1:
                out = tl.sum(acc, axis=1) * scale
                if HAS_BIAS:
                    out += tl.load(Bias + offs_n).to(tl.float32)
                tl.store(Out + m * stride_o + offs_n, out.to(Out.dtype.element_ty))
            else:
                tl.store(part + m * N + offs_n, tl.sum(acc, axis=1))
    if SPLIT > 1:
        _finish_split(Part, Count, Scale, Bias, Out, rows, stride_o, N, pid_n, BLOCK_N, SPLIT, HAS_BIAS)


def supports(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether :func:`multiply` takes ``x [M, K]`` times ``codes [N, K]`` (else ``_scaled_mm`` does)."""
    n, k = codes.shape
    return (HAS_TRITON and x.is_cuda and x.dtype in ACTIVATION_DTYPES and 0 < x.shape[0] <= MAX_ROWS
            and codes.is_contiguous() and fits(n, k))


def fits(n: int, k: int) -> bool:
    return any(tile.fits(n, k, MAX_ROWS) for tile in CANDIDATES)


def bucket_of(rows: int) -> int:
    return next(b for b in ROW_BUCKETS if rows <= b)


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for split-K products with ``n`` output channels, to pass to :func:`multiply`
    on every call for one weight (each launch leaves them zero again). A layer keeps its own: two
    products sharing counters must not run at the same time."""
    return torch.zeros(-(-n // COUNTER_BLOCK), dtype=torch.int32, device=device)


def multiply(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             tile: Tile | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (M <= 16, bf16 or fp16) times the e4m3 ``codes [N, K]`` with float32 per-row
    ``scale [N]``, plus ``bias``: ``[M, N]`` in ``x``'s dtype. ``counters``: this weight's
    :func:`split_counters` (None: fresh ones for this call, a memset more)."""
    rows, k = x.shape
    n = codes.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    tile = tile or chosen_tile(n, k, x.dtype, x.device.index or 0, rows)
    if not tile.fits(n, k, rows):
        raise ValueError(f"{tile} does not fit {rows} rows of [{n}, {k}]")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if tile.split > 1:
        part = torch.empty((tile.split, rows, n), dtype=torch.float32, device=x.device)
        if counters is None:
            counters = split_counters(n, x.device)
        elif counters.numel() < n // tile.block_n or counters.dtype != torch.int32:
            raise ValueError(f"counters for {n} channels: {counters.numel()} {counters.dtype}, "
                             f"not split_counters({n})")
    else:
        part = counters = out  # not read
    grid = (n // tile.block_n, tile.split)
    common = (x, codes, scale, bias if bias is not None else scale, out, part, counters, rows, x.stride(0),
              out.stride(0), n)
    if tile.form == "fma":
        _fma_kernel[grid](*common, K=k, MAX_M=tile.max_rows, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                          SPLIT=tile.split, HAS_BIAS=bias is not None, num_warps=tile.warps,
                          num_stages=tile.stages)
    else:
        _dot_kernel[grid](*common, K=k, BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                          SPLIT=tile.split, SWAPPED=tile.form == "dot_swapped", HAS_BIAS=bias is not None,
                          num_warps=tile.warps, num_stages=tile.stages)
    return out


def chosen_tile(n: int, k: int, dtype: torch.dtype, device_index: int, rows: int) -> Tile:
    """The tile :func:`tune` chose for this shape and row bucket; untuned inside a CUDA graph
    capture (which cannot time), the first candidate that fits."""
    bucket = bucket_of(rows)
    tile = _CHOSEN.get((n, k, dtype, device_index, bucket))
    if tile is None:
        if torch.cuda.is_current_stream_capturing():
            return next(t for t in CANDIDATES if t.fits(n, k, bucket))
        tile = tune(n, k, dtype, torch.device("cuda", device_index), bucket)
    return tile


def tune(n: int, k: int, dtype: torch.dtype, device: torch.device, rows: int = 1) -> Tile:
    """Time each candidate that fits this shape at ``rows``' bucket and keep the fastest (each
    compiles once per K and dtype, a fraction of a second; the timing takes milliseconds). The
    calls cycle through copies of the codes that together pass :data:`TUNE_BYTES`, so the reads
    come from HBM as a forward's (every layer its own weights) do, not from L2."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    bucket = bucket_of(rows)
    key = (n, k, dtype, index, bucket)
    if key in _CHOSEN:
        return _CHOSEN[key]
    device = torch.device("cuda", index)
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((bucket, k), generator=generator, device=device).to(dtype)
    copies = max(2, -(-TUNE_BYTES // (n * k)))
    codes = [torch.randn((n, k), generator=generator, device=device).to(torch.float8_e4m3fn) for _ in range(copies)]
    scale = torch.ones(n, device=device)
    counters = split_counters(n, device)

    def calls(tile: Tile) -> None:
        for c in codes:
            multiply(x, c, scale, tile=tile, counters=counters)

    timings = {tile: graph_microseconds(lambda tile=tile: calls(tile), 2) / copies
               for tile in CANDIDATES if tile.fits(n, k, bucket)}
    best = min(timings, key=timings.get)
    _CHOSEN[key] = best
    seconds = timings[best] / 1e6
    log.info("fp8 few-row kernel for %d rows of [%d, %d] %s: %s %dx%d split %d, %d warps, %d stages, %.1f us "
             "(%.0f GB/s of codes)", bucket, n, k, str(dtype).removeprefix("torch."), best.form, best.block_n,
             best.block_k, best.split, best.warps, best.stages, seconds * 1e6, n * k / seconds / 1e9)
    return best
