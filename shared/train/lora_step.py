"""The LoRA step: one training step of an adapter over a frozen base that streams from host RAM.

The same schedule as full training's offloaded step (offload_step.py, whose slots, activation
checkpoints, loads and lanes it reuses), minus everything the base's training needs: the base
(frozen_base.py) is never updated, so a layer's weights load without waiting for any optimizer,
a slot that still holds a layer from the last step is not loaded again, the backward computes no
gradient of a base weight (its leaves do not ask for one: each projection's backward computes
the gradient of its input and of the adapter only) and nothing goes back to the host but the
loss and the gradient norm. The first ``resident`` layers and the extras live on the device
(frozen_base.py) and load nothing.

The adapter (lora.py) sits on the device: its A and B join each layer's parameter dict
(``functional.project`` adds ``B A x · scaling`` to the targeted projections), its gradients
accumulate in one flat buffer through the layers' backward, and its AdamW runs on the compute
lane after the backward, before the next step's forward reads the new masters.
"""

from __future__ import annotations

import torch

from tandem.shared.model.config import ModelConfig
from tandem.shared.train import functional as fn
from tandem.shared.train.frozen_base import FrozenBase
from tandem.shared.train.host_state import EXTRAS
from tandem.shared.train.lanes import StepTrace
from tandem.shared.train.lora import AdapterAdamW
from tandem.shared.train.offload_step import OffloadStep, StepHandle
from tandem.shared.train.optimizer import UpdateJob

FROZEN = 0  # the version every base layer is at, forever (OffloadStep's slots are keyed by (layer, version))


class LoraStep(OffloadStep):
    """One adapter's step over a frozen base; the driving side (``step``, ``synchronize``, the
    handle) is :class:`OffloadStep`'s."""

    def __init__(self, config: ModelConfig, base: FrozenBase, optimizer: AdapterAdamW, device: torch.device,
                 mlp_chunk: int = 16384, loss_chunk: int | None = None, compile_layers: bool = False,
                 deterministic: bool = False, attention_chunk: int = fn.ATTENTION_CHUNK) -> None:
        self._init_streaming(config, base, device, mlp_chunk, loss_chunk, compile_layers, deterministic,
                             attention_chunk)
        self.opt, self.adapter = optimizer, optimizer.adapter
        streamed = config.num_layers - base.resident
        n = self.layer_layout.numel if streamed else 0
        self.w_slots = [torch.zeros(n, dtype=self.dtype, device=device) for _ in range(2 if streamed else 0)]
        self.extras_w = base.units[EXTRAS].work  # on the device for the whole run
        self.sumsq = torch.zeros(1, dtype=torch.float64, device=device)
        self.sumsq_host = torch.zeros(1, dtype=torch.float64, pin_memory=self.lanes.cuda)
        self.version = optimizer.steps_done  # updates applied to the adapter
        self._sync()  # the slots were zeroed on the default stream

    # -- loading (no optimizer to wait for) -----------------------------------------------------------
    def _load_layer(self, layer: int, version: int = FROZEN) -> None:
        if self.state.on_device(layer + 1):
            return
        slot = layer % 2
        if self.slot_holds[slot] == (layer, FROZEN):
            return
        unit = self.state.units[layer + 1]
        self.lanes.wait("h2d", self.slot_free[slot])
        with self.lanes.on("h2d"), self.trace.op("h2d", layer, "fwd" if self._fwd else "bwd", unit.work.nbytes):
            self.w_slots[slot].copy_(unit.work, non_blocking=True)
        self.w_ready[slot] = self.lanes.record("h2d")
        self.slot_holds[slot] = (layer, FROZEN)

    def _weights(self, layer: int) -> tuple[torch.Tensor, object, int | None]:
        if self.state.on_device(layer + 1):
            return self.state.units[layer + 1].work, None, None
        slot = layer % 2
        return self.w_slots[slot], self.w_ready[slot], slot

    # -- one step --------------------------------------------------------------------------------------
    def _step(self, input_ids: torch.Tensor, targets: torch.Tensor, record_timeline: bool,
              segments: torch.Tensor | None) -> StepHandle:
        cfg, lanes, L = self.cfg, self.lanes, self.cfg.num_layers
        version = self.version
        self._prepare(*input_ids.shape)
        self.trace = tl = StepTrace(lanes, record_timeline)
        self._fwd = True
        with lanes.on("compute"):
            cos, sin, mask = self._attention_inputs(segments)
            ids = input_ids.to(self.device, non_blocking=True)
            tgt = targets.to(self.device, non_blocking=True)
            num_targets = max(1, int((targets != -100).sum()))
            extras = self.extras_layout.views(self.extras_w)
            with tl.op("compute", -1, "fwd"):
                x = fn.embed_forward(extras, ids)
            self._load_layer(0)
            resident: dict[int, torch.Tensor] = {}
            for i in range(L):
                if i + 1 < L:  # loaded before layer i is issued, as in OffloadStep
                    self._load_layer(i + 1)
                if i < L - self.tail:
                    self._save_checkpoint(i, x)
                else:
                    resident[i] = x
                weights, ready, slot = self._weights(i)
                lanes.wait("compute", ready)
                with tl.op("compute", i, "fwd"):
                    x = fn.layer_forward(self.layer_layout.views(weights) | self.adapter.params(i), x, cos, sin, cfg,
                                         self.mlp_chunk, self.blocks, mask, self.attention_chunk)
                if slot is not None:
                    self.slot_free[slot] = lanes.record("compute")

            # the head's weights are plain tensors: its backward gives dL/dx only
            self._fwd = False
            with tl.op("compute", -1, "bwd"):
                loss, grad = fn.head_loss_backward(extras, self.head_name, x, tgt, num_targets, cfg, self.loss_chunk)
                self.opt.zero_grad()
            del x
            if L and L - 1 not in resident:
                self._pending[L - 1] = self._load_checkpoint(L - 1)
            for i in reversed(range(L)):
                x_in, x_ready = (resident.pop(i), None) if i in resident else self._pending.pop(i)
                if i - 1 >= 0:
                    self._load_layer(i - 1)
                    if i - 1 < L - self.tail:
                        self._pending[i - 1] = self._load_checkpoint(i - 1)
                grad = self._layer_backward(i, x_in, x_ready, grad, cos, sin, mask)
            del grad
            with tl.op("compute", -1, "opt"):
                self.sumsq.copy_(self.opt.update(version + 1).view(1))
            done = lanes.record("compute")
            lanes.wait("d2h", done)
            with lanes.on("d2h"):
                self.sumsq_host.copy_(self.sumsq, non_blocking=True)
                self.loss_host.copy_(loss, non_blocking=True)
            lanes.keep_alive(loss, "d2h")
            ready = lanes.record("d2h")
        job = UpdateJob(version=version + 1, wait_grads=ready.synchronize, sumsq=self.sumsq_host, t0=tl.t0)
        job.done.set()  # the update ran on the compute lane, ahead of ``ready``
        self.version = version + 1
        return StepHandle(self.loss_host, ready, job, tl)

    def _layer_backward(self, i: int, x_in: torch.Tensor, x_ready, grad: torch.Tensor, cos, sin,  # noqa: ANN001
                        mask: fn.AttentionMask) -> torch.Tensor:
        weights, ready, slot = self._weights(i)
        self.lanes.wait("compute", ready)
        self.lanes.wait("compute", x_ready)
        with self.trace.op("compute", i, "bwd"):
            params = self.layer_layout.views(weights) | self.adapter.leaves(i)
            grad = fn.layer_backward(params, x_in, grad, cos, sin, self.cfg, self.mlp_chunk, self.blocks, mask,
                                     self.attention_chunk)
        done = self.lanes.record("compute")
        self.act_free[i % 2] = done
        if slot is not None:
            self.slot_free[slot] = done
        return grad

    def synchronize(self) -> None:
        self._sync()

    def gpu_buffers_nbytes(self) -> int:
        """Bytes kept on the device between steps: the slots, the activation slots and RoPE tables of
        the current shape, the norm, and what the base and the adapter keep there (the memory plan's
        persistent GPU bytes of a LoRA run)."""
        tensors = [*self.w_slots, self.sumsq]
        if self._shape is not None:
            tensors += [*self.act_slots, *self._rope]
        return sum(t.nbytes for t in tensors) + self.state.device_nbytes() + self.adapter.nbytes()
