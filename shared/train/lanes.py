"""The engine's lanes (compute, host->device, device->host, plus three for device-side optimizer
updates) and its per-op timeline.

On CUDA each lane is its own stream and hand-offs are CUDA events; on CPU every lane is the calling
thread, copies are synchronous and events are no-ops, so the engine's schedule runs unchanged in
CI. :class:`StepTrace` records each op of a step as (lane, layer, phase, start, end, bytes) relative
to the step's start: CUDA events on the op's own stream on GPU, ``perf_counter`` on CPU.
``hidden_fraction`` is the part of the transfer lanes' busy time that the compute lane covers.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator

import torch

from tandem.shared.protocol.training import TimelineOp

LANES = ("compute", "h2d", "d2h", "opt", "xh2d", "xd2h")  # the last three: device-side optimizer updates


def host_buffer(shape: int | tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, page-locked when ``pin`` (for asynchronous copies). Pinned through
    ``cudaHostRegister`` on an ordinary allocation (the caching host allocator behind
    ``pin_memory=True`` rounds every block up to a power of two, wasting up to half of it) and
    unregistered when the tensor is collected, before its memory can be reused."""
    tensor = torch.zeros(shape, dtype=dtype)
    if pin and tensor.numel():
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)) != 0:
            cudart.cudaGetLastError()  # clear the error, or the next CUDA call reports it
            return torch.zeros(shape, dtype=dtype, pin_memory=True)  # the allocator's way, then
        weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr()).atexit = False
    return tensor


class _NullEvent:
    def record(self, stream=None) -> None:  # noqa: ANN001
        pass

    def synchronize(self) -> None:
        pass


class Lanes:
    """Streams and events, or their no-op stand-ins on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.streams = {lane: torch.cuda.Stream(device) for lane in LANES} if self.cuda else {}

    def stream(self, lane: str):  # noqa: ANN201 - torch.cuda.Stream or None
        return self.streams.get(lane)

    @contextlib.contextmanager
    def on(self, lane: str) -> Iterator[None]:
        if self.cuda:
            with torch.cuda.stream(self.streams[lane]):
                yield
        else:
            yield

    def record(self, lane: str, timing: bool = False):  # noqa: ANN201 - torch.cuda.Event or _NullEvent
        """An event marking everything issued on ``lane`` so far."""
        if not self.cuda:
            return _NullEvent()
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self.streams[lane])
        return event

    def wait(self, lane: str, event) -> None:  # noqa: ANN001
        """Make ``lane`` wait (on the device, not the host) for ``event``."""
        if self.cuda and event is not None and not isinstance(event, _NullEvent):
            self.streams[lane].wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, lane: str) -> None:
        """Tell the caching allocator that ``lane`` still uses ``tensor`` (it was made on another)."""
        if self.cuda:
            tensor.record_stream(self.streams[lane])


class StepTrace:
    """Per-op timings of one step. Disabled traces record nothing (recording costs two events an op)."""

    def __init__(self, lanes: Lanes, enabled: bool) -> None:
        self.lanes = lanes
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self._start = lanes.record("compute", timing=True) if enabled and lanes.cuda else None
        self._ops: list[tuple] = []
        self.host_ops: list[TimelineOp] = []

    @contextlib.contextmanager
    def op(self, lane: str, layer: int, phase: str, nbytes: int = 0, stream: str | None = None) -> Iterator[None]:
        """Time the work issued inside the block on ``stream`` (default: the stream of ``lane``);
        it is reported on ``lane``."""
        if not self.enabled:
            yield
            return
        if self.lanes.cuda:
            start = self.lanes.record(stream or lane, timing=True)
            yield
            self._ops.append((lane, layer, phase, start, self.lanes.record(stream or lane, timing=True), nbytes))
        else:
            start = time.perf_counter()
            yield
            self._ops.append((lane, layer, phase, start - self.t0, time.perf_counter() - self.t0, nbytes))

    def add_host_op(self, layer: int, start_s: float, end_s: float, nbytes: int) -> None:
        """An optimizer op, timed on the host by the optimizer thread (relative to ``t0``)."""
        self.host_ops.append(TimelineOp(lane="optimizer", layer=layer, phase="opt", start_s=start_s, end_s=end_s,
                                        bytes=nbytes))

    def device_ops(self) -> list[TimelineOp]:
        """The compute/h2d/d2h ops (waits for their events on CUDA)."""
        ops = []
        for lane, layer, phase, start, end, nbytes in self._ops:
            if self.lanes.cuda:
                end.synchronize()
                start, end = self._start.elapsed_time(start) / 1e3, self._start.elapsed_time(end) / 1e3
            ops.append(TimelineOp(lane=lane, layer=layer, phase=phase, start_s=start, end_s=end, bytes=nbytes))
        return ops


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def hidden_fraction(ops: list[TimelineOp]) -> float:
    """Of the time any host<->device transfer runs, the share during which compute runs too (1.0
    when there are no transfers)."""
    transfers = _union([(o.start_s, o.end_s) for o in ops if o.lane in ("h2d", "d2h")])
    compute = _union([(o.start_s, o.end_s) for o in ops if o.lane == "compute"])
    total = sum(b - a for a, b in transfers)
    if total <= 0:
        return 1.0
    covered, j = 0.0, 0
    for a, b in transfers:
        while j < len(compute) and compute[j][1] <= a:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < b:
            covered += max(0.0, min(b, compute[k][1]) - max(a, compute[k][0]))
            k += 1
    return covered / total
