"""The ranks of one tensor-parallel worker and the two channels between them.

A worker spanning ``size`` devices is ``size`` processes: rank 0 is the service (scheduler, block
manager, sampling), ranks 1.. follow its commands. Two process groups join them:

- the *device* group carries tensors: the all-reduces inside the forward, a step's inputs, KV
  blocks gathered for a hand-off (NCCL between GPUs, gloo on CPU);
- the *control* group (always gloo, host memory) carries the few collectives on host values
  (``min_over_ranks``) and any command too large for the shared-memory channel.

Commands themselves, small pickled tuples, go through shared memory on one host
(``commands.py``): over gloo each one cost about a millisecond.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.shared.parallel.commands import CommandReceiver, CommandSender

# A collective that waits this long means a peer is gone: the ranks stop rather than hang.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class TensorParallelError(RuntimeError):
    """A tensor-parallel layout that cannot work (sizes that do not divide, a missing backend)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now: the rendezvous of a worker's ranks."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class TensorParallelGroup:
    """This process's place among a worker's ranks, with the collectives the engine uses."""

    rank: int
    size: int
    device: torch.device
    device_group: Any = field(default=None, repr=False)  # None: the default group
    control_group: Any = field(default=None, repr=False)
    sender: CommandSender | None = field(default=None, repr=False)  # rank 0's end of the command channel
    receiver: CommandReceiver | None = field(default=None, repr=False)  # a follower's end

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (a row-parallel layer's partial outputs)."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's ``tensor`` (same shape and dtype everywhere)."""
        dist.broadcast(tensor, src=0, group=self.device_group)
        return tensor

    def send_command(self, command: tuple) -> None:
        """Rank 0: hand ``command`` to every other rank (they wait in :meth:`next_command`)."""
        if self.sender is not None and self.sender.send(command):
            return
        dist.broadcast_object_list([command], src=0, group=self.control_group)

    def next_command(self) -> tuple:
        """Ranks 1..: rank 0's next command."""
        if self.receiver is not None:
            command = self.receiver.receive()
            if command is not None:
                return command  # else too large for a slot: it follows over the control group
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV pool all ranks can hold)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(tensor.item())

    def gather_heads(self, local: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's ``local`` joined along ``dim`` in rank order, on rank 0 (None elsewhere)."""
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_first else None
        dist.gather(local.contiguous(), parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim) if self.is_first else None

    def scatter_heads(self, whole: torch.Tensor | None, local_shape: tuple[int, ...], dtype: torch.dtype,
                      dim: int) -> torch.Tensor:
        """Rank 0's ``whole`` split along ``dim`` into equal parts, part ``r`` to rank ``r``."""
        local = torch.empty(local_shape, dtype=dtype, device=self.device)
        parts = None
        if self.is_first:
            parts = [p.to(device=self.device, dtype=dtype).contiguous() for p in whole.chunk(self.size, dim)]
        dist.scatter(local, parts, src=0, group=self.device_group)
        return local

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
        self.sender = self.receiver = None
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(rank: int, size: int, port: int, device: torch.device, host: str = "127.0.0.1",
               sender: CommandSender | None = None, receiver: CommandReceiver | None = None) -> TensorParallelGroup:
    """Join (rank 0: open) the rendezvous at ``host:port`` and return this rank's group; commands go
    through ``sender`` / ``receiver`` where given, else over the control group."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else None
    return TensorParallelGroup(rank, size, device, device_group=None, control_group=control, sender=sender,
                               receiver=receiver)
