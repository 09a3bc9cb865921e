"""The frozen base model of a LoRA run: its weights in the compute dtype, nothing else.

A LoRA run trains only the adapter (lora.py), so the base needs no fp32 master, no AdamW moments
and no gradient buffers: 2 bytes a parameter in bf16 (the CUDA compute dtype; 4 in fp32 on CPU),
where full training keeps 12 of fp32 state, a working copy and one or two gradient buffers on the
host (host_state.py: 16 to 18 bytes a parameter in bf16). Per unit one flat buffer in
:mod:`.layout`'s order, so the engine streams a decoder layer in one copy as in full training.

Where each unit lives: the decoder layers in host RAM (page-locked on CUDA, for asynchronous
copies), except the first ``resident``, which live on the device for the whole run and never take
host RAM or PCIe time; the extras (embedding, final norm, LM head) on the device too (the head runs
every step and never changes, so it is loaded once). On CPU everything is host memory anyway.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.shared.model.config import ModelConfig
from tandem.shared.train.host_state import EXTRAS, draw_initial_weights, fill_from_checkpoint
from tandem.shared.train.lanes import host_buffer
from tandem.shared.train.layout import UnitLayout, extras_layout, layer_layout

INIT_THREADS = 8  # each holds one fp32 matrix while drawing it (0.7 GB at 34B's MLP)


@dataclass
class FrozenUnit:
    name: str  # "extras" or "layer.<i>", as host_state.Unit
    prefix: str  # what precedes the layout's names in a checkpoint ("" or "model.layers.<i>.")
    layout: UnitLayout
    work: torch.Tensor  # the weights, compute dtype, on the host or the device (see the module)


class FrozenBase:
    """The base's units (extras first, then each decoder layer, as :class:`HostState`'s) in the compute
    dtype, placed as the module says."""

    def __init__(self, config: ModelConfig, work_dtype: torch.dtype, device: torch.device, resident: int = 0,
                 pin: bool = False) -> None:
        self.config, self.work_dtype, self.device = config, work_dtype, device
        self.resident = min(resident, config.num_layers) if device.type == "cuda" else 0
        self.units = [FrozenUnit("extras", "", extras_layout(config),
                                 torch.zeros(extras_layout(config).numel, dtype=work_dtype, device=device))]
        layout = layer_layout(config)
        for i in range(config.num_layers):
            if i < self.resident:
                work = torch.zeros(layout.numel, dtype=work_dtype, device=device)
            else:
                work = host_buffer(layout.numel, work_dtype, pin)
            self.units.append(FrozenUnit(f"layer.{i}", f"model.layers.{i}.", layout, work))

    def on_device(self, index: int) -> bool:
        """Whether unit ``index`` lives on the device (the extras and the resident layers)."""
        return index == EXTRAS or index - 1 < self.resident

    @classmethod
    def random(cls, config: ModelConfig, seed: int, work_dtype: torch.dtype, device: torch.device,
               resident: int = 0, pin: bool = False) -> FrozenBase:
        """:meth:`HostState.random`'s weights (same generators, same draws) in the compute dtype: a
        LoRA run on a preset adapts the model a full run of that seed starts from."""
        base = cls(config, work_dtype, device, resident, pin)

        def init(index: int) -> None:
            unit = base.units[index]
            draw_initial_weights(unit.layout.views(unit.work), seed, index)

        with ThreadPoolExecutor(INIT_THREADS) as pool:
            list(pool.map(init, range(len(base.units))))
        return base

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, path: Path, work_dtype: torch.dtype, device: torch.device,
                        resident: int = 0, pin: bool = False) -> FrozenBase:
        """The base from a Hugging Face safetensors checkpoint (any float dtype, sharded or not), one
        tensor at a time: nothing of the model's size is held twice."""
        base = cls(config, work_dtype, device, resident, pin)
        targets = base.state_dict()
        fill_from_checkpoint(targets, path)
        return base

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face names -> views of the weights (tied LM head not repeated)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            out.update({unit.prefix + k: v for k, v in unit.layout.views(unit.work).items()})
        return out

    def host_nbytes(self) -> int:
        return sum(u.work.nbytes for i, u in enumerate(self.units) if not self.on_device(i))

    def device_nbytes(self) -> int:
        return sum(u.work.nbytes for i, u in enumerate(self.units) if self.on_device(i))
