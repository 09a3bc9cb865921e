"""KV transfer between two processes on one host: NATS frames against the shared-memory ring.

For each block size, a consumer process (what a decode worker does) and this process (what a
prefill worker does) move ``--total-mib`` of KV blocks, ``--blocks-per-transfer`` blocks per
transfer and ``--concurrency`` transfers in flight, two ways in the same run:

- nats: ``send_kv`` frames under credit flow control (``--kv-window`` frames in flight) with a crc32
  per block computed on both ends as the bytes move, over ``--kv-connections`` bulk connections per
  process (:mod:`tandem.shared.kvtransfer.bulklinks`; 0: over nats-py, as a service without them) with
  ``--kv-check-threads`` checking landed blocks beside their readers, then an
  admit message whose checksums ``KVReceiver.take`` verifies (as services/prefill ``hand_off`` and
  decode ``on_admit`` do);
- ring: ``ShmRing.try_write`` into the consumer's ring, a small descriptor message, the consumer
  ``read``s (and releases) the slots and acks (``--ring-checksum`` adds crc32 on both ends); the
  consumer reads from tasks, ``--consumer-copies`` at once.

It prints MB/s for each (median of ``--repeat`` runs) and the ratio. ``--device cuda`` moves GPU
memory in the producer to GPU memory in the consumer (the ring pinned with cudaHostRegister), on one
GPU or, with ``--producer-gpu 1 --consumer-gpu 0``, between two (as ``tandem up`` places prefill
and decode workers on a two-GPU machine)::

    python benchmarks/kv_transfer.py                       # CPU: 64 KiB and 2 MiB blocks
    python benchmarks/kv_transfer.py --block-kib 2048 --total-mib 512 --repeat 3 --kv-connections 0 4 8
    python benchmarks/kv_transfer.py --device cuda --total-mib 4096 --block-kib 2048 --blocks-per-transfer 32
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import subprocess
import sys
import time
import uuid
import zlib

import msgpack
import nats
import numpy as np
import torch

from tandem.shared.infra.config import BusSettings
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.kvtransfer.bulklinks import BulkLinks
from tandem.shared.kvtransfer.frames import KVReceiver, block_checksums, send_kv
from tandem.shared.kvtransfer.ring import ShmRing, SlotDescriptor, host_id
from tandem.shared.protocol.kv import KVTransfer

MiB = 1 << 20


def route(args: argparse.Namespace) -> str:
    return f"cuda:{args.producer_gpu} -> cuda:{args.consumer_gpu}" if args.device == "cuda" else "cpu"


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.cpu().numpy())


async def open_links(args: argparse.Namespace, url: str, name: str) -> BulkLinks | None:
    if not args.kv_connections:
        return None
    links = await BulkLinks(lambda: url, name=name, size=args.kv_connections,
                            check_threads=args.kv_check_threads).start()
    assert links.open_connections == args.kv_connections, "bulk connections did not open"
    return links


async def consumer(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats_url, pending_size=256 * MiB)
    block = args.block_kib * 1024
    slots = max(args.ring_mib * MiB // block, args.concurrency * args.blocks_per_transfer)
    ring = ShmRing.create("bench", block, slots, pin=args.device == "cuda")
    receiver = KVReceiver(max_bytes_in_flight=1 << 40)
    links = await open_links(args, args.nats_url, "bench-consumer")
    dev = torch.device("cuda", args.consumer_gpu) if args.device == "cuda" else torch.device("cpu")
    # Where the decode worker wants its KV: blocks of its preallocated pool, one transfer's worth
    # per copy that may run at once.
    per = block * args.blocks_per_transfer
    pool = torch.empty(per * args.consumer_copies, dtype=torch.uint8, device=dev)
    free_parts = asyncio.Queue()
    for i in range(args.consumer_copies):
        free_parts.put_nowait(pool[i * per : (i + 1) * per])
    tasks: set[asyncio.Task] = set()

    def land(data: torch.Tensor) -> torch.Tensor:
        if dev.type == "cuda":
            return pool[: data.numel()].copy_(data)
        pool.numpy()[: data.numel()] = data.numpy()  # a memcpy, as the ring's CPU copies are
        return pool[: data.numel()]

    async def on_frame(msg) -> None:  # without bulk connections: frames whole, on the loop
        reply = receiver.answer(msg.data)
        if reply is not None and msg.reply:
            await nc.publish(msg.reply, reply)

    async def on_admit(msg) -> None:
        head = msgpack.unpackb(msg.data)
        blob = receiver.take(KVTransfer(**head["transfer"]))
        kv = land(torch.frombuffer(blob, dtype=torch.uint8))
        await msg.respond(str(crc(kv)).encode() if head["check"] else b"ok")

    def read(head: dict, part: torch.Tensor) -> torch.Tensor:
        desc = SlotDescriptor.from_wire(head["desc"])
        kv = ring.read(desc, out=part[: desc.length])
        if head["sums"] and block_checksums(kv.cpu().numpy(), block) != head["sums"]:
            raise ValueError("checksum mismatch")
        return kv

    async def copy_out(msg) -> None:
        head = msgpack.unpackb(msg.data)
        part = await free_parts.get()
        try:
            # GPU copies wait on DMA: off the loop, so acks flush meanwhile; a CPU memcpy is
            # cheaper than a thread hand-off
            kv = await asyncio.to_thread(read, head, part) if dev.type == "cuda" else read(head, part)
            await msg.respond(str(crc(kv)).encode() if head["check"] else b"ok")
        finally:
            free_parts.put_nowait(part)

    async def on_ring(msg) -> None:
        # As the decode service admits: from a task, so the next descriptor is read while this
        # copy runs (a subscription's callbacks run one at a time).
        task = asyncio.create_task(copy_out(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def on_info(msg) -> None:
        await msg.respond(msgpack.packb({"ring": ring.name, "host_id": host_id()}))

    if links is not None:  # frames land from the bulk connections' reader threads
        await links.serve_kv("bench.kv", receiver)
    for subject, cb in ((("bench.kv", on_frame),) if links is None else ()) + (
            ("bench.admit", on_admit), ("bench.ring", on_ring), ("bench.info", on_info)):
        # Room for every frame in flight (transfers x window x frame size): a receiver that can hold
        # less than that is a slow consumer, and the server cuts it off.
        await nc.subscribe(subject, cb=cb, pending_bytes_limit=2048 * MiB)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    ring.close()
    if links is not None:
        await links.close()
    await nc.close()


async def producer(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    block = args.block_kib * 1024
    per = block * args.blocks_per_transfer
    count = max(1, args.total_mib * MiB // per)
    label = (f"[{args.block_kib} KiB blocks, {args.blocks_per_transfer}/transfer, {count} transfers, {route(args)}, "
             f"{args.kv_connections} bulk connections, {args.kv_check_threads} check threads]")
    proc = subprocess.Popen([sys.executable, __file__, "--role", "consumer", "--nats-url", url, "--device", args.device,
                             "--block-kib", str(args.block_kib), "--blocks-per-transfer", str(args.blocks_per_transfer),
                             "--concurrency", str(args.concurrency), "--ring-mib", str(args.ring_mib),
                             "--consumer-copies", str(args.consumer_copies), "--consumer-gpu", str(args.consumer_gpu),
                             "--kv-connections", str(args.kv_connections),
                             "--kv-check-threads", str(args.kv_check_threads)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", "consumer did not start"
    nc = await nats.connect(url, pending_size=256 * MiB)
    links = await open_links(args, url, "bench-producer")
    info = msgpack.unpackb((await nc.request("bench.info", b"", timeout=10)).data)
    assert info["host_id"] == host_id(), "consumer is on another host"
    ring = ShmRing.attach(info["ring"], pin=args.device == "cuda")
    print(f"{label} consumer pid {proc.pid} ready, ring {ring.name}: {ring.num_slots} x {ring.slot_bytes} B",
          flush=True)
    dev = torch.device("cuda", args.producer_gpu) if args.device == "cuda" else torch.device("cpu")
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 256, count * per, dtype=np.uint8)).to(dev)
    sem, fallbacks = asyncio.Semaphore(args.concurrency), 0

    async def via_nats(part: torch.Tensor, check: bool = False) -> bytes:
        blob = memoryview(part.cpu().numpy())
        tid = uuid.uuid4().hex  # the checksums come back from the send, computed as the frames went out
        sums = await send_kv(nc, "bench.kv", tid, blob, window=args.kv_window, timeout_s=60, block_bytes=block,
                             links=links)
        t = KVTransfer(transfer_id=tid, num_blocks=args.blocks_per_transfer, block_bytes=block, checksums=sums)
        head = {"transfer": t.model_dump(), "check": check}
        return (await nc.request("bench.admit", msgpack.packb(head), timeout=60)).data

    async def via_ring(part: torch.Tensor, check: bool = False) -> bytes:
        nonlocal fallbacks
        desc = await asyncio.to_thread(ring.try_write, part) if part.is_cuda else ring.try_write(part)
        if desc is None:  # ring full: what a service does, send frames instead
            fallbacks += 1
            return await via_nats(part, check)
        sums = block_checksums(part.cpu().numpy(), block) if args.ring_checksum else None
        head = {"desc": desc.to_wire(), "check": check, "sums": sums}
        return (await nc.request("bench.ring", msgpack.packb(head), timeout=60)).data

    async def run(path) -> float:
        async def one(i: int) -> None:
            async with sem:
                await path(src[i * per : (i + 1) * per])
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        return count * per / (time.perf_counter() - start) / 1e6

    results: dict[str, list[float]] = {"nats": [], "ring": []}
    paths = [(name, path) for name, path in (("nats", via_nats), ("ring", via_ring)) if name in args.paths]
    for name, path in paths:  # warm up, and check the bytes land
        assert int(await path(src[:per], True)) == crc(src[:per]), f"{name}: bytes differ"
    for r in range(args.repeat):
        for name, path in paths:
            results[name].append(await run(path))
            print(f"{label} run {r + 1}/{args.repeat} {name}: {results[name][-1]:,.0f} MB/s", flush=True)
    if fallbacks:
        print(f"{label} ring full {fallbacks} times: those transfers went over NATS")
    ring.close()
    if links is not None:
        await links.close()
    await nc.close()
    proc.stdin.close()
    proc.wait(30)
    return results


async def main(args: argparse.Namespace) -> None:
    server = None if args.nats_url else NatsServer.start()
    url = args.nats_url or server.url
    print(f"nats at {url}; {args.total_mib} MiB per run, {args.concurrency} transfers in flight, "
          f"{args.kv_window} frames in flight per transfer", flush=True)
    rows = []
    try:
        for kib in args.block_kib:
            for i, (conns, checks) in enumerate(itertools.product(args.kv_connections, args.kv_check_threads)):
                # The ring does not depend on the bulk connections: measured once per block size.
                paths = [p for p in args.paths if p == "nats" or i == 0]
                res = await producer(argparse.Namespace(**{**vars(args), "block_kib": kib, "kv_connections": conns,
                                                           "kv_check_threads": checks, "paths": paths}), url)
                nats_mbs, ring_mbs = (statistics.median(res[k]) if res[k] else float("nan") for k in ("nats", "ring"))
                rows.append((kib, conns, checks, nats_mbs, ring_mbs if i == 0 else rows[-1][4]))
    finally:
        if server:
            server.stop()
    print(f"\n{'block':>9} | {'nats MB/s':>10} | {'ring MB/s':>10} | {'ring / nats':>11} | bulk connections | "
          f"check threads   ({route(args)}, median of {args.repeat})")
    for kib, conns, checks, n, r in rows:
        print(f"{kib:>5} KiB | {n:>10,.0f} | {r:>10,.0f} | {r / n:>10.1f}x | {conns:>16} | {checks}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["producer", "consumer"], default="producer")
    p.add_argument("--nats-url", default=None, help="use this server instead of an embedded one")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--block-kib", type=int, nargs="+", default=[64, 2048], help="KV block sizes, one run each")
    p.add_argument("--blocks-per-transfer", type=int, default=8)
    p.add_argument("--total-mib", type=int, default=64, help="bytes moved per run")
    p.add_argument("--concurrency", type=int, default=4, help="transfers in flight")
    p.add_argument("--ring-mib", type=int, default=64, help="ring size (raised to hold every transfer in flight)")
    p.add_argument("--consumer-copies", type=int, default=2,
                   help="ring copies the consumer runs at once (the services: TANDEM_KV_RING_COPIES)")
    p.add_argument("--producer-gpu", type=int, default=0, help="--device cuda: the prefill side's GPU")
    p.add_argument("--consumer-gpu", type=int, default=0, help="--device cuda: the decode side's GPU")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--paths", nargs="+", choices=["nats", "ring"], default=["nats", "ring"],
                   help="ring alone for GB-sized GPU runs (NATS moves a few hundred MB/s)")
    p.add_argument("--ring-checksum", action="store_true", help="crc32 per block on the ring path too")
    bus = BusSettings()
    p.add_argument("--kv-connections", type=int, nargs="+", default=[bus.kv_connections],
                   help="bulk NATS connections per process for frames, one run each (0: nats-py's own connection)")
    p.add_argument("--kv-check-threads", type=int, nargs="+", default=[bus.kv_check_threads],
                   help="threads per process that checksum landed blocks, one run each (0: the reading thread)")
    p.add_argument("--kv-window", type=int, default=bus.kv_window, help="frames in flight per transfer")
    a = p.parse_args()
    if a.role == "consumer":
        a.block_kib, a.kv_connections, a.kv_check_threads = a.block_kib[0], a.kv_connections[0], a.kv_check_threads[0]
        asyncio.run(consumer(a))
    else:
        asyncio.run(main(a))
