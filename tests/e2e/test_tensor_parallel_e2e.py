"""A decode worker spanning two ranks (``--tensor-parallel-size 2``: rank 1 a follower process,
gloo between them on CPU) behind a one-rank prefill worker: hand-offs arrive in the whole model's
layout and are scattered to the ranks' heads; the tokens match the one-rank reference. Stopping
the worker stops its follower too."""

from __future__ import annotations

import os
import signal

import pytest
from support import prompt_of

from tandem.client import connect
from tandem.shared.model.reference import reference_generate

# slow: a two-rank gloo decode worker of its own (about 14 s on 2 cores); TP's unit tests run by default
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split(start_system):
    return start_system(prefill=1, decode=1, decode_args=["--tensor-parallel-size", "2"])


@pytest.mark.parametrize("length", [1, 17, 48])
async def test_a_two_rank_decode_worker_matches_the_reference(split, tiny, length):
    prompt = prompt_of(length)
    async with connect(split.url) as client:
        result = await client.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    expected, _ = reference_generate(tiny.model, tiny.tokenizer.encode(prompt), 12)
    assert result.token_ids == list(expected), f"a {length}-token prompt diverged on the two-rank decode worker"


def followers_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children that run a follower rank."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                cmdline = cmd.read()
        except OSError:
            continue
        if parent == pid and b"tandem.shared.engine.tp_ranks" in cmdline:
            children.append(int(entry))
    return children


def test_the_follower_rank_leaves_with_its_worker(split):
    name = next(n for n in split.processes if n.startswith("decode"))
    worker = split.processes[name]
    ranks = followers_of(worker.pid)
    assert len(ranks) == 1, f"a two-rank worker should run one follower process, found {ranks}"
    log = (split.logdir / f"{name}.log").read_text()
    assert "tensor parallel: rank 0 of 2" in log, "the worker did not say it leads two ranks"
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0, "the worker did not drain and stop cleanly"
    for pid in ranks:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
            f"follower {pid} outlived its worker"
