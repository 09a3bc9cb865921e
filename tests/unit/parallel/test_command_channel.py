"""The shared-memory command channel between a tensor-parallel worker's ranks, with real follower
processes: every command arrives once, in order, through many laps of the ring, and a slow
follower holds rank 0 back instead of losing a command it has not read."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from tensor_parallel_support import sharded_model

from tandem.shared.parallel import commands

pytestmark = pytest.mark.skipif(not commands.available(), reason="needs memfd and eventfd (Linux)")

FOLLOWER = """
import json, sys, time
from tandem.shared.parallel.commands import ChannelFds, CommandReceiver
receiver = CommandReceiver(ChannelFds.decode(sys.argv[1]))
delay = float(sys.argv[2])
while True:
    command = receiver.receive()
    if command == ("stop",):
        break
    time.sleep(delay)
    print(json.dumps(command), flush=True)
receiver.close()
"""


def start_followers(sender: commands.CommandSender, delays: list[float]) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", FOLLOWER, sender.fds_for(i).encode(), str(delay)],
                             stdout=subprocess.PIPE, text=True, pass_fds=sender.inheritable())
            for i, delay in enumerate(delays)]


def command(i: int) -> tuple:
    return ("step", i, list(range(i % 50)), {"blocks": i * 3})


@pytest.mark.parametrize("delays", [[0.0], [0.0, 0.0, 0.0], [0.0, 0.002]], ids=["one", "three", "one-slow"])
def test_every_command_arrives_once_in_order(delays: list[float]) -> None:
    sender = commands.CommandSender(len(delays))
    followers = start_followers(sender, delays)
    count = 3 * commands.SLOTS + 7  # several laps of the ring
    try:
        started = time.monotonic()
        for i in range(count):
            assert sender.send(command(i)), f"command {i} should fit in a slot"
        sending_s = time.monotonic() - started
        sender.send(("stop",))
        outputs = [proc.communicate(timeout=60)[0] for proc in followers]
    finally:
        for proc in followers:
            proc.kill()
        sender.close()
    expected = [list(command(i)) for i in range(count)]  # as JSON gives them back
    for rank, out in enumerate(outputs, start=1):
        got = [json.loads(line) for line in out.splitlines()]
        assert got == expected, f"follower {rank} got {len(got)} commands, not the {count} sent, in order"
    if max(delays):
        # Rank 0 may run at most a ring ahead of the slow follower: the rest of the sends waited for it.
        least = (count - commands.SLOTS) * max(delays)
        assert sending_s >= 0.8 * least, (f"{count} sends took {sending_s:.2f}s; a follower taking "
                                          f"{max(delays) * 1e3:.0f} ms each should have held them to >= {least:.2f}s")


def test_a_command_larger_than_a_slot_is_refused_by_the_ring() -> None:
    sender = commands.CommandSender(1)
    followers = start_followers(sender, [0.0])
    try:
        assert not sender.send(("import", list(range(commands.SLOT_BYTES)))), "too large for a slot: the caller " \
            "must send it over the control group"
        sender.send(("stop",))
        out = followers[0].communicate(timeout=60)[0]
    finally:
        followers[0].kill()
        sender.close()
    assert out == "null\n", f"the follower should be told the command went elsewhere (None), got {out!r}"


def test_an_oversized_command_goes_over_gloo_and_the_ring_stays_in_step(tmp_path) -> None:
    """Through a real two-rank group: a command past a slot's size takes the control group, and the
    commands after it, through the ring again, still reach the follower in order (the reply to the
    last ping comes back)."""
    with sharded_model("tiny", 2, str(tmp_path)) as loaded:
        group = loaded.model.tensor_parallel
        assert group.sender is not None, "a worker's ranks on one Linux host talk through shared memory"
        group.send_command(("ping", False, list(range(commands.SLOT_BYTES))))
        for _ in range(commands.SLOTS + 1):
            group.send_command(("ping", False))
        group.send_command(("ping", True))
        assert group.min_over_ranks(7) == 0, "the follower's reply to the last ping (it sends 0)"
