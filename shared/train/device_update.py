"""Optional: the first layers' AdamW updates computed on the GPU while the CPU does the rest.

The host optimizer is what bounds a step once the GPU is fast (every parameter's fp32 update reads
and writes ~30 bytes of host RAM). While it works, the GPU waits and the PCIe link is mostly idle,
so the engine can take over some layers, in two ways:

- **Resident** (layers 0..r-1): the layer's fp32 master, moments and its working copy live on the
  GPU for the whole run. Its update reads no host memory and moves nothing over PCIe, and the
  forward and backward use the resident working copy in place (no weight copy either). The host
  tensors of these layers are only a staging area: :meth:`DeviceUpdater.synchronize` copies the
  state back before a checkpoint. This is what the GPU memory cap is best spent on (plan.py).
- **Streamed** (layers r..k-1): state still lives in host RAM between steps; right after the
  backward their fp32 master, moments and step come over, get the same fused AdamW, and go back to
  host RAM with the new working copy. ``sets`` GPU buffer sets (1.8 GB each at 3B) let that many
  layers' state load ahead, during the backward, before the gradients are ready: a piece the size
  of a working copy per backward layer (:meth:`DeviceUpdater.prefetch`), between the backward's own
  copies.

Both keep the layer's gradients on the GPU after the backward and apply the same clip coefficient
(computed on the GPU from the same per-unit squared norms). The first layers are the ones taken
because the next forward needs them first while the CPU starts on the extras and layer k. Extra
lanes (update h2d, update compute, update d2h) keep these copies from queueing in front of the
forward's own. On CPU the same path runs, on separate CPU tensors.
"""

from __future__ import annotations

import torch

from tandem.shared.train.host_state import HostState
from tandem.shared.train.lanes import Lanes, StepTrace, host_buffer
from tandem.shared.train.optimizer import HostAdamW

STATE = ("master", "exp_avg", "exp_avg_sq")


class DeviceUpdater:
    def __init__(self, state: HostState, opt: HostAdamW, lanes: Lanes, device: torch.device, layers: int,
                 sets: int = 2, resident: int = 0) -> None:
        self.state, self.opt, self.lanes, self.device = state, opt, lanes, device
        self.layers = min(max(layers, resident), state.config.num_layers)
        self.resident = min(resident, self.layers)
        n = state.units[1].layout.numel if self.layers else 0
        f32 = lambda: torch.zeros(n, dtype=torch.float32, device=device)  # noqa: E731
        self.grads = [torch.zeros(n, dtype=state.work_dtype, device=device) for _ in range(self.layers)]
        streamed = self.layers - self.resident
        self.sets = [(f32(), f32(), f32(), f32(), torch.zeros(n, dtype=state.work_dtype, device=device))
                     for _ in range(min(max(1, sets), streamed))]  # (master, exp_avg, exp_avg_sq, grad32, work)
        self.set_free = [None] * len(self.sets)
        # resident layers: (master, exp_avg, exp_avg_sq, work) on the device, and one fp32 gradient scratch
        self.res = [tuple(getattr(state.units[j + 1], a).to(device, copy=True) for a in (*STATE, "work"))
                    for j in range(self.resident)]
        self.g32 = f32() if self.resident else None
        # the first streamed layers' state loads, one piece per backward layer (:meth:`prefetch`)
        self.prefetch_queue: list[tuple[int, int, int, int, int]] = []  # (layer, set, tensor, lo, hi)
        self.prefetched: dict[int, object] = {}  # layer -> xh2d event: its whole state is in its set
        self.done = [None] * self.layers  # layer j's new weights are ready (streamed: back in host RAM)
        self.read = [None] * self.layers  # update-compute event: layer j's gradient buffer was consumed
        self.steps = [state.units[j + 1].step.clone().to(device) for j in range(self.layers)]
        if lanes.cuda:  # the fp32 state of the streamed layers moves asynchronously: page-lock it
            for j in range(self.resident, self.layers):
                unit = state.units[j + 1]
                for name in STATE:
                    pinned = host_buffer(getattr(unit, name).numel(), torch.float32, True)
                    setattr(unit, name, pinned.copy_(getattr(unit, name)))
        opt.skip.update(range(1, self.layers + 1))

    def owns(self, layer: int) -> bool:
        return layer < self.layers

    def is_resident(self, layer: int) -> bool:
        return layer < self.resident

    def work(self, layer: int) -> torch.Tensor:
        """The resident working copy of ``layer`` (what its forward and backward read)."""
        return self.res[layer][3]

    def arm_prefetch(self) -> None:
        """Queue the state loads of the first streamed layers (as many as there are buffer sets) in
        pieces of a working copy's size, for :meth:`prefetch` to submit during the coming backward."""
        self.prefetched = {}  # a step that failed midway may have left events of its own
        n = self.sets[0][0].numel() if self.sets else 0
        piece = max(1, n * self.state.work_dtype.itemsize // 4)  # fp32 elements in a working copy's bytes
        self.prefetch_queue = [(j, self._set_of(j), index, lo, min(n, lo + piece))
                               for j in range(self.resident, self.resident + len(self.sets))
                               for index in range(len(STATE)) for lo in range(0, n, piece)]

    def _set_of(self, layer: int) -> int:
        """The buffer set a streamed layer's update uses."""
        return (layer - self.resident) % len(self.sets)

    def prefetch(self, trace: StepTrace, behind_loads: bool = True) -> None:
        """Submit the next queued piece of state, to start once the copies queued so far on the h2d
        lane (the backward layer's own loads) have completed (``behind_loads``). The engine calls
        this once per backward layer, after that layer's loads: submitted at once, two layers' state
        (2.4 GB at 3B) queued ahead of the backward's next weight copy and stalled the step on it, and
        pieces submitted without the wait ran ahead of a weight copy still waiting for its slot. A
        piece is a working copy's size: it fits beside a layer's own loads."""
        if not self.prefetch_queue:
            return
        j, s, index, lo, hi = self.prefetch_queue.pop(0)
        if index == 0 and lo == 0:
            self.lanes.wait("xh2d", self.set_free[s])
        if behind_loads:
            self.lanes.wait("xh2d", self.lanes.record("h2d"))
        source = getattr(self.state.units[j + 1], STATE[index])
        with self.lanes.on("xh2d"), trace.op("h2d", j, "opt", (hi - lo) * 4, "xh2d"):
            self.sets[s][index][lo:hi].copy_(source[lo:hi], non_blocking=True)
        if index == len(STATE) - 1 and hi == source.numel():
            self.prefetched[j] = self.lanes.record("xh2d")

    def issue(self, version: int, sumsq: torch.Tensor, grads_ready, trace: StepTrace) -> None:  # noqa: ANN001
        """Queue the updates of layers 0..k-1 with the gradients of the step that made ``version``
        (what the backward did not prefetch is loaded now)."""
        if not self.layers:
            return
        while self.prefetch_queue:
            self.prefetch(trace, behind_loads=False)
        lanes, opt = self.lanes, self.opt
        lr = opt.lr_at(version)
        with lanes.on("opt"):
            lanes.wait("opt", grads_ready)
            total = sumsq.sum().sqrt()
            coef = (opt.grad_clip / (total + 1e-6)).clamp(max=1.0) if opt.grad_clip > 0 else torch.ones_like(total)
            coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef)).float()
        for j in range(self.layers):
            unit = self.state.units[j + 1]
            if j < self.resident:
                master, m, v, work = self.res[j]
                with lanes.on("opt"), trace.op("compute", j, "opt", 0, "opt"):
                    self._adamw(j, master, m, v, self.g32, work, coef, lr)
                self.read[j] = self.done[j] = lanes.record("opt")
                unit.step += 1
                continue
            s = self._set_of(j)
            master, m, v, g32, work = self.sets[s]
            loaded = self.prefetched.pop(j, None)
            if loaded is None:
                lanes.wait("xh2d", self.set_free[s])
                with lanes.on("xh2d"), trace.op("h2d", j, "opt", 3 * master.nbytes, "xh2d"):
                    master.copy_(unit.master, non_blocking=True)
                    m.copy_(unit.exp_avg, non_blocking=True)
                    v.copy_(unit.exp_avg_sq, non_blocking=True)
                loaded = lanes.record("xh2d")
            lanes.wait("opt", loaded)
            with lanes.on("opt"), trace.op("compute", j, "opt", 0, "opt"):
                self._adamw(j, master, m, v, g32, work, coef, lr)
            self.read[j] = updated = lanes.record("opt")
            lanes.wait("xd2h", updated)
            with lanes.on("xd2h"), trace.op("d2h", j, "opt", 3 * master.nbytes + work.nbytes, "xd2h"):
                unit.master.copy_(master, non_blocking=True)
                unit.exp_avg.copy_(m, non_blocking=True)
                unit.exp_avg_sq.copy_(v, non_blocking=True)
                unit.work.copy_(work, non_blocking=True)
            self.done[j] = self.set_free[s] = lanes.record("xd2h")
            unit.step += 1

    def _adamw(self, j: int, master, m, v, g32, work, coef, lr: float) -> None:  # noqa: ANN001
        opt, layout = self.opt, self.state.units[j + 1].layout
        g32.copy_(self.grads[j]).mul_(coef)  # in fp32, as the host path scales
        self.steps[j] += 1
        for lo, hi, wd in layout.decay_ranges(opt.weight_decay):
            torch._fused_adamw_([master[lo:hi]], [g32[lo:hi]], [m[lo:hi]], [v[lo:hi]], [], [self.steps[j]],
                                lr=lr, beta1=opt.betas[0], beta2=opt.betas[1], weight_decay=wd,
                                eps=opt.eps, amsgrad=False, maximize=False)
        work.copy_(master)

    def synchronize(self) -> None:
        """Wait until every issued update is done and its state is in host RAM (before a checkpoint):
        the resident layers' state is copied into their host tensors."""
        for event in self.done:
            if event is not None:
                event.synchronize()
        for j in range(self.resident):
            unit = self.state.units[j + 1]
            for name, tensor in zip((*STATE, "work"), self.res[j]):
                getattr(unit, name).copy_(tensor)

    def gpu_nbytes(self) -> int:
        """Bytes of the device buffers this updater holds (the memory plan's figure for them)."""
        tensors = [*self.grads, *(t for s in self.sets for t in s), *(t for r in self.res for t in r), *self.steps]
        if self.g32 is not None:
            tensors.append(self.g32)
        return sum(t.nbytes for t in tensors)
