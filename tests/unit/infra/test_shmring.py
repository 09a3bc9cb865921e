"""The same-host KV ring (shared/kvtransfer/ring.py) between real processes.

The test process is the consumer (or the sweeper); producers and doomed consumers are separate
Python processes driven line by line over stdin/stdout (JSON), so every byte crosses a process
boundary through /dev/shm. Run: ``python -m pytest -q tests/unit/infra/test_shmring.py`` (GPU cases: ``-m gpu``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.shared.kvtransfer.ring import RingError, RingMissingError, ShmRing, SlotDescriptor, host_id

# A producer (or consumer) driven by JSON lines; replies one JSON line per command.
DRIVER = r"""
import json, sys, time, numpy as np, torch
from tandem.shared.kvtransfer.ring import ShmRing, SlotDescriptor, host_id
ring = None
def data(size, seed):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
def say(**kw):
    print(json.dumps(kw), flush=True)
for line in sys.stdin:
    cmd = json.loads(line); op = cmd["op"]
    try:
        if op == "attach":
            if ring is not None:
                ring.close()
            ring = ShmRing.attach(cmd["name"], pin=cmd.get("pin", False)); say(ok=True)
        elif op == "create":
            ring = ShmRing.create("doomed", 4096, 4, pin=False); say(name=ring.name)
        elif op == "host_id":
            say(host_id=host_id())
        elif op == "write":
            src = data(cmd["size"], cmd["seed"])
            if cmd.get("cuda"):
                src = torch.from_numpy(src).cuda()
            d = ring.try_write(src); say(desc=d and d.to_wire())
        elif op == "loop":  # many transfers, retrying while the ring is full
            for i in range(cmd["count"]):
                seed = cmd["seed"] + i; size = int(data(1, seed)[0]) * 40 + 1
                while (d := ring.try_write(data(size, seed))) is None:
                    time.sleep(0.0005)
                say(desc=d.to_wire(), seed=seed)
        elif op == "stage":  # stop mid-transfer and wait to be killed
            d = ring.reserve(cmd["size"])
            if cmd["stage"] == "holding_lock":
                held = ring._locked()  # kept referenced, so the lock stays held
                held.__enter__()
            if cmd["stage"] in ("half_written", "committed"):
                ring.write(d, data(cmd["size"] // 2, 1))
            if cmd["stage"] == "committed":
                ring.commit(d)
            say(desc=d.to_wire())
        elif op == "abort":
            say(ok=ring.abort(SlotDescriptor.from_wire(cmd["desc"])))
    except Exception as exc:
        say(error=type(exc).__name__, message=str(exc))
"""


def data(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class Driver:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.pid = self.proc.pid

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"driver {self.pid} exited with {self.proc.wait()}"
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.send(**cmd)
        return self.recv()

    def desc(self, **cmd) -> SlotDescriptor | None:
        reply = self.call(**cmd)
        assert "error" not in reply, reply
        return reply["desc"] and SlotDescriptor.from_wire(reply["desc"])

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def segments(pid: int | None = None) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"tandem-kv-{'' if pid is None else f'{pid}-'}*")}


@pytest.fixture(scope="module")
def producer():
    driver = Driver()
    yield driver
    driver.stop()


@pytest.fixture
def make_ring():
    rings = []

    def make(slot_bytes: int = 4096, num_slots: int = 8) -> ShmRing:
        rings.append(ShmRing.create("test", slot_bytes, num_slots, pin=False))
        return rings[-1]

    yield make
    for ring in rings:
        ring.close()


@pytest.mark.parametrize("slot_bytes,sizes", [
    (4096, [1, 4095, 4096, 4097, 3 * 4096 + 5]),
    (65536, [65536, 10 * 65536, 123457]),
    (1 << 20, [(5 << 20) + 3]),
])
def test_transfer_between_processes_is_byte_exact(producer, make_ring, slot_bytes, sizes):
    ring = make_ring(slot_bytes, 16)
    assert producer.call(op="attach", name=ring.name) == {"ok": True}
    for seed, size in enumerate(sizes):
        desc = producer.desc(op="write", size=size, seed=seed)
        assert desc.length == size and len(desc.slots) == -(-size // slot_bytes)
        assert np.array_equal(ring.read(desc).numpy(), data(size, seed))
        assert ring.free_slots() == 16
    # into a caller's tensor of another dtype, too
    desc = producer.desc(op="write", size=4 * 1000, seed=7)
    out = torch.empty(1000, dtype=torch.float32)
    assert ring.read(desc, out=out) is out
    assert np.array_equal(out.view(torch.uint8).numpy(), data(4000, 7))


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_slots_are_reused_after_release(producer, make_ring, num_slots):
    ring = make_ring(1024, num_slots)
    producer.call(op="attach", name=ring.name)
    gens = []
    for seed in range(10):
        desc = producer.desc(op="write", size=1024, seed=seed)
        assert desc.slots == (0,)  # first fit: the released slot is taken again
        gens.append(desc.generation)
        assert np.array_equal(ring.read(desc).numpy(), data(1024, seed))
    assert gens == sorted(set(gens)) and ring.free_slots() == num_slots


def test_full_ring_returns_none_then_recovers(producer, make_ring):
    ring = make_ring(1024, 4)
    producer.call(op="attach", name=ring.name)
    assert producer.desc(op="write", size=5 * 1024, seed=0) is None  # larger than the whole ring
    held = [producer.desc(op="write", size=1024, seed=s) for s in range(4)]
    assert producer.desc(op="write", size=1, seed=9) is None  # full: the caller sends NATS frames
    ring.read(held[0]), ring.read(held[2])  # frees slots 0 and 2, not adjacent
    desc = producer.desc(op="write", size=2048, seed=5)
    assert desc.slots == (0, 2)  # no adjacent pair: scattered slots still work
    assert np.array_equal(ring.read(desc).numpy(), data(2048, 5))
    for d, seed in ((held[1], 1), (held[3], 3)):
        assert np.array_equal(ring.read(d).numpy(), data(1024, seed))
    assert ring.free_slots() == 4


@pytest.mark.parametrize("tamper", ["generation", "replay", "reused", "out_of_range", "other_ring", "length"])
def test_stale_or_forged_descriptor_is_refused(producer, make_ring, tamper):
    ring = make_ring(1024, 2)
    producer.call(op="attach", name=ring.name)
    desc = producer.desc(op="write", size=1000, seed=1)
    bad = {
        "generation": SlotDescriptor(desc.ring, desc.slots, desc.length, desc.generation + 1),
        "out_of_range": SlotDescriptor(desc.ring, (5,), desc.length, desc.generation),
        "other_ring": SlotDescriptor(desc.ring + "x", desc.slots, desc.length, desc.generation),
        "length": SlotDescriptor(desc.ring, desc.slots, 5000, desc.generation),
    }.get(tamper)
    if bad is None:  # replay: read once, then again; reused: the slot now holds a newer transfer
        ring.read(desc)
        if tamper == "reused":
            assert producer.desc(op="write", size=1000, seed=2).slots == desc.slots
        bad = desc
    with pytest.raises(RingError):
        ring.read(bad)
    if tamper != "replay" and tamper != "reused":
        assert np.array_equal(ring.read(desc).numpy(), data(1000, 1))  # the real one still reads


def test_attach_to_missing_ring_fails_cleanly(producer, make_ring):
    ring = make_ring()
    name = ring.name
    ring.close()
    for bad in (name, f"tandem-kv-{os.getpid()}-00000000"):
        assert producer.call(op="attach", name=bad)["error"] == "RingMissingError"
    with pytest.raises(RingError):
        ShmRing.attach("../../etc/passwd")
    with pytest.raises(FileNotFoundError):  # RingMissingError is one, for callers that catch that
        ShmRing.attach(name)
    assert producer.call(op="host_id") == {"host_id": host_id()}  # and the driver still works


@pytest.mark.parametrize("producer_attached", [False, True])
def test_kill9_consumer_then_create_sweeps_its_segment(producer_attached):
    doomed, survivor = Driver(), Driver()
    try:
        name = doomed.call(op="create")["name"]
        survivor_name = survivor.call(op="create")["name"]
        attached = ShmRing.attach(name) if producer_attached else None
        doomed.kill9()
        assert segments(doomed.pid) == {name, name + ".lock"}  # kill -9 leaves it behind...
        if attached:
            assert not attached.consumer_alive()
        with pytest.raises(RingMissingError):
            ShmRing.attach(name)
        with ShmRing.create("next", 4096, 2, pin=False):  # ...until the next consumer starts
            assert segments(doomed.pid) == set()
            assert survivor_name in segments(survivor.pid)  # a live consumer's ring is left alone
        if attached:
            attached.close()
    finally:
        doomed.stop(), survivor.stop()
    assert segments(survivor.pid) == set()  # a normal exit unlinks (atexit)


# slow: a process killed at each stage (about 3 s each); the lock holder's runs by default
@pytest.mark.parametrize("stage", [pytest.param(stage, marks=pytest.mark.slow)
                                   for stage in ("reserved", "half_written", "committed")] + ["holding_lock"])
def test_kill9_producer_mid_transfer_is_reclaimed(make_ring, stage):
    ring = make_ring(1024, 4)
    before = segments(os.getpid())  # only ours: other test runs on this host make rings too
    doomed = Driver()
    doomed.call(op="attach", name=ring.name)
    desc = doomed.desc(op="stage", stage=stage, size=3000)
    assert ring.free_slots() == 1
    doomed.kill9()
    assert segments(os.getpid()) == before and segments(doomed.pid) == set()  # producers own no files
    assert ring.reclaim() == 3 and ring.free_slots() == 4  # the dead pid's reservation comes back
    with pytest.raises(RingError):
        ring.read(desc)
    fresh = Driver()  # and the ring still works, lock included
    try:
        fresh.call(op="attach", name=ring.name)
        desc = fresh.desc(op="write", size=4096, seed=3)
        assert np.array_equal(ring.read(desc).numpy(), data(4096, 3))
    finally:
        fresh.stop()


def test_live_producer_keeps_slots_until_stale_or_aborted(producer, make_ring):
    ring = make_ring(1024, 4)
    producer.call(op="attach", name=ring.name)
    lost = producer.desc(op="write", size=1024, seed=0)
    assert ring.reclaim() == 0 and ring.reclaim(stale_after_s=60) == 0
    assert ring.reclaim(stale_after_s=0) == 1  # a descriptor that never came counts as lost
    sent = producer.desc(op="write", size=1024, seed=1)
    assert producer.call(op="abort", desc=sent.to_wire()) == {"ok": True}
    assert ring.free_slots() == 4
    claimed = producer.desc(op="write", size=1024, seed=2)
    ring.claim(claimed)
    assert producer.call(op="abort", desc=claimed.to_wire()) == {"ok": False}  # being read
    ring.release(claimed)
    with pytest.raises(RingError):
        ring.read(lost)


@pytest.mark.parametrize("num_producers,num_slots", [pytest.param(3, 6, marks=pytest.mark.slow), (2, 3)])
def test_concurrent_producers_never_collide(make_ring, num_producers, num_slots):
    ring = make_ring(4096, num_slots)
    lines: queue.Queue = queue.Queue()
    drivers = [Driver() for _ in range(num_producers)]
    count = 40
    try:
        for i, d in enumerate(drivers):
            d.call(op="attach", name=ring.name)
            d.send(op="loop", count=count, seed=1000 * i)
            threading.Thread(target=lambda d=d: [lines.put(d.recv()) for _ in range(count)], daemon=True).start()
        for _ in range(num_producers * count):
            reply = lines.get(timeout=60)
            desc = SlotDescriptor.from_wire(reply["desc"])
            assert np.array_equal(ring.read(desc).numpy(), data(desc.length, reply["seed"]))
    finally:
        for d in drivers:
            d.stop()
    assert ring.free_slots() == num_slots


@pytest.mark.parametrize("how", ["close", "context", "atexit"])
def test_consumer_exit_unlinks(how):
    if how == "atexit":
        code = "from tandem.shared.kvtransfer.ring import ShmRing; print(ShmRing.create('x', 64, 2, pin=False).name)"
        name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    elif how == "close":
        ring = ShmRing.create("x", 64, 2, pin=False)
        name = ring.name
        ring.close(), ring.close()
    else:
        with ShmRing.create("x", 64, 2, pin=False) as ring:
            name = ring.name
    assert name.startswith("tandem-kv-") and not any(s.startswith(name) for s in segments())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("size", [4096, (3 << 20) + 17], ids=["one_slot", "many_slots"])
def test_gpu_pinned_ring_gpu_to_gpu_is_byte_exact(producer, size):
    with ShmRing.create("gpu", 1 << 20, 8, pin=True) as ring:
        assert ring.pinned and ring._buf.is_pinned()  # registered page-locked with CUDA
        assert producer.call(op="attach", name=ring.name, pin=True) == {"ok": True}
        desc = producer.desc(op="write", size=size, seed=11, cuda=True)
        out = torch.empty(size, dtype=torch.uint8, device="cuda")
        ring.read(desc, out=out)
        torch.cuda.synchronize()
        assert np.array_equal(out.cpu().numpy(), data(size, 11))
