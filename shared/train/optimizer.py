"""AdamW on the host: fp32, decoupled weight decay, exact global-norm clipping, unit by unit.

The update of step k starts once step k's backward has finished (the global gradient norm needs
every gradient) and walks the units in forward order: extras, layer 0, layer 1, ... After each
unit it refreshes that unit's working copy and bumps the unit's version, so the next step's forward
of layer i waits for layer i's update only (:meth:`HostAdamW.wait`) and the CPU update overlaps the
GPU's forward. Gradients are clip-scaled by multiplying (as ``clip_grad_norm_`` does) before the
update.

Two arithmetic paths: the fused C kernel (host_kernel.py, one pass over host memory, GIL released)
and, where it cannot be built, ``torch._fused_adamw_`` over cache-sized chunks. A compact state
(bf16 masters, int8 moments: state_format.py) takes the kernel's compact pass, or where there is no
kernel the same arithmetic in torch (``state_format.adamw_reference``).

**Preview, then commit** (``split=True``; the fp32 state's only with the kernel). The next forward needs only the new
*working copy*; the new masters and moments are needed by the next update. So a step's update runs
in two passes: *preview* reads masters, moments and gradient and writes only the working copy (16
of the 28 bytes per parameter a full update moves), unit by unit as above, which is what the next
forward waits on; *commit* then writes masters and moments, while the GPU runs the next backward and
the host is otherwise idle. Both passes evaluate the same expression per element, so the working
copy the forward used is bit for bit the one a full update would write. Commit reads the gradient
after the next backward has started producing new ones, so split mode gives each unit a second
gradient buffer (:meth:`Unit.grad_for`). :meth:`wait_all` waits for commits. A bf16 master is
written by the preview (it is, or makes, the working copy; the commit never reads it: the moments
do not depend on it), so its commit writes only the moments.

    opt = HostAdamW(state, lr_at=lambda step: 3e-4, weight_decay=0.1, grad_clip=1.0)
    opt.start(); opt.submit(UpdateJob(...)); opt.wait(unit_index, version)
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.shared.infra.config import from_env
from tandem.shared.train import host_kernel
from tandem.shared.train.host_state import HostState, Unit
from tandem.shared.train.state_format import BLOCK, adamw_reference, block_offsets, step_seed

BETAS = (0.9, 0.95)
EPS = 1e-8


def lr_schedule(base_lr: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_ratio * base_lr`` at ``total_steps``.
    ``step`` counts updates from 1."""

    def lr_at(step: int) -> float:
        if warmup_steps and step <= warmup_steps:
            return base_lr * step / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    return lr_at


@dataclass
class UpdateJob:
    """The update with the gradients of one step. ``wait_grads`` blocks until every gradient and
    the per-unit squared norms are on the host; ``sumsq`` then holds one value per unit."""

    version: int  # updates applied once this job is done (1 for the first step)
    wait_grads: Callable[[], None]
    sumsq: torch.Tensor
    t0: float = 0.0  # perf_counter of the step's start, for timeline ops
    record: Callable[[int, float, float, int], None] | None = None  # (unit, start_s, end_s, bytes)
    done: threading.Event = field(default_factory=threading.Event)
    grad_norm: float = 0.0
    lr: float = 0.0


class HostAdamW:
    """Updates :class:`HostState` units in a background thread; see the module docstring."""

    def __init__(self, state: HostState, lr_at: Callable[[int], float], weight_decay: float, grad_clip: float,
                 betas: tuple[float, float] = BETAS, eps: float = EPS, kernel: bool = True,
                 split: bool = False, seed: int = 0) -> None:
        self.state = state
        self.kernel = host_kernel.load() if kernel else None
        self.compact = not state.format.default
        self.split = split and (self.kernel is not None or self.compact)
        self.seed = seed  # of a bf16 master's stochastic rounding (state_format.step_seed)
        if self.split:
            state.add_grad_spares()
        self.lr_at = lr_at
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.betas = betas
        self.eps = eps
        self.version = [int(u.step.item()) for u in state.units]  # working copies hold this many updates
        self.settled = list(self.version)  # masters and moments hold this many
        self._cond = threading.Condition()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # Elements per torch fused call (TANDEM_ADAM_CHUNK; 32 MiB per fp32 tensor by default).
        self.chunk = from_env("host_adam").adam_chunk
        self._tmp = torch.empty(self.chunk, dtype=torch.float32)
        self.skip: set[int] = set()  # units another updater (the GPU: device_update.py) takes care of

    # -- the engine's side -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="host-adamw", daemon=True)
        self._thread.start()

    def submit(self, job: UpdateJob) -> None:
        self._jobs.put(job)

    def wait(self, unit: int, version: int) -> None:
        """Block until unit ``unit``'s working copy has had ``version`` updates applied."""
        self._wait_until(lambda: self.version[unit] >= version)

    def wait_all(self, version: int) -> None:
        """Block until every unit's masters and moments (not only its working copy) hold ``version``."""
        self._wait_until(lambda: min(self.settled) >= version)

    def _wait_until(self, reached: Callable[[], bool]) -> None:
        with self._cond:
            while not reached() and self._error is None:
                self._cond.wait(1.0)
        if self._error is not None:
            raise RuntimeError("the host optimizer failed") from self._error

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # -- the optimizer thread --------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self.apply(job)
            except BaseException as exc:  # surfaced to the engine by wait()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def apply(self, job: UpdateJob) -> None:
        """Run one update synchronously (the thread's body; callable directly without the thread)."""
        job.wait_grads()
        total = float(job.sumsq.double().sum().sqrt())
        scale = 1.0
        if self.grad_clip > 0 and math.isfinite(total):
            scale = min(1.0, self.grad_clip / (total + 1e-6))  # as clip_grad_norm_
        job.grad_norm, job.lr = total, self.lr_at(job.version)
        for index, unit in enumerate(self.state.units):
            start = time.perf_counter()
            if index not in self.skip:
                grad = unit.grad_for(job.version)
                if self.compact:
                    self.compact_pass(index, unit, grad, job.lr, scale, "preview" if self.split else "whole")
                    if not self.split:
                        unit.step += 1
                elif self.split:
                    self.kernel_pass(unit, grad, job.lr, scale, write_state=False, write_work=True)
                else:
                    self.update_unit(unit, job.lr, scale, grad)
                if job.record is not None:
                    job.record(index, start - job.t0, time.perf_counter() - job.t0, unit.master.numel() * 4)
            self._publish(index, job.version, settled=not self.split)
        job.done.set()
        if self.split:
            for index, unit in enumerate(self.state.units):
                if index not in self.skip:
                    if self.compact:
                        self.compact_pass(index, unit, unit.grad_for(job.version), job.lr, scale, "commit")
                    else:
                        self.kernel_pass(unit, unit.grad_for(job.version), job.lr, scale, write_state=True,
                                          write_work=False)
                    unit.step += 1
                self._publish(index, job.version, settled=True)

    def _publish(self, index: int, version: int, settled: bool) -> None:
        with self._cond:
            self.version[index] = version
            if settled:
                self.settled[index] = version
            self._cond.notify_all()

    def update_unit(self, unit: Unit, lr: float, scale: float, grad: torch.Tensor | None = None) -> None:
        """A whole update of one unit: masters, moments, step and working copy."""
        grad = unit.grad if grad is None else grad
        if self.compact:
            index = next(i for i, u in enumerate(self.state.units) if u is unit)  # Unit's == compares tensors
            self.compact_pass(index, unit, grad, lr, scale, "whole")
            unit.step += 1
            return
        if self.kernel is not None:
            self.kernel_pass(unit, grad, lr, scale, write_state=True, write_work=True)
            unit.step += 1
            return
        unit.step += 1
        n = unit.layout.numel
        for start in range(0, n, self.chunk):
            end = min(start + self.chunk, n)
            g = grad[start:end]
            if g.dtype != torch.float32:
                g = self._tmp[: end - start].copy_(g)
            if scale != 1.0:
                g.mul_(scale)
            for lo, hi, wd in unit.layout.decay_ranges(self.weight_decay):
                lo, hi = max(lo, start), min(hi, end)
                if lo < hi:
                    torch._fused_adamw_(
                        [unit.master[lo:hi]], [g[lo - start : hi - start]], [unit.exp_avg[lo:hi]],
                        [unit.exp_avg_sq[lo:hi]], [], [unit.step], lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                        weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False,
                    )
            unit.work[start:end].copy_(unit.master[start:end])

    def kernel_pass(self, unit: Unit, grad: torch.Tensor, lr: float, scale: float, write_state: bool,
                     write_work: bool) -> None:
        """One kernel pass with the unit's next step count (the caller bumps ``unit.step``)."""
        step = float(unit.step) + 1
        b1, b2 = self.betas
        step_size = lr / (1 - b1**step)
        bc2_sqrt = math.sqrt(1 - b2**step)
        for lo, hi, wd in unit.layout.decay_ranges(self.weight_decay):
            hyper = (scale, 1 - lr * wd, 1 - b1, b2, 1 - b2, self.eps, step_size, bc2_sqrt)
            self.kernel.adamw(unit.master[lo:hi], unit.exp_avg[lo:hi], unit.exp_avg_sq[lo:hi], grad[lo:hi],
                              unit.work[lo:hi], hyper, write_state=write_state, write_work=write_work)

    def compact_pass(self, index: int, unit: Unit, grad: torch.Tensor, lr: float, scale: float, kind: str) -> None:
        """One pass over a compact-state unit (state_format.py): ``whole``, or the split's ``preview``
        (the working copy, and a bf16 master, which is it or makes it) or ``commit`` (the moments, and
        an fp32 master)."""
        step = float(unit.step) + 1
        b1, b2 = self.betas
        step_size = lr / (1 - b1**step)
        bc2_sqrt = math.sqrt(1 - b2**step)
        bf16 = self.state.format.bf16_master
        write_master = kind == "whole" or (kind == "preview") == bf16
        write_moments = kind != "preview"
        write_work = kind != "commit" and unit.work is not unit.master
        work = None if unit.work is unit.master else unit.work
        seed = step_seed(self.seed, index, int(step))
        ranges = unit.layout.decay_ranges(self.weight_decay)
        for (lo, hi, wd), block in zip(ranges, block_offsets(ranges)):
            hyper = (scale, 1 - lr * wd, 1 - b1, b2, 1 - b2, self.eps, step_size, bc2_sqrt)
            args = self._range_args(unit, lo, hi, block, work)
            if self.kernel is not None:
                self.kernel.adamw_compact(*args[:6], grad[lo:hi], args[6], hyper, seed, lo, write_master,
                                          write_moments, write_work)
            else:
                adamw_reference(*args[:6], grad[lo:hi], args[6], hyper, seed, lo, write_master, write_moments,
                                write_work)

    @staticmethod
    def _range_args(unit: Unit, lo: int, hi: int, block: int, work: torch.Tensor | None) -> tuple:
        blocks = -(-(hi - lo) // BLOCK)
        absmax = [None if t is None else t[block: block + blocks]
                  for t in (unit.exp_avg_absmax, unit.exp_avg_sq_absmax)]
        return (unit.master[lo:hi], None if unit.comp is None else unit.comp[lo:hi], unit.exp_avg[lo:hi],
                unit.exp_avg_sq[lo:hi], absmax[0], absmax[1], None if work is None else work[lo:hi])
