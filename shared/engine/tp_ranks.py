"""Starting a tensor-parallel worker's follower ranks, and running one.

Rank 0 is the service process. It starts ranks 1.. as ``python -m tandem.shared.engine.tp_ranks``
processes (spawned, not forked: the service runs an event loop and torch threads), then all of them
meet at a TCP rendezvous on 127.0.0.1. Each rank loads the model and keeps its shard, sizes the KV
pool it could hold, and all take the smallest (:meth:`TensorParallelGroup.min_over_ranks`).
A follower ends when rank 0 says stop, and also when rank 0's process is gone (it checks its
parent), so no rank outlives its worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.shared.parallel import commands
from tandem.shared.parallel.group import TensorParallelError, TensorParallelGroup, free_port, join_group

log = logging.getLogger("tandem.parallel")
PARENT_POLL_S = 1.0


@dataclass
class RankJob:
    """What every rank loads: the same model, dtype and engine section as rank 0."""

    model: str
    data_dir: str | None
    dtype: str
    quantization: str
    torch_threads: int
    engine: dict  # the engine settings' fields (EngineSettings), for sizing the KV pool


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank ``r``'s device: ``device``'s GPU index plus ``r`` (CPU: the CPU for every rank)."""
    if device.type != "cuda":
        return [device] * size
    first = device.index if device.index is not None else torch.cuda.current_device()
    available = torch.cuda.device_count()
    if first + size > available:
        raise TensorParallelError(f"--tensor-parallel-size {size} from cuda:{first} needs {first + size} GPUs; "
                                  f"this host has {available}: lower the size or pick an earlier --device")
    return [torch.device("cuda", first + r) for r in range(size)]


@dataclass
class Followers:
    """Ranks 1.. of this worker, as processes."""

    processes: list[subprocess.Popen]
    leaving: bool = False  # rank 0 told them to stop: their exits are expected

    def watch(self, on_death: Callable[[int, int], None]) -> None:
        """Call ``on_death(rank, exit code)`` from a thread when a follower ends on its own."""

        def poll() -> None:
            while True:
                for rank, proc in enumerate(self.processes, start=1):
                    code = proc.poll()
                    if code is not None:
                        if not self.leaving:
                            on_death(rank, code)
                        return
                time.sleep(PARENT_POLL_S)

        threading.Thread(target=poll, name="tensor-parallel watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the followers to leave (rank 0 said stop), then end whichever did not."""
        self.leaving = True
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def dismiss(group: TensorParallelGroup, followers: Followers) -> None:
    """Rank 0's leaving: the followers are told to stop, this rank leaves the group, and the
    followers are waited for (any still there after the timeout are killed)."""
    followers.leaving = True
    group.send_command(("stop",))
    group.close()
    followers.stop()


def lead(job: RankJob, size: int, device: torch.device, shared_memory_commands: bool = True
         ) -> tuple[TensorParallelGroup, Followers]:
    """Rank 0: start ranks 1..``size``-1 and open the group with them. Commands travel through
    shared memory (``commands.py``) where the platform has it, unless ``shared_memory_commands`` is
    off (then over gloo, as a benchmark compares)."""
    devices = rank_devices(device, size)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    payload = json.dumps(dataclasses.asdict(job))
    sender = commands.CommandSender(size - 1) if shared_memory_commands and commands.available() else None
    processes = []
    try:
        for rank in range(1, size):
            argv = [sys.executable, "-m", "tandem.shared.engine.tp_ranks", "--rank", str(rank), "--size", str(size),
                    "--port", str(port), "--device", str(devices[rank]), "--job", payload]
            if sender is not None:
                argv += ["--commands", sender.fds_for(rank - 1).encode()]
            processes.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                              pass_fds=() if sender is None else sender.inheritable()))
        group = join_group(0, size, port, devices[0], sender=sender)
    except BaseException:
        for proc in processes:
            proc.kill()
        if sender is not None:
            sender.close()
        raise
    return group, Followers(processes)


def _exit_with_parent(parent: int) -> None:
    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=poll, name="parent watch", daemon=True).start()


def run_follower(rank: int, size: int, port: int, device: torch.device, job: RankJob,
                 channel: commands.ChannelFds | None = None) -> None:
    """One follower rank, from the rendezvous to rank 0's stop (its commands through ``channel``
    where rank 0 opened one)."""
    from tandem.shared.engine.tp_model_runner import follow
    from tandem.shared.infra.config import EngineSettings
    from tandem.shared.kvcache.cache import size_kv_pool
    from tandem.shared.model.loader import load_model, resolve_dtype
    from tandem.shared.parallel.sharding import sharder

    if job.torch_threads:
        torch.set_num_threads(job.torch_threads)
    receiver = None if channel is None else commands.CommandReceiver(channel)
    group = join_group(rank, size, port, device, receiver=receiver)
    try:
        dtype = resolve_dtype(job.dtype, device)
        loaded = load_model(job.model, device=device, dtype=dtype, data_dir=job.data_dir,
                            quantization=job.quantization, shard=sharder(group))
        engine = EngineSettings(**job.engine)
        group.min_over_ranks(size_kv_pool(engine, loaded.model.config, device, dtype))
        log.info("rank %d of %d ready on %s", rank, size, device)
        follow(loaded.model, group, device, dtype)
    finally:
        group.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one follower rank of a tensor-parallel tandem worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--job", required=True, help="the RankJob as JSON")
    parser.add_argument("--commands", default=None, help="the inherited command channel's descriptors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _exit_with_parent(os.getppid())
    channel = None if args.commands is None else commands.ChannelFds.decode(args.commands)
    run_follower(args.rank, args.size, args.port, torch.device(args.device), RankJob(**json.loads(args.job)), channel)
    # Left cleanly: exit now, before the interpreter's and C++'s static teardown. On a CI machine a
    # follower that had left its group died there with "terminate called without an active exception"
    # (a joinable std::thread destroyed at exit), which turned a clean stop into an abort.
    # An error before this line still exits through Python, with its traceback and code 1.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
