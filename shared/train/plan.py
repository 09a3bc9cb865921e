"""The memory plan of a training job, its placement, and the step's lower bound: arithmetic only.

Before anything is allocated the trainer works out, from the model's shapes, the compute dtype, the
batch, the sequence length, the GPU memory cap and where each layer's fp32 state lives, how many
bytes of host RAM and of GPU memory the job needs, and refuses in one line naming what to change
when they do not fit (:meth:`MemoryPlan.check`). ``tandem train --plan`` prints the plan.

Host RAM and the persistent GPU buffers are exact: they are sums over the very tensors that
host_state.py, engine.py and device_update.py allocate (the unit tests compare them with a run).
The GPU's *working* memory (the live activations of one layer's backward, the loss head's chunk)
is an estimate from the tensors eager PyTorch keeps for the backward (:func:`activation_bytes`);
a fixed headroom covers allocator rounding and cuBLAS workspaces.

Placement. A decoder layer is one of three kinds:

- *resident* (layers 0..r-1): fp32 master and moments and the working copy stay on the GPU; its
  update is GPU-only and its weights never cross PCIe;
- *streamed* (r..k-1): state in host RAM, the update computed on the GPU after the backward
  (12 bytes per parameter over PCIe each way, plus the new working copy back);
- *host* (k..L-1, and the extras): the CPU's AdamW (host_kernel.py) updates it behind the forward.

:func:`choose_placement` picks ``(r, k)`` that fit the cap and minimise :func:`step_bound` with
known rates (the module's default :class:`Rates`, the lent machine's measured figures) or measured
ones (:func:`measure_rates`, as the runner and the benchmark do).

The bound (:func:`step_bound`) is the largest of: the GPU's compute; the bytes through host memory
(the CPU optimizer's passes plus every DMA byte) at the host's copy rate; the bytes each way over
PCIe at each direction's rate and both together at the duplex rate; and the exact-clipping chain:
no update starts before the backward ends (the global norm needs every gradient), so between one
backward's end and the next one's, the CPU's preview of every host unit, the last layer's forward,
the head and the whole backward run one after another (and likewise the streamed updates over PCIe
ahead of the forward that needs them); and the same window counted in host memory bytes: the
previews share that memory with the copy engines moving the forward's weights, checkpoints and the
streamed layers' state, at the rate both get together while the preview runs.

    plan = memory_plan(config, work_dtype=torch.bfloat16, batch=8, seq=2048, gpu_cap=16 * GiB,
                       placement=Placement(resident=10, device_update=10))
    plan.check()          # raises PlanError("... does not fit ...; use ...")
    print(plan.describe())
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from tandem.shared.lora.peft_format import AdapterConfig
from tandem.shared.model.config import ModelConfig
from tandem.shared.train.functional import ATTENTION_CHUNK, flex_packing, staged
from tandem.shared.train.layout import extras_layout, layer_layout
from tandem.shared.train.lora import adapter_numel
from tandem.shared.train.state_format import FP32_STATE, StateFormat

GiB = 2**30
MASTERS_AND_MOMENTS = "masters + moments"  # the plan's host entry of the optimizer's state
RESIDENT_TAIL = 2  # the top layers whose inputs stay on the GPU between forward and backward (resident_tail)
CUDA_CONTEXT = int(1.5 * GiB)  # host RAM the CUDA context and torch's libraries take in this process
PROCESS_BASE = int(0.75 * GiB)  # host RAM of the interpreter, torch and the data on a CPU run
HEADROOM_FRACTION, HEADROOM_MIN = 0.04, int(0.5 * GiB)  # GPU: allocator rounding, fragmentation
CUBLAS_WORKSPACE = 64 << 20  # GPU: cuBLAS/cuBLASLt workspaces, from the caching allocator (32 MiB a handle on Hopper)


def resident_tail(num_layers: int, tokens: int, attention_chunk: int = ATTENTION_CHUNK) -> int:
    """How many top layers keep their inputs on the GPU from the forward to the backward (engine.py):
    RESIDENT_TAIL, so the backward starts without waiting for checkpoints, except for long sequences
    (past ``attention_chunk`` tokens, where attention runs staged): there two layer inputs are GiBs
    of the cap, and reloading them costs nothing next to the step."""
    return 0 if staged(tokens, attention_chunk) else min(num_layers, RESIDENT_TAIL)


class PlanError(ValueError):
    """A job that does not fit; the message is one line naming what to change."""


@dataclass(frozen=True)
class Rates:
    """Bytes per second (parameters per second for the optimizer's passes, FLOP/s for the GPU) of
    the resources a step uses."""

    host_copy: float  # host memory, read + write bytes per second of a large copy on the optimizer's threads
    h2d: float  # pinned host -> device, one direction alone
    d2h: float
    duplex: float  # both directions at once, total
    gpu_flops: float  # achieved on the layer math, recompute included (8·N·tokens + attention)
    preview: float  # host AdamW preview pass, parameters per second (reads 12 + e bytes, writes e)
    commit: float  # commit pass (reads 12 + e, writes 12)
    whole: float  # whole update (reads 12 + e, writes 12 + e)
    dram: float  # host memory bytes per second with the CPU and the copy engines both at it
    source: str = "known"
    host_read: float | None = None
    host_write: float | None = None
    # host memory bytes per second while the preview pass and both copy directions run at once: the
    # mix of the clip window (step_bound); None where not measured (then ``dram``)
    preview_dram: float | None = None


# The lent machine's rates, for plans made without a GPU; the runner and benchmarks/train_offload.py
# measure their own (measure_rates). Host copy, PCIe each way and both at once, and the preview pass are
# as measure_rates times them; gpu_flops is the 3B step's FLOPs (recompute included) over its measured
# compute time. The commit and whole passes were not timed: commit takes the preview's rate, whole the
# preview's bytes per second over its own 28 bytes a parameter (16 for the preview).
H200 = Rates(host_copy=100.6e9, h2d=55.4e9, d2h=55.3e9, duplex=101.6e9, gpu_flops=548e12, preview=4.67e9,
             commit=4.67e9, whole=4.67e9 * 16 / 28, dram=100.6e9, source="H200 (DESIGN.md)")


@dataclass(frozen=True)
class Placement:
    """Where each decoder layer's fp32 state lives: layers [0, resident) on the GPU, [resident,
    device_update) in host RAM but updated on the GPU, the rest updated by the CPU."""

    resident: int = 0
    device_update: int = 0  # layers updated on the GPU, the resident ones included
    sets: int = 2  # GPU buffer sets for the streamed updates
    reason: str = "given"
    frozen: bool = False  # a LoRA run: ``resident`` base layers live on the GPU, no layer is updated

    @property
    def streamed(self) -> int:
        return self.device_update - self.resident

    def host_layers(self, num_layers: int) -> int:
        return num_layers - self.device_update

    def describe(self, num_layers: int) -> str:
        if self.frozen:
            return (f"LoRA: {self.resident} frozen base layers resident on the GPU, {num_layers - self.resident} "
                    "streamed from host RAM; the adapter and its AdamW on the device")
        return (f"{self.resident} layers resident on the GPU, {self.streamed} streamed for a GPU update, "
                f"{self.host_layers(num_layers)} updated by the CPU")


@dataclass
class MemoryPlan:
    config: ModelConfig
    device: str  # "cuda" or "cpu"
    batch: int
    seq: int
    work_bytes: int  # bytes per element of the compute dtype
    placement: Placement
    split: bool
    host: dict[str, int] = field(default_factory=dict)  # what lives in host RAM
    gpu: dict[str, int] = field(default_factory=dict)  # persistent device buffers
    working: dict[str, int] = field(default_factory=dict)  # the activations' peak, by phase
    gpu_cap: int | None = None  # bytes the job may use on the GPU (None: CPU run)
    workspace: int = 0  # cuBLAS workspaces (CUDA only)
    host_available: int | None = None  # bytes of host RAM free for it
    headroom: int = 0
    state_format: StateFormat = FP32_STATE
    deterministic_extra: int = 0  # GPU bytes the deterministic kernels add to the peak (flash_splits)
    lora: AdapterConfig | None = None  # a LoRA run's adapter (its base frozen: lora_parts)

    @property
    def host_total(self) -> int:
        """Host RAM the job needs; on CPU the engine's buffers and activations live there too."""
        total = sum(self.host.values())
        if self.device == "cpu":
            total += self.gpu_persistent + self.gpu_working
        return total

    @property
    def gpu_persistent(self) -> int:
        return sum(self.gpu.values())

    @property
    def gpu_working(self) -> int:
        return max(self.working.values()) if self.working else 0

    @property
    def gpu_peak(self) -> int:
        """Peak bytes allocated on the device (persistent buffers + the largest working set + the
        cuBLAS workspaces)."""
        return self.gpu_persistent + self.gpu_working + self.workspace

    def fits_gpu(self) -> bool:
        return self.gpu_cap is None or self.gpu_peak + self.headroom <= self.gpu_cap

    def fits_host(self) -> bool:
        return self.host_available is None or self.host_total <= self.host_available

    def check(self) -> None:
        """Raise :class:`PlanError` (one line, naming what to change) when the job does not fit."""
        shape = f"batch {self.batch} x seq {self.seq}"
        if not self.fits_host():
            spare = self.host["gradient buffers"] // 2 if self.split else 0
            split_hint = f", --no-split-update (saves {spare / GiB:.1f} GiB)" if spare else ""
            if self.state_format.default and self.lora is None:
                split_hint += ", --master-weights bf16-sr --adam-moments int8 (host state 6-8 bytes a parameter)"
            raise PlanError(
                f"host RAM: the job needs {self.host_total / GiB:.1f} GiB ({self._top(self.host)}) but "
                f"{self.host_available / GiB:.1f} GiB is available; use a smaller model, a shorter --seq-len or a "
                f"smaller --batch-size (activation checkpoints: {self.host.get('checkpoints', 0) / GiB:.1f} GiB at "
                f"{shape}){split_hint}, or free host memory")
        if not self.fits_gpu():
            need = self.gpu_peak + self.headroom
            p = self.placement
            if p.frozen:
                state = (f", or fewer GPU-resident base layers (--device-resident-layers, now {p.resident}: "
                         f"{self.gpu['resident'] / GiB:.1f} GiB)" if p.resident else "")
            else:
                state = (f", or fewer GPU-resident/updated layers (now {p.resident}/{p.device_update}: "
                         f"{(self.gpu['resident'] + self.gpu['device_grads'] + self.gpu['update_sets']) / GiB:.1f} GiB)"
                         if p.device_update else "")
            if self.deterministic_extra:
                state += (f", or --no-deterministic (the deterministic flash backward needs "
                          f"{self.deterministic_extra / GiB:.1f} GiB more)")
            raise PlanError(
                f"GPU memory: the job needs {need / GiB:.1f} GiB (buffers {self.gpu_persistent / GiB:.1f}, "
                f"activations {self.gpu_working / GiB:.1f} at {shape}, headroom {self.headroom / GiB:.1f}) over the "
                f"{self.gpu_cap / GiB:.1f} GiB cap; raise --gpu-memory-gib, or lower --batch-size or --seq-len{state}")

    @staticmethod
    def _top(parts: dict[str, int]) -> str:
        big = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{k} {v / GiB:.1f}" for k, v in big)

    def describe(self) -> str:
        """The plan, a few lines."""
        cfg, p = self.config, self.placement
        if self.lora is not None:
            trained = (f"LoRA rank {self.lora.rank} (alpha {self.lora.alpha:g}) on {','.join(self.lora.targets)}: "
                       f"{adapter_numel(cfg, self.lora) / 1e6:.1f}M trained parameters, base frozen, AdamW on the "
                       "device")
        else:
            trained = f"host AdamW {'preview + commit' if self.split else 'whole updates'}"
        lines = [f"memory plan: {cfg.num_layers} layers x {layer_layout(cfg).numel / 1e6:.1f}M + extras "
                 f"{extras_layout(cfg).numel / 1e6:.1f}M parameters, {self.device}, batch {self.batch} x "
                 f"{self.seq}, {self.work_bytes * 8}-bit compute, {trained}",
                 f"  placement: {p.describe(cfg.num_layers)} ({p.reason})"]
        host = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.host.items() if v)
        avail = f" of {self.host_available / GiB:.1f} GiB available" if self.host_available is not None else ""
        lines.append(f"  host RAM {self.host_total / GiB:.2f} GiB{avail}: {host}"
                     + (" (+ the engine's buffers, on CPU)" if self.device == "cpu" else ""))
        gpu = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.gpu.items() if v)
        work = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.working.items())
        where = "GPU" if self.device == "cuda" else "engine buffers (CPU)"
        cap = f", cap {self.gpu_cap / GiB:.1f} GiB with {self.headroom / GiB:.2f} headroom" if self.gpu_cap else ""
        ws = f"; cuBLAS workspaces {self.workspace / GiB:.2f}" if self.workspace else ""
        lines.append(f"  {where} peak {self.gpu_peak / GiB:.2f} GiB{cap}: buffers {self.gpu_persistent / GiB:.2f} "
                     f"({gpu}); activations, the largest of: {work}{ws}")
        verdict = "fits" if self.fits_gpu() and self.fits_host() else "does NOT fit"
        lines.append(f"  {verdict}")
        return "\n".join(lines)


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, e: int, mlp_chunk: int, loss_chunk: int,
                     attention_chunk: int = ATTENTION_CHUNK, flash_splits: int = 1) -> dict[str, int]:
    """Peak bytes of the activations that live on the device beyond the engine's buffers, by phase.

    Per token, with ``d`` hidden, ``q`` = heads x head_dim, ``I`` intermediate, ``e`` bytes per element:
    the attention half's graph, held across the layer's backward, keeps the fp32 norm input (4d), the
    normalised input and h (2ed), the rotated q, the GQA-expanded k and v, SDPA's output and its
    reshaped copy (5eq) and the log-sum-exp (4 per head); the layer's output, its gradient, the
    incoming gradient and the one going out are 4ed more. Each MLP chunk adds its fp32 norm input and
    normalised copies ((4 + 3e)d), the gate, SiLU, up and product (4eI) and their gradients (3eI);
    the attention backward adds the gradients of q, k, v, SDPA's output (4eq) and the norm's (8d).
    The loss head holds the final hidden state and its gradient (2ed per token) and, per chunk, the
    logits in the compute dtype and fp32, the log-softmax and its gradient ((2e + 12) per vocab entry).

    Past ``attention_chunk`` tokens the attention half runs staged (functional.layer_backward): held
    across the layer are q, k, v (e(q + 2kv), with ``kv`` = kv_heads x head_dim), their GQA-expanded
    copies in SDPA's graph (2eq when heads are grouped), SDPA's output (eq) and log-sum-exp; the MLP
    phase adds the incoming gradient (reused for the outgoing one) and the attention half's output
    (2ed) and a chunk; SDPA's backward adds the gradient of its output, dq, the expanded dk and dv,
    dk and dv, and the kernel's fp32 dq accumulator (2eq + expanded + 2e·kv + 4q·``flash_splits``: the
    deterministic flash backward keeps one accumulator per split, :func:`flash_splits`) to the incoming
    gradient (ed). Both phases also hold the top layers' inputs kept from the forward, if any (resident_tail)."""
    tokens = batch * seq
    d, q, inter, heads = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size, cfg.num_heads
    chunk = min(mlp_chunk, tokens)
    attn_graph = tokens * ((4 + 2 * e) * d + 5 * e * q + 4 * heads)
    flowing = tokens * 4 * e * d
    mlp = chunk * ((4 + 3 * e) * d + 7 * e * inter)
    attn_bwd = tokens * (4 * e * q + 8 * d)
    head_chunk = min(loss_chunk, tokens)
    head = tokens * 2 * e * d + head_chunk * ((2 * e + 12) * cfg.vocab_size + (12 + 3 * e) * d)
    tail = resident_tail(cfg.num_layers, tokens, attention_chunk) * tokens * d * e
    ids = 2 * tokens * 8
    if staged(tokens, attention_chunk):
        kv = cfg.num_kv_heads * cfg.head_dim
        expanded = 2 * e * q if cfg.num_heads > cfg.num_kv_heads else 0
        held = tokens * (e * (q + 2 * kv) + expanded + e * q + 4 * heads)
        return {"layer backward (mlp)": held + tokens * 2 * e * d + mlp + tail + ids,
                "layer backward (attention)": held + tokens * (e * d + 2 * e * q + expanded + 2 * e * kv
                                                               + 4 * q * flash_splits) + tail + ids,
                "loss head": head + tail + ids}
    return {"layer backward (mlp)": attn_graph + flowing + mlp + ids,
            "layer backward (attention)": attn_graph + flowing + attn_bwd + ids,
            "loss head": head + tail + ids}


H200_SMS = 132  # streaming multiprocessors of the lent GPU: plans made without one assume it


def flash_splits(batch: int, heads: int, deterministic: bool, sm_count: int = H200_SMS) -> int:
    """How many fp32 dq accumulators flash attention's backward keeps: one, or in deterministic mode
    one per split of the keys, enough splits to give every SM a (row, head, split) of its own
    (FlashAttention-2's rule: ceil(SMs / (batch x heads))). At batch 1 and 32 heads that is 5
    accumulators of dq's size in fp32 on a 132-SM GPU: GiBs on long sequences, and a slower backward."""
    return -(-sm_count // (batch * heads)) if deterministic else 1


def default_loss_chunk(cfg: ModelConfig) -> int:
    """As engine.py: about 512 MiB of fp32 logits per chunk."""
    return max(256, (512 << 20) // (4 * cfg.vocab_size))


def memory_plan(cfg: ModelConfig, work_dtype: torch.dtype, batch: int, seq: int, placement: Placement,
                device: str = "cuda", split: bool = True, gpu_cap: int | None = None,
                host_available: int | None = None, mlp_chunk: int = 16384, loss_chunk: int | None = None,
                data_bytes: int = 0, packed: bool = False, attention_chunk: int = ATTENTION_CHUNK,
                deterministic: bool = False, sm_count: int = H200_SMS, lora: AdapterConfig | None = None,
                state_format: StateFormat = FP32_STATE) -> MemoryPlan:
    """The bytes a job needs, from the same shapes the allocating code uses (module docstring).
    ``packed``: batches pack several examples a row, so each step also holds the attention mask and
    RoPE tables gathered per row: on CUDA without ``deterministic`` a FlexAttention block mask
    (``functional.segment_block_mask``: eight int32 tensors over the 128 x 128 tiles, made at the step's
    start from where the examples start, in ``[B, tiles, tiles]`` work), else ``functional.segment_mask``
    (``[B, 1, S, S]`` of the work dtype, the last dim padded to 16). ``deterministic`` (CUDA): the step
    runs deterministic kernels, whose flash backward needs more room on long sequences (:func:`flash_splits`,
    ``sm_count`` SMs). ``lora``: a LoRA run of that adapter (:func:`lora_parts`; ``placement.resident``
    counts the base layers kept on the GPU, ``split`` and ``device_update`` do not apply).
    ``state_format``: the host state's masters and moments (state_format.py); a bf16 master where the
    work dtype is bf16 is the working copy, which then costs nothing more."""
    e = torch.empty((), dtype=work_dtype).element_size()
    L = cfg.num_layers
    n, ne = layer_layout(cfg).numel, extras_layout(cfg).numel
    units = [ne] + [n] * L
    r, k = min(placement.resident, L), min(max(placement.device_update, placement.resident), L)
    placement = replace(placement, resident=r, device_update=k)
    act = batch * seq * cfg.hidden_size * e
    grads_per_unit = 2 if split else 1
    unit_ranges = [extras_layout(cfg).decay_ranges(1.0)] + [layer_layout(cfg).decay_ranges(1.0)] * L
    host = {
        MASTERS_AND_MOMENTS: sum(state_format.state_bytes(u, ranges) + 4 for u, ranges in zip(units, unit_ranges)),
        "working copies": 0 if state_format.master_shares_work(work_dtype) else sum(e * u for u in units),
        "gradient buffers": grads_per_unit * sum(e * u for u in units),
        "checkpoints": (L - resident_tail(L, batch * seq, attention_chunk)) * act,
        "engine": 8 * len(units) + 4,
        "process": (CUDA_CONTEXT if device == "cuda" else PROCESS_BASE) + data_bytes,
    }
    streamed = k - r
    sets = min(max(1, placement.sets), streamed)
    gpu = {
        "weight slots": 2 * n * e,
        "gradient slots": 2 * n * e,
        "extras": 2 * ne * e,
        "activation slots": 2 * act,
        "rope": 2 * seq * (cfg.head_dim // 2) * 4,
        "norms": 8 * len(units),
        "resident": r * (12 + e) * n + (4 * n if r else 0),
        "device_grads": k * e * n,
        "update_sets": sets * (16 + e) * n,
        "steps": 4 * k,
    }
    if lora is not None:
        placement = replace(placement, device_update=0, frozen=True)
        split = False
        host, gpu = lora_parts(cfg, e, batch, seq, placement.resident, lora, device, attention_chunk)
        host["process"] += data_bytes
    tiles = -(-seq // 128)
    flex = packed and flex_packing(device == "cuda", deterministic)
    if flex:
        gpu["packed attention mask"] = 4 * batch * tiles * (tiles + 1) * 4  # int32 counts + indices: 2 kinds x 2 sides
    elif packed:
        gpu["packed attention mask"] = batch * seq * (-(-seq // 16) * 16) * e
    if packed:
        gpu["packed rope"] = 2 * batch * seq * (cfg.head_dim // 2) * 4
    splits = flash_splits(batch, cfg.num_heads, deterministic and device == "cuda", sm_count)
    working = activation_bytes(cfg, batch, seq, e, mlp_chunk, loss_chunk or default_loss_chunk(cfg), attention_chunk,
                               splits)
    deterministic_extra = 0
    if splits > 1:
        plain = activation_bytes(cfg, batch, seq, e, mlp_chunk, loss_chunk or default_loss_chunk(cfg), attention_chunk)
        deterministic_extra = max(working.values()) - max(plain.values())
    if lora is not None:
        extra = lora_activation_bytes(cfg, batch, seq, e, mlp_chunk, lora.rank)
        working = {k: v + extra.get(k, 0) for k, v in working.items()}
    if flex:
        # Per token: the segment ids sorted and their run starts (int64); per tile pair: the chosen
        # tiles, their orders and FlexAttention's transposition for the backward (the CPU allocator's
        # peak measured 34-40 bytes a token and 40-45 a pair; CUDA's sort keeps a second buffer).
        working["packed mask build"] = 56 * batch * seq + 64 * batch * tiles * tiles
    plan = MemoryPlan(cfg, device, batch, seq, e, placement, split, host, gpu, working, gpu_cap=gpu_cap,
                      state_format=state_format,
                      host_available=host_available, deterministic_extra=deterministic_extra, lora=lora)
    if device == "cuda":
        plan.workspace = CUBLAS_WORKSPACE
    if gpu_cap is not None:
        plan.headroom = max(HEADROOM_MIN, int(HEADROOM_FRACTION * gpu_cap))
    return plan


def lora_parts(cfg: ModelConfig, e: int, batch: int, seq: int, resident: int, lora: AdapterConfig, device: str,
               attention_chunk: int = ATTENTION_CHUNK) -> tuple[dict[str, int], dict[str, int]]:
    """``(host, gpu)`` bytes of a LoRA run (frozen_base.py, lora.py, lora_step.py), exactly as they
    allocate them: in host RAM only the frozen base's streamed layers (``e`` bytes a parameter: no
    fp32 master, no moments, no gradient buffer), the activation checkpoints and the loss and norm;
    on the device the extras and ``resident`` base layers (``e`` a parameter), two weight slots
    unless every layer is resident, and the adapter's fp32 masters, gradients and two moments
    (16 bytes a trained parameter) with its step count and scaling."""
    L = cfg.num_layers
    n, ne = layer_layout(cfg).numel, extras_layout(cfg).numel
    r = min(resident, L) if device == "cuda" else 0
    act = batch * seq * cfg.hidden_size * e
    host = {
        "frozen base": (L - r) * n * e,
        "checkpoints": (L - resident_tail(L, batch * seq, attention_chunk)) * act,
        "engine": 8 + 4,  # the norm and the loss
        "process": CUDA_CONTEXT if device == "cuda" else PROCESS_BASE,
    }
    gpu = {
        "weight slots": 2 * n * e if r < L else 0,
        "extras": ne * e,
        "resident": r * n * e,
        "adapter": 16 * adapter_numel(cfg, lora) + 4 + 4,
        "activation slots": 2 * act,
        "rope": 2 * seq * (cfg.head_dim // 2) * 4,
        "norms": 8,
    }
    return host, gpu


def lora_activation_bytes(cfg: ModelConfig, batch: int, seq: int, e: int, mlp_chunk: int, rank: int) -> dict[str, int]:
    """What the adapter adds to :func:`activation_bytes`' phases, per token: the attention half's graph
    keeps q's, k's, v's and o's ``A x`` (``rank`` wide) for B's gradient, and their backward makes
    the gradient of one low-rank output at a time (``q`` wide at most); an MLP chunk keeps the
    gate's, up's and down's ``A x`` and one such gradient (the intermediate width). (A frozen base
    weight gets no gradient, so no weight-sized gradient is made: the CPU profile of a LoRA step is
    within the estimate.)"""
    tokens = batch * seq
    q = cfg.num_heads * cfg.head_dim
    attention = tokens * e * (4 * rank + q)
    chunk = min(mlp_chunk, tokens)
    mlp = chunk * e * (3 * rank + cfg.intermediate_size)
    return {"layer backward (mlp)": attention + mlp, "layer backward (attention)": attention}


def choose_lora_resident(cfg: ModelConfig, work_dtype: torch.dtype, batch: int, seq: int, gpu_cap: int,
                         lora: AdapterConfig, mlp_chunk: int = 16384, loss_chunk: int | None = None,
                         packed: bool = False, deterministic: bool = False, sm_count: int = H200_SMS) -> Placement:
    """A LoRA run's placement: as many frozen base layers resident on the GPU as fit ``gpu_cap``
    beside the rest of the plan. Each one saves its host RAM and its two loads a step over PCIe,
    and costs nothing else, so the most that fit is the best (the others stream)."""
    def fits(r: int) -> bool:
        return memory_plan(cfg, work_dtype, batch, seq, Placement(r), split=False, gpu_cap=gpu_cap, mlp_chunk=mlp_chunk,
                           loss_chunk=loss_chunk, packed=packed, deterministic=deterministic, sm_count=sm_count,
                           lora=lora).fits_gpu()

    r = 0
    while r < cfg.num_layers and fits(r + 1):
        r += 1
    plan = memory_plan(cfg, work_dtype, batch, seq, Placement(r), split=False, gpu_cap=gpu_cap, mlp_chunk=mlp_chunk,
                       loss_chunk=loss_chunk, packed=packed, deterministic=deterministic, sm_count=sm_count, lora=lora)
    return Placement(r, 0, reason=f"auto: the most base layers the cap holds; GPU peak {plan.gpu_peak / GiB:.1f} of "
                                  f"{gpu_cap / GiB:.1f} GiB", frozen=True)


def lora_step_bound(cfg: ModelConfig, batch: int, seq: int, resident: int, rates: Rates,
                    e: int = 2) -> dict[str, float]:
    """Seconds a LoRA step needs of each resource, and ``bound``, the largest: the GPU's compute (per
    token and parameter 2 FLOPs forward, 2 recomputed, 2 for the input's gradient: a frozen weight
    has none; attention as in :func:`step_bytes`) and PCIe (the streamed layers' weights both ways
    of the pass, except the two a slot still holds, and the activation checkpoints)."""
    L, n, ne = cfg.num_layers, layer_layout(cfg).numel, extras_layout(cfg).numel
    tokens = batch * seq
    streamed = L - min(resident, L)
    loads = 2 * max(0, streamed - 2)
    ckpts = (L - resident_tail(L, tokens)) * tokens * cfg.hidden_size * e
    flops = (6 * (L * n + ne) + 8 * L * cfg.hidden_size * seq) * tokens
    terms = {"gpu compute": flops / rates.gpu_flops, "pcie h2d": (loads * n * e + ckpts) / rates.h2d,
             "pcie d2h": ckpts / rates.d2h}
    terms["bound"] = max(terms.values())
    return terms


def host_ram_available() -> int | None:
    """Bytes of host RAM this process may still take: MemAvailable, or less under a cgroup limit."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


# -- the bound --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepBytes:
    """What one step moves through each resource, given the placement (bytes; FLOPs)."""

    h2d: int
    d2h: int
    host_read: int  # every byte the CPU optimizer reads, plus every host->device DMA byte
    host_write: int  # every byte it writes, plus every device->host DMA byte
    first_read: int  # of the optimizer's, what must be read before the next forward's last host layer
    first_write: int  # (the preview passes, or whole updates without preview + commit)
    flops: float  # the GPU's, recompute included
    window: int = 0  # host memory bytes between the backward's end and the last host layer's forward


def step_bytes(cfg: ModelConfig, batch: int, seq: int, placement: Placement, e: int = 2,
               split: bool = True) -> StepBytes:
    """Per step: weights in (every non-resident layer in the forward, and in the backward all but the
    top two, which stay in the slots), activation checkpoints out and back (all but
    :func:`resident_tail`'s), host-updated gradients out, streamed layers' fp32 state in and state +
    working copy out; on the host the optimizer's passes over masters, moments, gradient and working
    copy (preview: reads 12 + e, writes e per parameter; commit: reads 12 + e, writes 12; a whole
    update: reads 12 + e, writes 12 + e).

    ``window``: what host memory must serve between one backward's end and the end of the next
    forward (whose last layers are the host-updated ones): the previews (or whole updates) of every
    host unit, the forward's weights going up (each after its update), the streamed layers' state
    going up for their GPU update, and the forward's checkpoints going down."""
    L, n, ne = cfg.num_layers, layer_layout(cfg).numel, extras_layout(cfg).numel
    r, k = placement.resident, placement.device_update
    s, h = k - r, L - k
    act = batch * seq * cfg.hidden_size * e
    ckpts = L - resident_tail(L, batch * seq)
    reloads = sum(1 for i in range(L - RESIDENT_TAIL) if i >= r)  # the top two layers' weights stay in the slots
    h2d = (L - r + reloads) * n * e + ne * e + ckpts * act + s * 12 * n
    d2h = (h * n + ne) * e + ckpts * act + s * (12 + e) * n
    params = h * n + ne
    first_read, first_write = params * (12 + e), params * e if split else params * (12 + e)
    opt_read = params * (24 + 2 * e) if split else params * (12 + e)
    opt_write = params * (12 + e)
    tokens = batch * seq
    flops = (8 * (L * n + ne) + 8 * L * cfg.hidden_size * seq) * tokens  # fwd + recompute + bwd (2+2+4)
    window = first_read + first_write + ((L - r) * n + ne) * e + s * 12 * n + ckpts * act
    return StepBytes(h2d, d2h, opt_read + h2d, opt_write + d2h, first_read, first_write, flops, window)


def host_seconds(read: int, write: int, rates: Rates) -> float:
    """Host memory time of ``read`` + ``write`` bytes at the rate the host's memory gives the CPU and
    the copy engines together (:func:`measure_rates`)."""
    return (read + write) / rates.dram


def streamed_seconds(n: int, e: int, sets: int, rates: Rates) -> float:
    """PCIe time per streamed layer update in a pipeline of ``sets`` buffer sets: with one set the
    next layer's state waits for the last one's to leave; with two or more in and out overlap."""
    up, down = 12 * n / rates.h2d, (12 + e) * n / rates.d2h
    return up + down if sets <= 1 else max(up, down, (24 + e) * n / rates.duplex)


def step_bound(cfg: ModelConfig, batch: int, seq: int, placement: Placement, rates: Rates, e: int = 2,
               split: bool = True, compute_s: tuple[float, float] | None = None) -> dict[str, float]:
    """Seconds each resource needs per step, and ``bound``, the largest; ``compute_s`` is the
    measured ``(forward, backward)`` GPU compute (default: FLOPs at ``rates.gpu_flops``).

    ``cpu optimizer``: the host units' preview and commit passes (or whole updates) at the passes'
    measured rates, one after the other on the optimizer's threads; ``host memory``: every byte
    the optimizer and the copy engines move in host RAM at the rate both together get from it;
    ``pcie *``: each direction alone and both together; ``clip chain``: see the module docstring;
    ``clip window (host memory)``: with host layers, the bytes of the window from the backward's
    end to the forward's last layer (:class:`StepBytes` ``window``) at the rate the preview pass
    and the copy engines get together (``rates.preview_dram``), then the next backward: the
    previews draw on the memory the copy engines use, so in a step they run slower than alone."""
    b = step_bytes(cfg, batch, seq, placement, e, split)
    L, n, ne = cfg.num_layers, layer_layout(cfg).numel, extras_layout(cfg).numel
    if compute_s is None:
        total = b.flops / rates.gpu_flops
        fwd, bwd = total / 4, total * 3 / 4  # 2 of the 8 FLOPs per parameter and token are the forward's
    else:
        fwd, bwd = compute_s
    per_layer_fwd = fwd / max(1, L)
    h, s = L - placement.device_update, placement.streamed
    params = h * n + ne
    first = params / (rates.preview if split else rates.whole)
    # exact clipping: no update before the backward ends, and the last host layer's forward needs its
    # update (the preview of every host unit before it), then the head and the whole backward follow
    chain_host = first + (per_layer_fwd if h else 0.0) + bwd
    chain_stream = (s * streamed_seconds(n, e, placement.sets, rates) + (h + 1) * per_layer_fwd + bwd) if s else 0.0
    terms = {
        "gpu compute": fwd + bwd,
        "cpu optimizer": params * (1 / rates.preview + 1 / rates.commit) if split else params / rates.whole,
        "host memory": host_seconds(b.host_read, b.host_write, rates),
        "pcie h2d": b.h2d / rates.h2d,
        "pcie d2h": b.d2h / rates.d2h,
        "pcie both": (b.h2d + b.d2h) / rates.duplex,
        "clip chain (cpu)": chain_host,
        "clip chain (streamed)": chain_stream,
        "clip window (host memory)": b.window / (rates.preview_dram or rates.dram) + bwd if h else 0.0,
    }
    terms["bound"] = max(terms.values())
    return terms


def choose_placement(cfg: ModelConfig, work_dtype: torch.dtype, batch: int, seq: int, gpu_cap: int,
                     rates: Rates = H200, split: bool = True, sets: int | None = None, mlp_chunk: int = 16384,
                     loss_chunk: int | None = None, packed: bool = False, deterministic: bool = False,
                     sm_count: int = H200_SMS) -> tuple[Placement, dict[str, float]]:
    """The ``(resident, device_update, sets)`` that fits ``gpu_cap`` with the lowest
    :func:`step_bound` (ties: more resident, fewer streamed, fewer sets); ``sets`` None tries 1 and
    2 buffer sets for the streamed updates; ``packed``, ``deterministic`` and ``sm_count`` as in
    :func:`memory_plan`. The reason names the bound and the memory."""
    L = cfg.num_layers
    e = torch.empty((), dtype=work_dtype).element_size()
    best, best_key = None, None
    for r in range(L + 1):
        if not memory_plan(cfg, work_dtype, batch, seq, Placement(r, r), split=split, gpu_cap=gpu_cap,
                           mlp_chunk=mlp_chunk, loss_chunk=loss_chunk, packed=packed, deterministic=deterministic,
                           sm_count=sm_count).fits_gpu():
            break
        for count in ((sets,) if sets else (1, 2)):
            for k in range(r, L + 1):
                placement = Placement(r, k, count)
                plan = memory_plan(cfg, work_dtype, batch, seq, placement, split=split, gpu_cap=gpu_cap,
                                   mlp_chunk=mlp_chunk, loss_chunk=loss_chunk, packed=packed,
                                   deterministic=deterministic, sm_count=sm_count)
                if not plan.fits_gpu():
                    break
                terms = step_bound(cfg, batch, seq, placement, rates, e, split)
                key = (round(terms["bound"], 4), -r, k - r, count if k > r else 0)
                if best_key is None or key < best_key:
                    best, best_key = (placement, terms, plan), key
    if best is None:
        return Placement(0, 0, sets or 2, "nothing fits the cap beside the engine's own buffers"), {}
    placement, terms, plan = best
    binding = max((k for k in terms if k != "bound"), key=terms.get)
    reason = (f"auto: predicted bound {terms['bound']:.3f} s/step ({binding}) with {rates.source} rates; "
              f"GPU peak {plan.gpu_peak / GiB:.1f} of {gpu_cap / GiB:.1f} GiB")
    return replace(placement, reason=reason), terms


def measure_rates(device: torch.device, host_bytes: int = 1 << 30, pcie_bytes: int = 256 << 20, reps: int = 3,
                  gpu_flops: float | None = None, update_params: int = 1 << 26) -> Rates:
    """Measure, the best of ``reps`` passes each: host memory read, write and copy on the host
    AdamW's threads (its C kernel's loads and stores; torch's ops where the kernel is missing); the
    kernel's preview, commit and whole-update passes over ``update_params`` parameters (bf16
    gradient and working copy, as on CUDA); on CUDA, pinned host<->device copies each way alone and
    both at once, host reads while both copy directions run (what the CPU and the copy engines
    get from host memory together) and the preview pass while they run (``preview_dram``, the clip
    window's mix). ``host_copy`` counts read + written bytes (a copy of n bytes
    moves 2n). About three seconds."""
    import threading
    import time

    from tandem.shared.train import host_kernel
    from tandem.shared.train.lanes import host_buffer

    kernel = host_kernel.load()
    n = host_bytes // 4
    src, dst = torch.ones(n), torch.empty(n)

    def best(fn) -> float:  # noqa: ANN001
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    if kernel is not None:
        def read_pass() -> None:
            kernel.membench("read", dst, src)

        write = host_bytes / best(lambda: kernel.membench("write", dst, src))
        copy = 2 * host_bytes / best(lambda: kernel.membench("copy", dst, src))
        how = f"measured on {kernel.threads} optimizer threads"
    else:
        def read_pass() -> None:
            src.sum()

        write = host_bytes / best(lambda: dst.fill_(2.0))
        copy = 2 * host_bytes / best(lambda: dst.copy_(src))
        how = f"measured with torch's ops on {torch.get_num_threads()} threads"
    read = host_bytes / best(read_pass)
    m = update_params
    master, exp_avg, exp_avg_sq = torch.randn(m), torch.zeros(m), torch.ones(m)
    grad, work = torch.randn(m).bfloat16(), torch.empty(m, dtype=torch.bfloat16)
    hyper = (0.5, 1 - 1e-5, 0.1, 0.95, 0.05, 1e-8, 1e-4, 0.5)
    if kernel is not None:
        def adamw(state: bool, out: bool) -> None:
            kernel.adamw(master, exp_avg, exp_avg_sq, grad, work, hyper, write_state=state, write_work=out)

        preview = m / min(best(lambda: adamw(False, True)) for _ in range(2))  # short passes: the best of 2 x reps
        commit = m / min(best(lambda: adamw(True, False)) for _ in range(2))
        whole = m / best(lambda: adamw(True, True))
    else:
        step, g32 = torch.zeros(()), torch.empty(m)

        def adamw(state: bool, out: bool) -> None:
            g32.copy_(grad).mul_(0.5)
            step.add_(1)
            torch._fused_adamw_([master], [g32], [exp_avg], [exp_avg_sq], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                                weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
            work.copy_(master)

        preview = commit = whole = m / best(lambda: adamw(True, True))
    dram = max(read, write, copy, preview * 16, commit * 26, whole * 28)
    h2d = d2h = duplex = float("inf")
    preview_dram = None
    if device.type == "cuda":
        half = pcie_bytes // 2
        up_host, down_host = host_buffer(half, torch.bfloat16, True), host_buffer(half, torch.bfloat16, True)
        up_dev = torch.empty(half, dtype=torch.bfloat16, device=device)
        down_dev = torch.zeros(half, dtype=torch.bfloat16, device=device)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def issue(up: bool, down: bool) -> None:
            if up:
                with torch.cuda.stream(s1):
                    up_dev.copy_(up_host, non_blocking=True)
            if down:
                with torch.cuda.stream(s2):
                    down_host.copy_(down_dev, non_blocking=True)

        def run(up: bool, down: bool) -> None:
            torch.cuda.synchronize(device)
            issue(up, down)
            torch.cuda.synchronize(device)

        h2d = pcie_bytes / best(lambda: run(True, False))
        d2h = pcie_bytes / best(lambda: run(False, True))
        duplex = 2 * pcie_bytes / best(lambda: run(True, True))
        # host reads while both directions copy: the bytes of both over the reads' time
        done = threading.Event()

        def reads() -> None:
            for _ in range(reps):
                read_pass()
            done.set()

        torch.cuda.synchronize(device)
        moved, t = 0, time.perf_counter()
        worker = threading.Thread(target=reads)
        worker.start()
        while not done.is_set():
            run(True, True)
            moved += 2 * pcie_bytes
        worker.join()
        elapsed = time.perf_counter() - t
        dram = max(dram, (reps * host_bytes + moved) / elapsed)
        if kernel is not None:
            preview_dram = _with_duplex(lambda: adamw(False, True), 4 * reps, m * 16, lambda: run(True, True),
                                        2 * pcie_bytes)
    return Rates(host_copy=copy, h2d=h2d, d2h=d2h, duplex=duplex, gpu_flops=gpu_flops or H200.gpu_flops,
                 preview=preview, commit=commit, whole=whole, dram=dram, source=how, host_read=read,
                 host_write=write, preview_dram=preview_dram)


def _with_duplex(work, passes: int, pass_bytes: int, copy_both, copy_bytes: int) -> float:  # noqa: ANN001
    """Host memory bytes per second while ``passes`` runs of ``work`` (a host pass moving
    ``pass_bytes``, GIL released) share the memory with back-to-back ``copy_both`` calls (both copy
    directions, ``copy_bytes`` a call): what both moved within the passes' span, over that span."""
    import threading
    import time

    span: list[float] = []

    def passes_thread() -> None:
        start = time.perf_counter()
        for _ in range(passes):
            work()
        span.extend((start, time.perf_counter()))

    copy_both()  # the first call pays for the streams' setup
    calls: list[tuple[float, float]] = []
    worker = threading.Thread(target=passes_thread)
    worker.start()
    while worker.is_alive():
        t = time.perf_counter()
        copy_both()
        calls.append((t, time.perf_counter()))
    worker.join()
    lo, hi = span
    # a call straddling either end of the span counts for its share inside it
    copied = sum(copy_bytes * max(0.0, min(end, hi) - max(start, lo)) / (end - start) for start, end in calls)
    return (passes * pass_bytes + copied) / (hi - lo)
