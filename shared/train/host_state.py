"""Host-resident training state: everything about the model that lives in host RAM.

Per unit (the extras, then each decoder layer; see :mod:`tandem.shared.train.layout`) one flat
master copy, the Adam moments and a step counter, plus a *working copy* in the compute dtype
(bf16 on CUDA) and a gradient buffer of the same dtype, both pinned on CUDA so a whole unit moves
in one asynchronous copy. The GPU only ever holds a couple of units at a time. Masters and moments
are fp32 unless the job's :class:`~tandem.shared.train.state_format.StateFormat` asks for bf16
masters or int8 moments; a bf16 master where the compute dtype is bf16 is the working copy itself.

    state = HostState.random(config, seed=0, work_dtype=torch.bfloat16, pin=True)
    state.state_dict()   # {"model.layers.0.self_attn.q_proj.weight": fp32 view, ...}
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.shared.model.config import ModelConfig, ModelLoadError
from tandem.shared.model.meta import weight_files
from tandem.shared.train.lanes import host_buffer
from tandem.shared.train.layout import UnitLayout, extras_layout, layer_layout
from tandem.shared.train.state_format import FP32_STATE, StateFormat, num_blocks

INIT_STD = 0.02
EXTRAS = 0  # unit index of the extras; decoder layer i is unit i + 1


@dataclass
class Unit:
    name: str  # "extras" or "layer.<i>"
    prefix: str  # what precedes the layout's names in the checkpoint ("" or "model.layers.<i>.")
    layout: UnitLayout
    master: torch.Tensor  # fp32 or bf16 (state_format.py): the weights the optimizer updates
    exp_avg: torch.Tensor  # fp32, or int8 codes
    exp_avg_sq: torch.Tensor  # fp32, or uint8 codes
    step: torch.Tensor  # fp32 scalar: updates applied (the fused AdamW kernel reads it)
    work: torch.Tensor  # compute dtype, what the GPU loads (the master itself where both are bf16)
    grad: torch.Tensor  # compute dtype, what the GPU's gradients land in
    grad_spare: torch.Tensor | None = None  # a second one, for updates that read gradients late (optimizer.py)
    comp: torch.Tensor | None = None  # bf16 Kahan compensation of a bf16 master
    exp_avg_absmax: torch.Tensor | None = None  # per quantization block, of int8 moments
    exp_avg_sq_absmax: torch.Tensor | None = None

    def grad_for(self, version: int) -> torch.Tensor:
        """The buffer for the gradients of the step whose update makes ``version``."""
        return self.grad_spare if self.grad_spare is not None and version % 2 == 0 else self.grad

    def master_views(self) -> dict[str, torch.Tensor]:
        return {self.prefix + k: v for k, v in self.layout.views(self.master).items()}

    def buffers(self) -> list[torch.Tensor]:
        """Every host tensor of the unit, each once (a master that is the working copy counted once)."""
        out: list[torch.Tensor] = []
        for t in (self.master, self.comp, self.exp_avg, self.exp_avg_sq, self.exp_avg_absmax, self.exp_avg_sq_absmax,
                  self.step, self.work, self.grad, self.grad_spare):
            if t is not None and not any(t is seen for seen in out):
                out.append(t)
        return out

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the optimizer besides the masters, by attribute name."""
        names = ("exp_avg", "exp_avg_sq", "step", "comp", "exp_avg_absmax", "exp_avg_sq_absmax")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def draw_initial_weights(views: dict[str, torch.Tensor], seed: int, unit_index: int) -> None:
    """A unit's initial weights into ``views`` (its tensors by name): N(0, INIT_STD) matrices, unit
    norms, biases left at zero, from the unit's own generator and drawn in float32 whatever the views'
    dtype, so every holder of a unit (fp32 masters, a LoRA run's frozen base) starts from the same values."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + unit_index)
    for name, view in views.items():
        if name.endswith("norm.weight"):
            view.fill_(1.0)
        elif view.dim() >= 2 and view.dtype == torch.float32:
            view.normal_(0.0, INIT_STD, generator=gen)
        elif view.dim() >= 2:
            view.copy_(torch.empty(view.shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen))


def fill_from_checkpoint(targets: dict[str, torch.Tensor], path: Path) -> None:
    """Copy every tensor ``targets`` names from the Hugging Face safetensors checkpoint at ``path`` (any
    float dtype, sharded or not) into it, one tensor at a time; ModelLoadError for a shape that
    differs or a tensor the checkpoint lacks."""
    seen: set[str] = set()
    for file in weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name in targets:
                    tensor = shard.get_tensor(name)
                    if tuple(tensor.shape) != tuple(targets[name].shape):
                        raise ModelLoadError(f"{name} has shape {tuple(tensor.shape)} in {path}, "
                                             f"config says {tuple(targets[name].shape)}")
                    targets[name].copy_(tensor)
                    seen.add(name)
    missing = sorted(targets.keys() - seen)
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks {missing[:8]}")


class HostState:
    """Masters, moments, pinned working copies and gradient buffers, unit by unit."""

    def __init__(self, config: ModelConfig, work_dtype: torch.dtype, pin: bool,
                 fmt: StateFormat = FP32_STATE) -> None:
        self.config = config
        self.work_dtype = work_dtype
        self.pin = pin
        self.format = fmt
        layouts = [("extras", "", extras_layout(config))]
        layouts += [(f"layer.{i}", f"model.layers.{i}.", layer_layout(config)) for i in range(config.num_layers)]
        with ThreadPoolExecutor(8) as pool:
            self.units: list[Unit] = list(pool.map(lambda a: self._allocate(*a), layouts))

    def _allocate(self, name: str, prefix: str, layout: UnitLayout) -> Unit:
        n, fmt = layout.numel, self.format
        work = host_buffer(n, self.work_dtype, self.pin)
        if fmt.master_shares_work(self.work_dtype):
            master = work
        else:
            master = torch.zeros(n, dtype=torch.bfloat16 if fmt.bf16_master else torch.float32)
        comp = torch.zeros(n, dtype=torch.bfloat16) if fmt.kahan else None
        if fmt.int8_moments:
            blocks = num_blocks(layout.decay_ranges(1.0))  # every range, whatever the job's decay
            m, v = torch.zeros(n, dtype=torch.int8), torch.zeros(n, dtype=torch.uint8)
            m_absmax, v_absmax = torch.zeros(blocks), torch.zeros(blocks)
        else:
            m, v, m_absmax, v_absmax = torch.zeros(n), torch.zeros(n), None, None
        return Unit(name, prefix, layout, master, m, v, torch.zeros((), dtype=torch.float32), work,
                    host_buffer(n, self.work_dtype, self.pin), comp=comp, exp_avg_absmax=m_absmax,
                    exp_avg_sq_absmax=v_absmax)

    @classmethod
    def random(cls, config: ModelConfig, seed: int, work_dtype: torch.dtype, pin: bool,
               fmt: StateFormat = FP32_STATE) -> HostState:
        """N(0, 0.02) matrices, unit norms, zero biases; one generator per unit, filled in parallel."""
        state = cls(config, work_dtype, pin, fmt)

        def init(index: int) -> None:
            unit = state.units[index]
            draw_initial_weights(unit.layout.views(unit.master), seed, index)
            state.refresh_work(unit)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(init, range(len(state.units))))
        return state

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, path: Path, work_dtype: torch.dtype, pin: bool,
                        fmt: StateFormat = FP32_STATE) -> HostState:
        """Masters from a Hugging Face safetensors checkpoint (any float dtype, sharded or not)."""
        state = cls(config, work_dtype, pin, fmt)
        targets = state.state_dict()
        fill_from_checkpoint(targets, path)
        for unit in state.units:
            state.refresh_work(unit)
        return state

    @staticmethod
    def refresh_work(unit: Unit) -> None:
        if unit.work is not unit.master:
            unit.work.copy_(unit.master)

    def add_grad_spares(self) -> None:
        for unit in self.units:
            if unit.grad_spare is None:
                unit.grad_spare = host_buffer(unit.layout.numel, self.work_dtype, self.pin)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face names -> fp32 master views (tied LM head not repeated)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update(unit.master_views())
        return out

    def nbytes(self) -> int:
        return sum(t.nbytes for u in self.units for t in u.buffers())
