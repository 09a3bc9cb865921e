"""The LoRA adapter a run trains: its A and B matrices, their gradients and AdamW state, on the device.

A LoRA run (``tandem train --lora-rank R``) trains, for each decoder layer and each target
projection ``W`` (``shared/lora/peft_format.py``'s seven), ``A`` ``[R, in]`` and ``B`` ``[out, R]``
such that the layer computes ``W x + B A x · alpha/R``; the base model is frozen
(``frozen_base.py``). The adapter is small (at rank 16 on every projection of a 34B Llama about
0.1B parameters), so its fp32 masters, gradients and both AdamW moments (16 bytes a parameter)
live on the device for the whole run and its update is a device-side fused AdamW after the
backward: no host optimizer, nothing crosses PCIe but the weights of the base.

Initialisation is PEFT's default (``init_lora_weights=True``): ``A`` Kaiming-uniform with
``a = sqrt(5)`` (uniform in ``±1/sqrt(in)``), ``B`` zero, so step 0 computes the base model exactly;
drawn from one generator seeded by the run's seed, layer by layer, targets in
``peft_format.TARGETS``' order. The update is ``torch.optim.AdamW``'s (decoupled weight decay on
every adapter matrix) after ``clip_grad_norm_``'s global clipping, as the full trainer's.

The functional layer reads the adapter from its parameter dict (``functional.project``): for each
target ``<group>.<target>.lora_A`` and ``.lora_B``, and the scaling under ``functional.LORA_SCALING``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tandem.shared.lora.peft_format import (
    ATTENTION_TARGETS,
    TARGETS,
    AdapterConfig,
    AdapterError,
    LoraWeights,
    projection_shapes,
)
from tandem.shared.model.config import ModelConfig
from tandem.shared.train.functional import LORA_SCALING, Params
from tandem.shared.train.layout import ParamSpec, UnitLayout

ALPHA_PER_RANK = 2.0  # --lora-alpha's default is 2 x --lora-rank: scaling 2 whatever the rank
SEED_OFFSET = 0x4C6F5241  # the adapter's generator is apart from the base's and the data's ("LoRA")


def default_alpha(rank: int) -> float:
    return ALPHA_PER_RANK * rank


def check_targets(targets: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``--lora-targets`` as the projections they name, in ``TARGETS``' order (None: all seven);
    :class:`AdapterError` (one line) for a name that is no projection of the decoder layers."""
    if targets is None:
        return TARGETS
    if not targets:
        raise AdapterError(f"--lora-targets names no projection; choose from {','.join(TARGETS)}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise AdapterError(f"--lora-targets: {unknown[0]!r} is not a projection of the model's decoder layers; "
                           f"choose from {','.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in targets)


def lora_config(rank: int, alpha: float | None, targets: list[str] | tuple[str, ...] | None,
                base_model: str = "") -> AdapterConfig:
    """The adapter a job asks for (``alpha`` None: :func:`default_alpha`; ``targets`` as
    :func:`check_targets` takes them), targets in ``TARGETS``' order as PEFT's config lists them."""
    return AdapterConfig(rank=rank, alpha=float(default_alpha(rank) if alpha is None else alpha),
                         targets=check_targets(targets), base_model=base_model)


def group_of(target: str) -> str:
    return "self_attn" if target in ATTENTION_TARGETS else "mlp"


def adapter_layout(cfg: ModelConfig, adapter: AdapterConfig) -> UnitLayout:
    """Every layer's A and B back to back in one flat buffer, named ``<layer>.<group>.<target>.lora_A``
    (``B`` likewise), layer by layer, targets in ``TARGETS``' order. Every tensor is a matrix, so the
    whole buffer is weight-decayed."""
    shapes = projection_shapes(cfg)
    params, offset = [], 0
    for layer in range(cfg.num_layers):
        for target in adapter.targets:
            out_features, in_features = shapes[target]
            for side, shape in (("A", (adapter.rank, in_features)), ("B", (out_features, adapter.rank))):
                params.append(ParamSpec(f"{layer}.{group_of(target)}.{target}.lora_{side}", shape, offset))
                offset += math.prod(shape)
    return UnitLayout(tuple(params), offset, offset)


def adapter_numel(cfg: ModelConfig, adapter: AdapterConfig) -> int:
    """Trained parameters of ``adapter`` on ``cfg``'s model (what the memory plan counts)."""
    shapes = projection_shapes(cfg)
    return cfg.num_layers * sum(adapter.rank * sum(shapes[t]) for t in adapter.targets)


class TrainedAdapter:
    """fp32 masters, gradients and AdamW moments of the adapter in four flat buffers on ``device``,
    plus the step count (see the module)."""

    def __init__(self, cfg: ModelConfig, adapter: AdapterConfig, device: torch.device) -> None:
        self.cfg, self.config, self.device = cfg, adapter, device
        self.layout = adapter_layout(cfg, adapter)
        zeros = lambda: torch.zeros(self.layout.numel, dtype=torch.float32, device=device)  # noqa: E731
        self.master, self.grad, self.exp_avg, self.exp_avg_sq = zeros(), zeros(), zeros(), zeros()
        self.step = torch.zeros((), dtype=torch.float32, device=device)  # updates applied (fused AdamW reads it)
        self.scaling = torch.tensor(adapter.scaling, dtype=torch.float32, device=device)
        # per layer: (name as functional.project reads it, master view, gradient view)
        masters, grads = self.layout.views(self.master), self.layout.views(self.grad)
        self._layers: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = [[] for _ in range(cfg.num_layers)]
        for name in masters:
            layer, key = name.split(".", 1)
            self._layers[int(layer)].append((key, masters[name], grads[name]))

    # -- the layer's view --------------------------------------------------------------------------
    def params(self, layer: int) -> Params:
        """``layer``'s adapter for a forward without autograd: the master views and the scaling."""
        out = {key: master for key, master, _ in self._layers[layer]}
        out[LORA_SCALING] = self.scaling
        return out

    def leaves(self, layer: int) -> Params:
        """``layer``'s adapter for its backward: leaves over the masters whose ``.grad`` are views of
        the gradient buffer, so autograd adds into it in place (the engine's way with the base's
        weights in full training)."""
        out: Params = {LORA_SCALING: self.scaling}
        for key, master, grad in self._layers[layer]:
            leaf = master.detach().requires_grad_(True)
            leaf.grad = grad
            out[key] = leaf
        return out

    # -- initialisation and exchange with PEFT's format ---------------------------------------------
    def init_(self, seed: int) -> None:
        """PEFT's default initialisation (see the module), drawn on the host so every device and
        every thread count draws the same numbers."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + SEED_OFFSET)
        for spec in self.layout.params:
            if spec.name.endswith("lora_A"):
                values = torch.empty(spec.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=gen)
                self._view(self.master, spec).copy_(values)
            else:
                self._view(self.master, spec).zero_()

    def load_(self, weights: LoraWeights) -> None:
        """Set the masters from ``weights`` (a checked adapter of this layout: peft_format.load_adapter)."""
        for spec in self.layout.params:
            layer, _, target, side = spec.name.split(".")
            source = weights.a if side == "lora_A" else weights.b
            self._view(self.master, spec).copy_(source[(int(layer), target)])

    def weights(self) -> LoraWeights:
        """The adapter as ``peft_format`` writes it: fp32 copies on the host."""
        a: dict[tuple[int, str], torch.Tensor] = {}
        b: dict[tuple[int, str], torch.Tensor] = {}
        host = self.master.cpu()
        for spec in self.layout.params:
            layer, _, target, side = spec.name.split(".")
            (a if side == "lora_A" else b)[(int(layer), target)] = self._view(host, spec).clone()
        return LoraWeights(self.config, a, b)

    @staticmethod
    def _view(flat: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
        return flat[spec.offset: spec.offset + spec.numel].view(spec.shape)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.master, self.grad, self.exp_avg, self.exp_avg_sq, self.step, self.scaling))


class AdapterAdamW:
    """AdamW of a :class:`TrainedAdapter`, on its device, in the order of the step that calls it (the
    engine's compute lane). Same hyperparameters, schedule and clipping as the host AdamW of full
    training (optimizer.py); ``start``, ``wait_all`` and ``close`` are there so the training loop
    drives either optimizer alike (this one has no thread: its update is done when the step's
    device work is)."""

    def __init__(self, adapter: TrainedAdapter, lr_at: Callable[[int], float], weight_decay: float,
                 grad_clip: float, betas: tuple[float, float], eps: float) -> None:
        self.adapter, self.lr_at = adapter, lr_at
        self.weight_decay, self.grad_clip, self.betas, self.eps = weight_decay, grad_clip, betas, eps
        # the squared gradient norm, in fp64 on CPU (whose fp32 norm kernel drifts on large tensors)
        self.norm_dtype = torch.float32 if adapter.device.type == "cuda" else torch.float64

    @property
    def steps_done(self) -> int:
        return int(self.adapter.step.item())

    def zero_grad(self) -> None:
        self.adapter.grad.zero_()

    def update(self, version: int) -> torch.Tensor:
        """Clip and apply the gradients of the step whose update makes ``version`` (lr at that step);
        returns the squared global norm before clipping (fp64, on the device), with no host sync."""
        a = self.adapter
        sumsq = torch.linalg.vector_norm(a.grad, dtype=self.norm_dtype).double().square()
        if self.grad_clip > 0:
            norm = sumsq.sqrt()
            # as clip_grad_norm_; a non-finite norm is not clipped (as the host AdamW), the update says so
            coef = torch.where(norm.isfinite(), (self.grad_clip / (norm + 1e-6)).clamp(max=1.0), 1.0)
            a.grad.mul_(coef.float())
        a.step += 1
        torch._fused_adamw_([a.master], [a.grad], [a.exp_avg], [a.exp_avg_sq], [], [a.step], lr=self.lr_at(version),
                            beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay, eps=self.eps,
                            amsgrad=False, maximize=False)
        return sumsq

    def start(self) -> None:
        pass

    def wait_all(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass
