"""``tandem up --planner`` under a step load (low, high with long prompts, low): the planner scales
prefill up and back down, the supervisor starts and drains workers accordingly, no request fails,
the decisions are kept in JetStream; a killed worker is restarted and later requests succeed.
``--no-planner`` keeps the counts as given. Also the GPU assignment rules."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import nats
import pytest
from cli_support import TANDEM, operator_options, tandem_env, wait_for

from tandem.cli.gpus import memory_share, pick_gpus
from tandem.client import connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import Heartbeat, ScalingDecision

SOURCE = "def walk(tree):\n    for child in tree.children:\n        yield from walk(child)\n" * 40


def up_env(data_dir) -> dict[str, str]:
    # A free HTTP port: the frontend's default (8000) may be another test's, or anything else's.
    return {**tandem_env(data_dir), "TANDEM_LOG_LEVEL": "INFO", "TANDEM_DEVICE": "cpu", "TANDEM_HTTP_PORT": "0",
            "TANDEM_METRICS_INTERVAL_S": "0.25", "TANDEM_HEARTBEAT_INTERVAL_S": "0.2",
            "TANDEM_WORKER_TIMEOUT_S": "1.5"}


def stop_up(proc: subprocess.Popen) -> int:
    """SIGINT, as Ctrl-C; an ``up`` that does not stop in 60 s is killed (its children die with it),
    so a failing test leaves nothing running, and the failure says so."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("tandem up did not stop within 60 s of SIGINT") from None


def start_up(data_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    log = open(data_dir / "up.log", "w")
    proc = subprocess.Popen([*TANDEM, "up", "--kvstore", "0", *flags], env=up_env(data_dir), stdout=log,
                            stderr=subprocess.STDOUT)
    state = data_dir / "run" / "up.json"
    wait_for(lambda: state.exists() or proc.poll() is not None, 120, "tandem up")
    assert proc.poll() is None, (data_dir / "up.log").read_text()[-3000:]
    import json
    return proc, json.loads(state.read_text())["nats_url"]


class Watch:
    """Heartbeats and scaling decisions as they arrive."""

    def __init__(self) -> None:
        self.beats: dict[str, tuple[float, Heartbeat]] = {}
        self.decisions: list[ScalingDecision] = []

    async def start(self, url: str, data_dir) -> nats.NATS:
        nc = await nats.connect(url, **operator_options(url, data_dir))

        async def on_beat(msg) -> None:
            beat = decode(msg.data, Heartbeat)
            self.beats[beat.instance_id] = (time.monotonic(), beat)

        async def on_decision(msg) -> None:
            self.decisions.append(decode(msg.data, ScalingDecision))

        await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
        await nc.subscribe(subjects.PLANNER_DECISIONS, cb=on_decision)
        return nc

    def live(self, service: str) -> dict[str, Heartbeat]:
        now = time.monotonic()
        return {i: b for i, (seen, b) in self.beats.items()
                if b.service == service and now - seen < 1.0 and not b.draining}

    async def until(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; decisions: " + \
                "; ".join(d.reason for d in self.decisions)
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_planner_scales_prefill_with_a_step_load_and_crashed_workers_come_back(tmp_path):
    proc, url = start_up(tmp_path, "--planner", "--planner-interval-s", "0.5", "--planner-window-s", "2",
                         "--planner-cooldown-s", "2", "--ttft-target-ms", "100", "--min-prefill", "1",
                         "--max-prefill", "2", "--max-decode", "1")
    watch, outcomes = Watch(), []
    nc = await watch.start(url, tmp_path)
    try:
        async with connect(url, request_timeout_s=60, data_dir=str(tmp_path)) as client:
            async def send(prompt: str, tokens: int) -> None:
                try:
                    r = await client.complete(prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
                    outcomes.append(len(r.token_ids) == tokens)
                except Exception as exc:
                    outcomes.append(exc)

            async def low(stop, limit_s: float = 60) -> None:
                i, deadline = 0, time.monotonic() + limit_s
                while not stop() and time.monotonic() < deadline:
                    asyncio.ensure_future(send(SOURCE[i % 50: i % 50 + 24], 4))
                    i += 1
                    await asyncio.sleep(0.4)

            async def high(stop, limit_s: float = 60) -> None:
                deadline = time.monotonic() + limit_s

                async def loop(k: int) -> None:
                    while not stop() and time.monotonic() < deadline:
                        await send(SOURCE[k * 7: k * 7 + 1200], 4)
                await asyncio.gather(*(loop(k) for k in range(4)))

            await watch.until(lambda: watch.live("prefill") and watch.live("decode"), 20, "the workers")
            started = time.monotonic()
            await low(lambda: time.monotonic() - started > 3)
            assert not watch.decisions, f"low load needs no change: {[d.reason for d in watch.decisions]}"

            await high(lambda: len(watch.live("prefill")) >= 2)
            up = next((d for d in watch.decisions if d.prefill_wanted == 2), None)
            assert up is not None, f"no scale-up under the long prompts: {[d.reason for d in watch.decisions]}"
            assert up.reason.startswith("prefill 1->2") and up.inputs["prompt_tokens_rate"] > 0, up.reason
            assert len(watch.live("prefill")) == 2

            await low(lambda: len(watch.live("prefill")) == 1 and watch.decisions[-1].prefill_wanted == 1)
            assert len(watch.live("prefill")) == 1, "prefill did not come back down"
            await asyncio.sleep(1.0)  # requests sent during the drain finish
            down = watch.decisions[-1]
            assert down.reason.startswith("prefill 2->1") and down.prefill_current == 2, down.reason
            assert outcomes and all(o is True for o in outcomes), f"requests failed: {outcomes}"

            js = nc.jetstream()
            kept = (await js.stream_info(subjects.PLANNER_STREAM)).state.messages
            assert kept >= 2, f"expected the up and down decisions in the stream, got {kept}"

            (victim, beat), = watch.live("decode").items()
            os.kill(beat.pid, signal.SIGKILL)
            await watch.until(lambda: set(watch.live("decode")) - {victim}, 60, "a restarted decode worker")
            await asyncio.sleep(0.5)
            after = await asyncio.gather(*(client.complete(SOURCE[i: i + 30], max_tokens=5, temperature=0.0,
                                                           ignore_eos=True) for i in range(3)))
            assert all(len(r.token_ids) == 5 and r.decode_worker != victim for r in after)
    finally:
        await nc.close()
        stop_up(proc)
    log = (tmp_path / "up.log").read_text()
    assert "exited with code -9; restarting" in log and "draining prefill" in log, log[-3000:]


@pytest.mark.slow  # its own tandem up; restarts are also in test_up_health
async def test_without_the_planner_counts_stay_and_crashes_restart(tmp_path):
    proc, url = start_up(tmp_path, "--no-planner")
    watch = Watch()
    nc = await watch.start(url, tmp_path)
    try:
        await watch.until(lambda: watch.live("prefill") and watch.live("decode"), 20, "workers")
        assert "planner" not in {b.service for _, b in watch.beats.values()}
        (victim, beat), = watch.live("prefill").items()
        os.kill(beat.pid, signal.SIGKILL)
        await watch.until(lambda: set(watch.live("prefill")) - {victim}, 60, "a restarted prefill worker")
        assert len(watch.live("prefill")) == 1 and len(watch.live("decode")) == 1 and not watch.decisions
    finally:
        await nc.close()
        assert stop_up(proc) == 0


def test_gpus_decode_on_0_prefill_on_1_then_the_least_used():
    assert pick_gpus(2, [0, 0], "decode", 1) == [0] and pick_gpus(2, [1, 0], "prefill", 1) == [1]
    assert pick_gpus(2, [1, 1], "decode", 1) == [0] and pick_gpus(2, [1, 1], "prefill", 1) == [1]
    assert pick_gpus(4, [1, 1, 0, 0], "decode", 1) == [2] and pick_gpus(4, [1, 1, 0, 0], "prefill", 1) == [2]
    assert pick_gpus(1, [3], "prefill", 1) == [0]
    assert memory_share(0.9, "decode", 2, 1, 1) == 0.9, "alone on its GPU: the whole share"
    assert memory_share(0.9, "prefill", 2, 2, 2) == pytest.approx(0.45)
    assert memory_share(0.8, "decode", 1, 1, 1) == pytest.approx(0.6) and memory_share(0.8, "prefill", 1, 1, 1) == \
        pytest.approx(0.2), "one shared GPU: 3:1"
    assert memory_share(0.8, "prefill", 0, 2, 0) == pytest.approx(0.4)
