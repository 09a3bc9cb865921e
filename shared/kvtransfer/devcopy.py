"""Host<->device copies that never wait for the work queued on the engine's CUDA stream.

With overlapped decode steps (engine/overlap.py) that stream always holds the next step, so a copy
that synchronizes it stalls the engine for a whole step: ``torch.tensor(..., device=cuda)`` and
``.to(cuda)`` from pageable memory are blocking copies (they wait for the stream), and ``.cpu()``
queues its copy on the stream, where every later step waits behind it. These helpers copy through
pinned memory, the small ones asynchronously on the stream, the large ones on a side stream:

- ``host_values_to``: a short host list (sampling parameters, row and block indices) on a device;
- ``copy_stream``: a side stream of this thread's, ordered after the work already queued (the
  shared-memory ring's copies, ``to_host``);
- ``to_host``: a CPU copy of a CUDA tensor (KV blocks offered to a KV-store or sent as NATS frames).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_streams = threading.local()


def host_values_to(device: torch.device, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``values`` on ``device``, copied from pinned memory without waiting for the device."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


@contextmanager
def copy_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """A side stream of this thread's for device<->host copies, ordered after the work already
    queued on the current stream (which produced the source). Waiting on it alone, rather than on
    the shared current stream, keeps one copy from waiting for work queued after it, such as the
    engine's next steps or another transfer's copies."""
    cache = getattr(_streams, "by_device", None)
    if cache is None:
        cache = _streams.by_device = {}
    stream = cache.get(device)
    if stream is None:
        stream = cache[device] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``: from CUDA, into pinned memory on ``copy_stream``, waiting for that
    copy alone."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with copy_stream(tensor.device) as stream:
        host.copy_(tensor, non_blocking=True)
    stream.synchronize()  # the caller holds ``tensor`` until this returns: no record_stream needed
    return host


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 included)."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()).cast("B")
