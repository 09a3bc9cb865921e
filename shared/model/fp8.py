"""FP8 weights for the decoder layers' linears (``--quantization fp8``): half the bytes a decode step reads.

At batch 1 a decode step reads every weight once, so its time is the weights' bytes over HBM
bandwidth; float8_e4m3fn weights halve that against bf16. What is quantized: every projection of
every decoder layer (the fused ``qkv_proj`` and ``gate_up_proj`` and the ``q/k/v/gate/up`` views of
them, ``o_proj``, ``down_proj``). What is not: the embedding table and the LM head stay in the
model dtype (the head's rounding shows up straight in the logits, and the table is a lookup, not a
read per token), and so do the norms and biases.

Weights: per output channel (row) ``scale = max|W[n, :]| / 448`` in float32 and ``q = W / scale``
rounded to e4m3, so ``W ≈ q * scale[:, None]`` with at most 2^-4 relative error per element (three
mantissa bits, round to nearest). Since a scale belongs to one row, quantizing a fused projection is
the same as quantizing its parts: the parts become row views of the fused codes and scales, so a
checkpoint still loads into them by their Hugging Face names (:meth:`Fp8Linear._load_from_state_dict`
quantizes a float tensor on the way in) and nothing is stored twice.

Three ways to multiply, chosen once per device and dtype by a probe (:func:`scaled_mm_plan`):

- CUDA with compute capability >= 8.9 (Ada, Hopper): dynamic per-token activation quantization
  (one Triton kernel: row absmax, scale, e4m3 codes; plain torch where Triton is missing) and
  ``torch._scaled_mm`` with row-wise scales, ``scale_a [M, 1]`` and ``scale_b [1, N]``. Its contract,
  read in torch 2.11's and 2.13's checks: both operands fp8, the first row-major ``[M, K]``, the
  second column-major ``[K, N]`` (the ``[N, K]`` codes transposed, no copy), ``K`` and ``N``
  multiples of 16, scales float32 and contiguous; row-wise output in bf16 everywhere (fp16 and fp32
  on some builds only, hence the probe). Rows are padded to a multiple of 16 inside the
  quantization kernel (zero rows, never read back): batch 1 runs as 16 rows, a fixed shape per
  CUDA graph bucket, at no extra launch. The probe runs one small product through that path and
  checks it against :func:`emulate_scaled_mm`; when ``_scaled_mm`` refuses or disagrees, the model
  keeps the reference path and one log line says why.
- Up to 16 rows in bf16 or fp16 on that path (decode at small batch), a weight-only Triton kernel
  instead (``fp8_few_rows.py``: the codes widened in registers, no activation quantization, tiles
  timed per shape when the model is quantized), probed at start like ``_scaled_mm``.
- Anywhere else (CPU, older GPUs, shapes not multiples of 16): the reference path, ``F.linear`` over
  the dequantized weight ``q * scale`` in the activation dtype. It keeps the fp8 weights' rounding
  (what CPU tests check) but not the activations' and reads more bytes than bf16 would: it is for
  correctness, not speed.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.shared.infra.triton_runtime import HAS_TRITON, tl, triton
from tandem.shared.model import fp8_few_rows
from tandem.shared.model.config import ModelLoadError

if TYPE_CHECKING:
    from tandem.shared.model.llama import LlamaForCausalLM

log = logging.getLogger("tandem.model")

QUANTIZATIONS = ("none", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A zero row (padding, a dead channel) gets this scale: its codes are all zero and nothing divides by 0.
MIN_SCALE = 1e-12
# Activation dtypes fp8 weights compute in (the model dtype); float64 and fp8 itself are refused.
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROW_ALIGN = 16  # _scaled_mm wants K and N multiples of 16; rows are padded to the same


class QuantizationError(ModelLoadError):
    """A quantization that cannot be applied to this model; the message says what to change."""


def check_quantization(method: str, dtype: torch.dtype) -> None:
    """Raise :class:`QuantizationError` unless ``method`` can quantize a model computing in ``dtype``."""
    if method not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {method!r}; use one of {', '.join(QUANTIZATIONS)}")
    if method == "fp8" and dtype not in COMPUTE_DTYPES:
        raise QuantizationError(f"fp8 weights need a bfloat16, float16 or float32 model, not {dtype}: "
                                "change --dtype, or use --quantization none")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (e4m3 codes ``[N, K]``, float32 scales ``[N]``): one scale per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=MIN_SCALE)
    codes = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` per row, computed in float32 and rounded once to ``dtype``."""
    return (codes.float() * scale[:, None]).to(dtype)


def quantize_rows(x: torch.Tensor, padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token activation quantization in plain torch: ``x [M, K]`` -> (e4m3 ``[P, K]``, float32
    scales ``[P, 1]``), ``P = padded_rows or M``; rows past ``M`` are zeros with scale ``MIN_SCALE``."""
    x32 = x.float()
    rows = x.shape[0]
    if padded_rows is not None and padded_rows > rows:
        x32 = F.pad(x32, (0, 0, 0, padded_rows - rows))  # padded before the cast: fp8 has no fill kernels
    scale = (x32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _quantize_rows_kernel(X, Q, Scale, rows, stride_x, K: tl.constexpr, BLOCK: tl.constexpr,
                          FP8_LIMIT: tl.constexpr, SMALLEST_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    # Rows past `rows` are the padding: they load nothing and store zero codes.
    x = tl.load(X + row * stride_x + offs, mask=mask & (row < rows), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FP8_LIMIT, SMALLEST_SCALE)
    q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
    tl.store(Q + row * K + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row, scale)


def quantize_rows_triton(x: torch.Tensor, padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` as one CUDA kernel (one program per row, padding rows included): in a
    decode step's CUDA graph a launch costs more than its math, and the torch version is about eight."""
    rows, k = x.shape
    padded = max(rows, padded_rows or rows)
    if x.stride(1) != 1:
        x = x.contiguous()
    codes = torch.empty((padded, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((padded, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _quantize_rows_kernel[(padded,)](x, codes, scale, rows, x.stride(0), K=k, BLOCK=block, FP8_LIMIT=FP8_MAX,
                                     SMALLEST_SCALE=MIN_SCALE, num_warps=warps)
    return codes, scale


def emulate_scaled_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                      quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """What the ``_scaled_mm`` path computes, in float32 on any device: ``x [M, K]`` quantized per
    token (by ``quantize``, default :func:`quantize_rows`), times the dequantized weight; ``[M, N]``
    float32, before the output's rounding."""
    x_codes, x_scale = (quantize or quantize_rows)(x, None)
    return (x_codes.float() * x_scale) @ (codes.float() * scale[:, None]).t()


@dataclass(frozen=True)
class ScaledMMPlan:
    """How :class:`Fp8Linear` calls ``torch._scaled_mm`` on one device and activation dtype."""

    quantize: Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]]
    out_dtype: torch.dtype  # what _scaled_mm writes; cast to the activation dtype when it differs
    description: str
    few_rows: bool = False  # up to 16 rows (bf16/fp16) take fp8_few_rows' weight-only kernel instead


class Fp8Linear(nn.Module):
    """A linear layer over e4m3 weight codes ``weight [N, K]`` and float32 per-row ``weight_scale [N]``
    (buffers, so a model-wide ``.to(dtype)`` cannot re-type them: see ``_apply``), with an optional
    bias in the model dtype. ``plan`` set: ``torch._scaled_mm`` on CUDA; None: the reference path."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if codes.dtype != FP8_DTYPE or codes.dim() != 2 or scale.shape != codes.shape[:1]:
            raise ValueError(f"Fp8Linear takes {FP8_DTYPE} codes [N, K] and scales [N]; got {codes.dtype} "
                             f"{tuple(codes.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", scale)
        # the few-row kernel's split-K counters for this weight (zero between launches; not saved)
        self.register_buffer("split_counters", fp8_few_rows.split_counters(self.out_features, codes.device),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.plan: ScaledMMPlan | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        codes, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(codes, scale, bias)

    def rows(self, start: int, count: int) -> Fp8Linear:
        """Output rows ``start:start+count`` as an Fp8Linear sharing this one's storage (a fused
        projection's part: loading into it writes through to the fused codes and scales)."""
        end = start + count
        part = Fp8Linear(self.weight[start:end], self.weight_scale[start:end],
                         None if self.bias is None else self.bias[start:end])
        part.plan = self.plan
        return part

    def can_scaled_mm(self) -> bool:
        return self.in_features % ROW_ALIGN == 0 and self.out_features % ROW_ALIGN == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is not None and x.is_cuda:
            return self._forward_scaled_mm(x)
        return F.linear(x, dequantize_weight(self.weight, self.weight_scale, x.dtype), self.bias)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows == 0:
            return x.new_empty((*lead, self.out_features))
        if plan.few_rows and fp8_few_rows.supports(x2, self.weight):
            return fp8_few_rows.multiply(x2, self.weight, self.weight_scale, self.bias,
                                         counters=self.split_counters).view(*lead, self.out_features)
        codes, x_scale = plan.quantize(x2, -(-rows // ROW_ALIGN) * ROW_ALIGN)
        out = torch._scaled_mm(codes, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale.view(1, -1),
                               out_dtype=plan.out_dtype)[:rows]
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias  # outside _scaled_mm: it takes a bias in bf16/fp16 outputs only
        return out.view(*lead, self.out_features)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # Module.to(dtype) casts every floating tensor, fp8 ones included. A model-wide cast must
        # move the codes and scales, never re-type them: e4m3 -> any wider float is exact, so the
        # codes cast back unchanged; the float32 scales are taken from before the cast.
        scale = self.weight_scale
        super()._apply(fn, recurse)
        if self.weight.dtype != FP8_DTYPE:
            self.weight = self.weight.to(FP8_DTYPE)
        if self.weight_scale.dtype != torch.float32:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # noqa: ANN001 - nn.Module's signature
        # A float checkpoint tensor (a hot reload, a Hugging Face name) is quantized on the way in,
        # into the existing codes and scales: a fused projection's parts write through to it.
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if incoming is not None and incoming.dtype != FP8_DTYPE:
            if tuple(incoming.shape) != tuple(self.weight.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(incoming.shape)}, "
                                  f"the shape in the current model is {tuple(self.weight.shape)}")
                return
            codes, scale = quantize_weight(incoming.to(self.weight.device))
            with torch.no_grad():
                self.weight.copy_(codes)
                self.weight_scale.copy_(scale)
            state_dict = {k: v for k, v in state_dict.items() if k.startswith(prefix)}
            state_dict[key], state_dict[prefix + "weight_scale"] = self.weight, self.weight_scale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        path = self.plan.description if self.plan is not None else "dequantize reference"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{path}"


# (device, activation dtype) -> (plan or None, why not): the probe runs once per process for each.
_PLANS: dict[tuple[str, torch.dtype], tuple[ScaledMMPlan | None, str]] = {}


def scaled_mm_plan(device: torch.device, dtype: torch.dtype) -> tuple[ScaledMMPlan | None, str]:
    """The ``_scaled_mm`` plan for ``device`` and activation ``dtype``, or ``(None, reason)``: tries
    the Triton quantizer then the torch one, each with output in ``dtype`` then in bf16, and keeps
    the first whose probe product agrees with :func:`emulate_scaled_mm`."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"torch._scaled_mm needs CUDA (this is {device.type})"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype)
    if key not in _PLANS:
        _PLANS[key] = _probe_plans(device, dtype)
    return _PLANS[key]


def _probe_plans(device: torch.device, dtype: torch.dtype) -> tuple[ScaledMMPlan | None, str]:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return None, f"torch._scaled_mm needs compute capability 8.9 or later (this GPU is {major}.{minor})"
    if not hasattr(torch, "_scaled_mm"):
        return None, f"torch {torch.__version__} has no torch._scaled_mm"
    quantizers = [("triton", quantize_rows_triton)] if HAS_TRITON else []
    quantizers.append(("torch", quantize_rows))
    out_dtypes = list(dict.fromkeys((dtype, torch.bfloat16)))
    failures = []
    for name, quantize in quantizers:
        for out_dtype in out_dtypes:
            plan = ScaledMMPlan(quantize, out_dtype, f"torch._scaled_mm row-wise, {name} activation quantization, "
                                                     f"{str(out_dtype).removeprefix('torch.')} output")
            try:
                probe_plan(plan, device, dtype)
            except Exception as exc:  # noqa: BLE001 - any refusal means: try the next plan, say why
                failures.append(f"{name}/{str(out_dtype).removeprefix('torch.')}: {_first_line(exc)}")
            else:
                return _with_few_rows(plan, device, dtype), ""
    return None, "torch._scaled_mm refused: " + "; ".join(failures)


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _with_few_rows(plan: ScaledMMPlan, device: torch.device, dtype: torch.dtype) -> ScaledMMPlan:
    """``plan`` with the few-row kernel switched on where it runs here and agrees with the reference."""
    if dtype not in fp8_few_rows.ACTIVATION_DTYPES or not HAS_TRITON:
        return plan
    try:
        probe_few_rows(device, dtype)
    except Exception as exc:  # noqa: BLE001 - the kernel is an optimisation: without it _scaled_mm serves
        log.warning("fp8: the few-row kernel is off (%s); every batch size takes torch._scaled_mm",
                    _first_line(exc))
        return plan
    return dataclasses.replace(plan, few_rows=True,
                               description=plan.description + "; up to 16 rows a weight-only Triton kernel")


def probe_few_rows(device: torch.device, dtype: torch.dtype) -> None:
    """One 3-row product (K 512, N 64) through the few-row kernel; raises unless it is within 1% of
    the float32 product of the same codes (the output's rounding is 0.4%)."""
    generator = torch.Generator(device=device).manual_seed(1)
    x = (torch.randn((3, 512), generator=generator, device=device)
         * torch.tensor([0.1, 1.0, 10.0], device=device)[:, None]).to(dtype)
    weight = torch.randn((64, 512), generator=generator, device=device) * torch.linspace(0.01, 1.0, 64,
                                                                                         device=device)[:, None]
    codes, scale = quantize_weight(weight)
    with torch.no_grad():
        got = fp8_few_rows.multiply(x, codes, scale).float()
    want = x.float() @ (codes.float() * scale[:, None]).t()
    torch.cuda.synchronize(device)
    error = ((got - want).abs().max() / want.abs().max()).item()
    if not error <= 0.01:
        raise RuntimeError(f"few-row probe product off by {error:.3g} of its largest output")


def probe_plan(plan: ScaledMMPlan, device: torch.device, dtype: torch.dtype) -> None:
    """One small product (3 rows: padded; K 64, N 48) through ``plan``; raises unless it agrees with
    the emulation within 2% of its largest output (bf16 output rounding is 0.4%, a wrong scale
    orientation or transpose is off by far more)."""
    generator = torch.Generator(device=device).manual_seed(0)
    # Rows and output channels of different magnitudes: a scale applied along the wrong axis shows.
    x = (torch.randn((3, 64), generator=generator, device=device)
         * torch.tensor([0.1, 1.0, 10.0], device=device)[:, None]).to(dtype)
    weight = torch.randn((48, 64), generator=generator, device=device) * torch.linspace(0.01, 1.0, 48,
                                                                                        device=device)[:, None]
    layer = Fp8Linear(*quantize_weight(weight))
    layer.plan = plan
    with torch.no_grad():
        codes, scale = plan.quantize(x, ROW_ALIGN)
        want_codes, want_scale = quantize_rows(x, ROW_ALIGN)
        got = layer._forward_scaled_mm(x).float()
        want = emulate_scaled_mm(x, layer.weight, layer.weight_scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a kernel's failure surfaces here, inside the caller's try
    # The quantizer alone first: a code off by more than one e4m3 step (2^-3 relative, or the
    # subnormal step 2^-9 of the scale) is a wrong rounding, which a product's 2% could hide.
    values, want_values = codes.float() * scale, want_codes.float() * want_scale
    if not bool(((values - want_values).abs() <= want_values.abs() * 2**-3 + want_scale * 2**-9).all()):
        raise RuntimeError("activation codes differ from torch's rounding by more than one e4m3 step")
    # ... and one step on more than the odd value is another rounding mode (toward zero, say).
    if (values[:3] == want_values[:3]).float().mean().item() < 0.99:
        raise RuntimeError("activation codes do not round to nearest as torch's do")
    error = ((got - want).abs().max() / want.abs().max()).item()
    if not error <= 0.02:  # also catches NaN
        raise RuntimeError(f"probe product off by {error:.3g} of its largest output")


@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did: linears quantized, their bytes before and after, the path."""

    linears: int
    bytes_before: int
    bytes_after: int
    path: str  # "torch._scaled_mm ..." or "dequantize reference (<reason>)"

    def line(self) -> str:
        return (f"fp8: {self.linears} decoder linears, {self.bytes_before / 2**20:.1f} -> "
                f"{self.bytes_after / 2**20:.1f} MiB; {self.path}; embeddings and LM head stay in the model dtype")


def quantize_model(model: LlamaForCausalLM, method: str = "fp8") -> QuantizationReport:
    """Quantize every linear of ``model``'s decoder layers to fp8 in place (after fusing its
    projections; a second call finds nothing left to do). The float weights are freed, so on CUDA
    the device really holds about half the bytes; logs one line saying which path runs."""
    dtype = model.model.embed_tokens.weight.dtype
    check_quantization(method, dtype)
    if method == "none":
        return QuantizationReport(0, 0, 0, "none")
    device = model.model.embed_tokens.weight.device
    plan, reason = scaled_mm_plan(device, dtype)
    linears, before = 0, 0
    # Plain tensors even when called under inference_mode: a hot reload copies into them later.
    with torch.inference_mode(False), torch.no_grad():
        model.fuse_projections()  # fused first: the fused codes are then the one copy the parts view
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for parent, fused, parts in ((attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), (attn, None, ("o_proj",)),
                                         (mlp, "gate_up_proj", ("gate_proj", "up_proj")), (mlp, None, ("down_proj",))):
                count, nbytes = _quantize_group(parent, fused, parts, plan)
                linears += count
                before += nbytes
    after = _distinct_bytes(t for layer in model.model.layers for m in layer.modules() if isinstance(m, Fp8Linear)
                            for t in (m.weight, m.weight_scale, *(() if m.bias is None else (m.bias,))))
    model.quantization = method
    if plan is not None and plan.few_rows:
        # The fused projections' parts are row views that the forward never calls: only the rest are timed.
        shapes = {(m.out_features, m.in_features) for layer in model.model.layers for m in layer.modules()
                  if isinstance(m, Fp8Linear) and m.plan is not None and m.weight._base is None}
        for n, k in sorted(shapes):  # before any CUDA graph is captured (a capture cannot time)
            if fp8_few_rows.fits(n, k):
                for rows in fp8_few_rows.ROW_BUCKETS:
                    fp8_few_rows.tune(n, k, dtype, device, rows)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the float weights' blocks back, so memory sizing sees them free
    report = QuantizationReport(linears, before, after, plan.description if plan is not None
                                else f"dequantize reference ({reason})")
    if linears:
        # On a GPU the reference path dequantizes every weight at every step: slow, so said louder.
        (log.warning if plan is None and device.type == "cuda" else log.info)("%s", report.line())
    return report


def _quantize_group(parent: nn.Module, fused: str | None, parts: tuple[str, ...],
                    plan: ScaledMMPlan | None) -> tuple[int, int]:
    """Quantize ``parent.<fused>`` (its parts becoming row views of it) or each part alone; returns
    (linears quantized, their float bytes)."""
    fused_linear = getattr(parent, fused, None) if fused else None
    if isinstance(fused_linear, nn.Linear):
        quantized = _quantized(fused_linear, plan)
        nbytes = _distinct_bytes(fused_linear.parameters())
        setattr(parent, fused, quantized)
        start = 0
        for name in parts:
            rows = getattr(parent, name).out_features
            setattr(parent, name, quantized.rows(start, rows))
            start += rows
        return 1, nbytes
    count, nbytes = 0, 0
    for name in parts:
        linear = getattr(parent, name)
        if isinstance(linear, nn.Linear):
            nbytes += _distinct_bytes(linear.parameters())
            setattr(parent, name, _quantized(linear, plan))
            count += 1
    return count, nbytes


def _quantized(linear: nn.Linear, plan: ScaledMMPlan | None) -> Fp8Linear:
    quantized = Fp8Linear.from_linear(linear)
    quantized.plan = plan if quantized.can_scaled_mm() else None
    return quantized


def _distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (a fused projection's part views count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def weight_bytes(model: nn.Module, skip_embedding: bool = False) -> int:
    """Bytes of every distinct storage in ``model``'s state dict (tied and fused weights once); with
    ``skip_embedding``, without the input embedding table unless the LM head shares it (a decode
    step reads only its rows, so it is not part of the bytes a step reads)."""
    seen: set[int] = set()
    total = 0
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    head_ptr = head.untyped_storage().data_ptr() if head is not None else None
    for name, tensor in model.state_dict(keep_vars=True).items():
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            continue
        if skip_embedding and name.endswith("embed_tokens.weight") and ptr != head_ptr:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total
