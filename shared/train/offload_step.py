"""The offloaded step: one training step of a model whose weights live in host RAM.

GPU residents: two layer-sized weight slots and two gradient slots used in turn, the extras
(embedding, final norm, head: small next to the layers, so they stay resident and are refreshed
once per step after their update), two activation slots for checkpoints coming back, and the
activations of the layer in flight. A stateless template binds the parameter names of a layer to
views of whichever slot holds it; nothing is allocated per layer.

Forward: layer i+1's weights load (h2d lane) while layer i computes; each layer's input goes to
pinned host memory (d2h lane) as its checkpoint. The head computes loss and its backward in token
chunks. Backward, top layer down: layer i-1's weights and checkpoint load while layer i is
recomputed and backpropagated; layer i's gradients go to the host as soon as they exist, with their
squared norm. The last two layers' weights stay on the GPU from the forward, and so do their
inputs except on long sequences (plan.resident_tail). The host optimizer then updates unit by
unit, and the next step's forward of layer i waits only for layer i's update. With
``device_update_layers=k`` the GPU computes the first k layers' updates instead, and with
``device_resident_layers=r`` the first r of them keep their fp32 state and working copy on the GPU,
so their forward and backward read the resident copy and load nothing (device_update.py; plan.py
chooses k and r from the GPU memory cap). Every hand-off between lanes is an event; on CPU
the lanes are no-ops (lanes.py).

Packed batches (``segments`` given, several examples in a row) run every layer's attention with a
block-diagonal causal mask and per-example RoPE positions, both made once per step on the device
(functional.py says what the mask costs); a batch whose rows each hold one example takes the plain
causal path, whatever its padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.shared.model.config import ModelConfig
from tandem.shared.train import functional as fn
from tandem.shared.train.determinism import deterministic_kernels, fix_cublas_workspace
from tandem.shared.train.device_update import DeviceUpdater
from tandem.shared.train.host_state import EXTRAS, HostState
from tandem.shared.train.lanes import Lanes, StepTrace, host_buffer
from tandem.shared.train.layout import head_weight_name
from tandem.shared.train.optimizer import HostAdamW, UpdateJob
from tandem.shared.train.plan import resident_tail


def _sumsq(grad: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as fp64: accumulated in fp64 on CPU (its fp32 norm kernel drifts on large
    tensors), in fp32 on CUDA (a tree reduction, accurate, without an fp64 copy of the layer)."""
    dtype = torch.float32 if grad.is_cuda else torch.float64
    return torch.linalg.vector_norm(grad, dtype=dtype).double().square()


@dataclass
class StepHandle:
    """A step in flight: ``loss()`` waits for its backward, ``job`` is its optimizer update."""

    loss_host: torch.Tensor
    ready: object
    job: UpdateJob
    trace: StepTrace

    def loss(self) -> float:
        self.ready.synchronize()
        return float(self.loss_host)


class OffloadStep:
    def __init__(self, config: ModelConfig, state: HostState, optimizer: HostAdamW, device: torch.device,
                 mlp_chunk: int = 16384, loss_chunk: int | None = None, device_update_layers: int = 0,
                 compile_layers: bool = False, device_update_sets: int = 2, device_resident_layers: int = 0,
                 deterministic: bool = False, attention_chunk: int = fn.ATTENTION_CHUNK) -> None:
        self._init_streaming(config, state, device, mlp_chunk, loss_chunk, compile_layers, deterministic,
                             attention_chunk)
        self.opt = optimizer
        n = self.layer_layout.numel
        empty = lambda size: torch.zeros(size, dtype=self.dtype, device=device)  # noqa: E731
        self.w_slots, self.g_slots = [empty(n), empty(n)], [empty(n), empty(n)]
        self.g_free = [None, None]  # d2h event after the slot's gradients left
        self.extras_w, self.extras_g = empty(self.extras_layout.numel), empty(self.extras_layout.numel)
        self.extras_free = self.extras_g_free = None
        self.sumsq = torch.zeros(len(state.units), dtype=torch.float64, device=device)
        self.sumsq_host = torch.zeros(len(state.units), dtype=torch.float64, pin_memory=self.lanes.cuda)
        self.version = min(optimizer.version)  # updates applied to the weights the next step uses
        self.updater = DeviceUpdater(state, optimizer, self.lanes, device, device_update_layers,
                                     device_update_sets, device_resident_layers)
        self._sync()  # the slots were zeroed on the default stream

    def _init_streaming(self, config: ModelConfig, state: HostState, device: torch.device, mlp_chunk: int,
                        loss_chunk: int | None, compile_layers: bool, deterministic: bool,
                        attention_chunk: int) -> None:
        """What any engine that streams layers through two slots needs, trained base or frozen
        (lora_step.py): lanes, layouts, the layer templates, the slots' bookkeeping (its subclass
        allocates the weight slots) and the per-shape buffers' placeholders."""
        self.cfg, self.state, self.device = config, state, device
        self.deterministic = deterministic and device.type == "cuda"  # the CPU kernels are deterministic already
        if self.deterministic:
            fix_cublas_workspace()
        self.lanes = Lanes(device)
        self.trace = StepTrace(self.lanes, False)
        self.dtype = state.work_dtype
        self.layer_layout = state.units[1].layout if config.num_layers else None
        self.extras_layout = state.units[EXTRAS].layout
        self.mlp_chunk, self.attention_chunk = mlp_chunk, attention_chunk
        self.blocks = fn.compiled_blocks() if compile_layers else fn.EAGER
        self.loss_chunk = loss_chunk or max(256, (512 << 20) // (4 * config.vocab_size))
        self.head_name = head_weight_name(config)
        self.slot_holds: list[tuple[int, int] | None] = [None, None]  # (layer, version) loaded in each slot
        self.slot_free = [None, None]  # compute event after the slot's last use
        self.w_ready = [None, None]
        # small: the allocator's pinning
        self.loss_host = torch.zeros((), dtype=torch.float32, pin_memory=self.lanes.cuda)
        self._shape: tuple[int, int] | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}  # checkpoints on their way back
        self._fwd = True

    # -- buffers per batch shape -------------------------------------------------------------------
    def _prepare(self, bsz: int, seq: int) -> None:
        if self._shape == (bsz, seq):
            return
        self._sync()  # nothing in flight may still use the buffers being replaced
        self._shape = (bsz, seq)
        act = (bsz, seq, self.cfg.hidden_size)
        self.tail = resident_tail(self.cfg.num_layers, bsz * seq, self.attention_chunk)
        saved = self.cfg.num_layers - self.tail
        self.ckpt_host = [host_buffer(act, self.dtype, self.lanes.cuda) for _ in range(saved)]
        self.act_slots = [torch.empty(act, dtype=self.dtype, device=self.device) for _ in range(2)]
        self.act_free, self.ckpt_saved = [None, None], [None] * saved
        self._rope = fn.rope_tables(self.cfg, seq, self.device)
        self._sync()  # made on the default stream; the lanes use them from now on

    def _attention_inputs(self, segments: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                          fn.AttentionMask]:
        """``(cos, sin, mask)`` for this step's attention: the shared tables and no mask unless some
        row packs two examples or more; then tables gathered at per-example positions and the
        block-diagonal mask (a FlexAttention block mask on CUDA with the atomics kernels, else a
        dense one: functional.py). Padding (segment -1) after a row's only example needs no mask:
        causal attention never lets the example see what follows it."""
        cos, sin = self._rope
        if segments is None or not bool((segments.amax(dim=1) > 0).any()):
            return cos, sin, None
        seg = segments.to(self.device, non_blocking=True)
        cos, sin = fn.packed_rope(cos, sin, fn.packed_positions(seg))
        flex = fn.flex_packing(self.lanes.cuda, self.deterministic)
        mask = fn.segment_block_mask(seg) if flex else fn.segment_mask(seg, self.dtype)
        return cos, sin, mask

    def _sync(self) -> None:
        if self.lanes.cuda:
            torch.cuda.synchronize(self.device)

    # -- loading -------------------------------------------------------------------------------------
    def _load_layer(self, layer: int, version: int) -> None:
        """Make the slot for ``layer`` hold its weights at ``version`` (nothing for a resident layer)."""
        if self.updater.is_resident(layer):
            return
        slot = layer % 2
        if self.slot_holds[slot] == (layer, version):
            return
        self.opt.wait(layer + 1, version)  # host side: the CPU update of this layer is done
        if self.updater.owns(layer):
            self.lanes.wait("h2d", self.updater.done[layer])  # or the GPU's, back in host RAM
        unit = self.state.units[layer + 1]
        self.lanes.wait("h2d", self.slot_free[slot])
        with self.lanes.on("h2d"), self.trace.op("h2d", layer, "fwd" if self._fwd else "bwd", unit.work.nbytes):
            self.w_slots[slot].copy_(unit.work, non_blocking=True)
        self.w_ready[slot] = self.lanes.record("h2d")
        self.slot_holds[slot] = (layer, version)

    def _weights(self, layer: int) -> tuple[torch.Tensor, object, int | None]:
        """``(flat weights, event they are ready at, slot or None)`` of a loaded layer."""
        if self.updater.is_resident(layer):
            return self.updater.work(layer), self.updater.done[layer], None
        slot = layer % 2
        return self.w_slots[slot], self.w_ready[slot], slot

    def _load_checkpoint(self, layer: int) -> tuple[torch.Tensor, object]:
        slot = layer % 2
        self.lanes.wait("h2d", self.act_free[slot])
        self.lanes.wait("h2d", self.ckpt_saved[layer])
        with self.lanes.on("h2d"), self.trace.op("h2d", layer, "recompute", self.ckpt_host[layer].nbytes):
            self.act_slots[slot].copy_(self.ckpt_host[layer], non_blocking=True)
        return self.act_slots[slot], self.lanes.record("h2d")

    def _leaves(self, weights: torch.Tensor, grads: torch.Tensor, layout) -> dict[str, torch.Tensor]:  # noqa: ANN001
        out = {}
        for (name, w), g in zip(layout.views(weights).items(), layout.views(grads).values()):
            leaf = w.detach().requires_grad_(True)
            leaf.grad = g
            out[name] = leaf
        return out

    # -- one step --------------------------------------------------------------------------------------
    def step(self, input_ids: torch.Tensor, targets: torch.Tensor, record_timeline: bool = False,
             segments: torch.Tensor | None = None) -> StepHandle:
        """Run forward + backward of one batch (``[B, S]`` ids and targets on the host; ``segments``
        as ``data.Batch.segments``, None for plain causal rows), hand the gradients to the optimizer,
        return at once; the GPU and optimizer work run on. Launched under ``deterministic_kernels``
        when the engine was made ``deterministic``."""
        with deterministic_kernels(self.deterministic):
            return self._step(input_ids, targets, record_timeline, segments)

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
            self.opt.wait(EXTRAS, version)
            extras = self.state.units[EXTRAS]
            lanes.wait("h2d", self.extras_free)
            with lanes.on("h2d"), tl.op("h2d", -1, "fwd", extras.work.nbytes):
                self.extras_w.copy_(extras.work, non_blocking=True)
            lanes.wait("compute", lanes.record("h2d"))
            with tl.op("compute", -1, "fwd"):
                x = fn.embed_forward(self.extras_layout.views(self.extras_w), ids)
            self._load_layer(0, version)
            resident: dict[int, torch.Tensor] = {}
            for i in range(L):
                # Layer i+1 is loaded before layer i is issued: while the host optimizer paces the
                # forward, layer i then computes during layer i+1's copy instead of before it.
                if i + 1 < L:
                    self._load_layer(i + 1, version)
                if i < L - self.tail:
                    self._save_checkpoint(i, x)
                else:
                    resident[i] = x
                weights, ready, slot = self._weights(i)
                lanes.wait("compute", ready)
                with tl.op("compute", i, "fwd"):
                    x = fn.layer_forward(self.layer_layout.views(weights), x, cos, sin, cfg, self.mlp_chunk,
                                         self.blocks, mask, self.attention_chunk)
                if slot is not None:
                    self.slot_free[slot] = lanes.record("compute")

            # head: loss and its backward, chunked; extras gradients accumulate from here on
            self._fwd = False
            lanes.wait("compute", self.extras_g_free)
            with tl.op("compute", -1, "bwd"):
                self.extras_g.zero_()
                leaves = self._leaves(self.extras_w, self.extras_g, self.extras_layout)
                loss, grad = fn.head_loss_backward(leaves, self.head_name, x, tgt, num_targets, cfg, self.loss_chunk)
            del x
            if L and L - 1 not in resident:  # no resident tail: the top layer's input is a checkpoint too
                self._pending[L - 1] = self._load_checkpoint(L - 1)
            self.updater.arm_prefetch()
            for i in reversed(range(L)):
                x_in, x_ready = (resident.pop(i), None) if i in resident else self._pending.pop(i)
                if i - 1 >= 0:
                    self._load_layer(i - 1, version)
                    if i - 1 < L - self.tail:
                        self._pending[i - 1] = self._load_checkpoint(i - 1)
                self.updater.prefetch(tl)  # behind this layer's loads
                grad = self._layer_backward(i, x_in, x_ready, grad, cos, sin, mask)
            with tl.op("compute", -1, "bwd"):
                fn.embed_backward(self.extras_layout.views(self.extras_g)["model.embed_tokens.weight"], ids, grad)
                self.sumsq[EXTRAS] = _sumsq(self.extras_g)
            done = lanes.record("compute")
            self.extras_free = done
            self.updater.issue(version + 1, self.sumsq, done, tl)
            lanes.wait("d2h", done)
            with lanes.on("d2h"):
                extras_grad = self.state.units[EXTRAS].grad_for(version + 1)
                with tl.op("d2h", -1, "bwd", extras_grad.nbytes):
                    extras_grad.copy_(self.extras_g, non_blocking=True)
                self.sumsq_host.copy_(self.sumsq, non_blocking=True)
                self.loss_host.copy_(loss, non_blocking=True)
            lanes.keep_alive(loss, "d2h")
            self.extras_g_free = ready = lanes.record("d2h")
        job = UpdateJob(version=version + 1, wait_grads=ready.synchronize, sumsq=self.sumsq_host, t0=tl.t0,
                        record=(lambda u, a, b, n: tl.add_host_op(u - 1, a, b, n)) if record_timeline else None)
        self.opt.submit(job)
        self.version = version + 1
        return StepHandle(self.loss_host, ready, job, tl)

    def _save_checkpoint(self, layer: int, x: torch.Tensor) -> None:
        self.lanes.wait("d2h", self.lanes.record("compute"))
        with self.lanes.on("d2h"), self.trace.op("d2h", layer, "fwd", x.nbytes):
            self.ckpt_host[layer].copy_(x, non_blocking=True)
        self.lanes.keep_alive(x, "d2h")
        self.ckpt_saved[layer] = self.lanes.record("d2h")

    def synchronize(self) -> None:
        """Wait for every update the GPU took on (the host optimizer has its own ``wait_all``)."""
        self.updater.synchronize()
        self._sync()

    def _layer_backward(self, i: int, x_in: torch.Tensor, x_ready, grad: torch.Tensor, cos, sin,  # noqa: ANN001
                        mask: fn.AttentionMask) -> torch.Tensor:
        lanes, half, on_device = self.lanes, i % 2, self.updater.owns(i)
        weights, ready, slot = self._weights(i)
        grads = self.updater.grads[i] if on_device else self.g_slots[half]
        lanes.wait("compute", ready)
        lanes.wait("compute", x_ready)
        lanes.wait("compute", self.updater.read[i] if on_device else self.g_free[half])
        with self.trace.op("compute", i, "bwd"):
            grads.zero_()
            leaves = self._leaves(weights, grads, self.layer_layout)
            grad = fn.layer_backward(leaves, x_in, grad, cos, sin, self.cfg, self.mlp_chunk, self.blocks, mask,
                                     self.attention_chunk)
            self.sumsq[i + 1] = _sumsq(grads)
        done = lanes.record("compute")
        self.act_free[half] = done
        if slot is not None:
            self.slot_free[slot] = done
        if on_device:  # its gradients stay for the GPU's update (device_update.py)
            return grad
        lanes.wait("d2h", done)
        host_grad = self.state.units[i + 1].grad_for(self.version + 1)
        with lanes.on("d2h"), self.trace.op("d2h", i, "bwd", host_grad.nbytes):
            host_grad.copy_(self.g_slots[half], non_blocking=True)
        self.g_free[half] = lanes.record("d2h")
        return grad

    def gpu_buffers_nbytes(self) -> int:
        """Bytes of the buffers the engine keeps on its device between steps (slots, extras, the
        activation slots of the current batch shape, RoPE tables, the device updater's buffers):
        what the memory plan (plan.py) counts as persistent."""
        tensors = [*self.w_slots, *self.g_slots, self.extras_w, self.extras_g, self.sumsq]
        if self._shape is not None:
            tensors += [*self.act_slots, *self._rope]
        return sum(t.nbytes for t in tensors) + self.updater.gpu_nbytes()

    def host_buffers_nbytes(self) -> int:
        """Bytes of the engine's own host buffers (activation checkpoints, the norms and loss)."""
        ckpts = getattr(self, "ckpt_host", [])
        return sum(t.nbytes for t in ckpts) + self.sumsq_host.nbytes + self.loss_host.nbytes
