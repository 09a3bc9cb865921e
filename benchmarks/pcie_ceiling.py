"""The ceiling of the GPU -> pinned ring -> GPU path: pinned copies alone and both ways at once.

    python benchmarks/pcie_ceiling.py [--chunk-mib 64] [--chunks 24]

A KV hand-off through the ring is a device -> host copy into pinned shared memory (the prefill
process) and a host -> device copy out of it (the decode process), running at the same time for
different transfers. This prints, for every visible GPU, the GB/s of each direction alone and of
both at once (two streams), into a ``ShmRing``'s registered memory and into ``cudaHostAlloc``
memory; with two GPUs also GPU 1 -> host while host -> GPU 0 (prefill and decode on their own
GPUs, as ``tandem up`` places them) and a GPU 1 -> GPU 0 peer copy for scale. Needs CUDA.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tandem.shared.kvtransfer.ring import ShmRing

MiB = 1 << 20


def rate(fn: Callable[[], None], nbytes: int) -> float:
    """GB/s of ``fn`` moving ``nbytes`` (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start) / 1e9


def ring_region(ring: ShmRing, nbytes: int) -> torch.Tensor:
    """``nbytes`` of adjacent slots of ``ring``, held (reserved, committed, claimed) as one tensor."""
    desc = ring.reserve(nbytes)
    ring.commit(desc)
    (region,) = ring.claim(desc)
    return region


def chunked_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, chunk: int) -> None:
    """Queue ``dst.copy_(src)`` on ``stream`` in ``chunk``-byte pieces, as the ring's slots are."""
    with torch.cuda.stream(stream):
        for start in range(0, src.numel(), chunk):
            dst[start : start + chunk].copy_(src[start : start + chunk], non_blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-mib", type=int, default=64, help="bytes per copy (a transfer's worth)")
    parser.add_argument("--chunks", type=int, default=24, help="copies per direction per measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    chunk = args.chunk_mib * MiB
    total = chunk * args.chunks
    ring = ShmRing.create("pcie", 2 * MiB, 2 * total // (2 * MiB), pin=True)
    try:
        hosts = {
            "shm ring": (ring_region(ring, total), ring_region(ring, total)),
            "cudaHostAlloc": (torch.empty(total, dtype=torch.uint8).pin_memory(),
                              torch.empty(total, dtype=torch.uint8).pin_memory()),
        }
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            out_stream, in_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
            for name, (host_out, host_in) in hosts.items():
                def d2h(host_out=host_out, src=src, out_stream=out_stream) -> None:
                    chunked_copy(host_out, src, out_stream, chunk)

                def h2d(dst=dst, host_in=host_in, in_stream=in_stream) -> None:
                    chunked_copy(dst, host_in, in_stream, chunk)

                def both() -> None:
                    d2h()
                    h2d()

                with torch.cuda.device(device):
                    print(f"GPU {index}, {name}: device -> host {rate(d2h, total):.1f} GB/s, host -> device "
                          f"{rate(h2d, total):.1f} GB/s, both at once {rate(both, total):.1f} GB/s each way",
                          flush=True)
        if torch.cuda.device_count() > 1:
            gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
            src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=gpu1)
            dst = torch.empty(total, dtype=torch.uint8, device=gpu0)
            out_stream, in_stream = torch.cuda.Stream(gpu1), torch.cuda.Stream(gpu0)
            host_out, host_in = hosts["shm ring"]

            def across() -> None:
                chunked_copy(host_out, src, out_stream, chunk)
                chunked_copy(dst, host_in, in_stream, chunk)
                out_stream.synchronize()
                in_stream.synchronize()

            def peer() -> None:
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(gpu0)
                torch.cuda.synchronize(gpu1)

            print(f"GPU 1 -> shm ring while shm ring -> GPU 0: {rate(across, total):.1f} GB/s each way", flush=True)
            print(f"GPU 1 -> GPU 0 peer copy: {rate(peer, total):.1f} GB/s", flush=True)
    finally:
        ring.close()


if __name__ == "__main__":
    main()
