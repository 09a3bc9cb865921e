"""AdamW on the host: fp32, decoupled weight decay, exact global-norm clipping, unit by unit.

The update of step k starts once step k's backward has finished (the global gradient norm needs
every gradient) and walks the units in forward order: extras, layer 0, layer 1, ... After each
unit it refreshes that unit's working copy and bumps the unit's version, so the next step's forward
of layer i waits for layer i's update only (:meth:`HostAdamW.wait`) and the CPU update overlaps the
GPU's forward. The arithmetic is ``torch._fused_adamw_`` (vectorized, multi-threaded), run over
cache-sized chunks so that converting bf16 gradients, clip-scaling them, updating and writing the
bf16 working copy touch each chunk while it is still in cache. Gradients are clip-scaled by
multiplying (as ``clip_grad_norm_`` does) before the update; the AdamW math is torch's own.

    opt = HostAdamW(state, lr_at=lambda step: 3e-4, weight_decay=0.1, grad_clip=1.0)
    opt.start(); opt.submit(UpdateJob(...)); opt.wait(unit_index, version)
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.shared.train.host_state import HostState, Unit

BETAS = (0.9, 0.95)
EPS = 1e-8
CHUNK = int(os.environ.get("TANDEM_ADAM_CHUNK", 1 << 23))  # elements per fused call: 32 MiB per fp32 tensor


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
                 betas: tuple[float, float] = BETAS, eps: float = EPS) -> None:
        self.state = state
        self.lr_at = lr_at
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.betas = betas
        self.eps = eps
        self.version = [int(u.step.item()) for u in state.units]
        self._cond = threading.Condition()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._tmp = torch.empty(CHUNK, dtype=torch.float32)
        self.skip: set[int] = set()  # units another updater (the GPU: device_update.py) takes care of

    # -- the engine's side -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="host-adamw", daemon=True)
        self._thread.start()

    def submit(self, job: UpdateJob) -> None:
        self._jobs.put(job)

    def wait(self, unit: int, version: int) -> None:
        """Block until unit ``unit`` has had ``version`` updates applied."""
        with self._cond:
            while self.version[unit] < version and self._error is None:
                self._cond.wait(1.0)
        if self._error is not None:
            raise RuntimeError("the host optimizer failed") from self._error

    def wait_all(self, version: int) -> None:
        for unit in range(len(self.state.units)):
            self.wait(unit, version)

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
                self.update_unit(unit, job.lr, scale)
            if job.record is not None and index not in self.skip:
                job.record(index, start - job.t0, time.perf_counter() - job.t0, unit.master.numel() * 4)
            with self._cond:
                self.version[index] = job.version
                self._cond.notify_all()
        job.done.set()

    def update_unit(self, unit: Unit, lr: float, scale: float) -> None:
        unit.step += 1
        decay_end, n = unit.layout.decay_end, unit.layout.numel
        for start in range(0, n, CHUNK):
            end = min(start + CHUNK, n)
            grad = unit.grad[start:end]
            if grad.dtype != torch.float32:
                grad = self._tmp[: end - start].copy_(grad)
            if scale != 1.0:
                grad.mul_(scale)
            for lo, hi, wd in ((start, min(end, decay_end), self.weight_decay), (max(start, decay_end), end, 0.0)):
                if lo < hi:
                    torch._fused_adamw_(
                        [unit.master[lo:hi]], [grad[lo - start : hi - start]], [unit.exp_avg[lo:hi]],
                        [unit.exp_avg_sq[lo:hi]], [], [unit.step], lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                        weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False,
                    )
            unit.work[start:end].copy_(unit.master[start:end])
