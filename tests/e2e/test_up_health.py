"""``tandem up`` watches its children's health on the bus, not only their exit codes.

Defect 4 of the trust-boundary trial: a decode worker drained from outside (``DrainRequest(exit=False)``)
left every request failing with ``NoWorkersError`` for as long as it lasted, ``exit=True`` was taken
for a crash, and a child off the bus whose process lived on was never replaced. One ``tandem up``
(its health timeout lowered to 3 s) for the module; the tests run in order and each leaves one
decode worker and one router serving.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import nats
import pytest
from cli_support import TANDEM, operator_options, run_sync, tandem_env, wait_for
from support import prompt_of, worker_beats

from tandem.client import connect
from tandem.client.discovery import service_infos
from tandem.client.runstate import find_running
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.fleet import DrainRequest

# slow: whole tandem ups whose children are made silent or drained, about 15 s on 2 cores; .ci/run runs it
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("health")
    env = {**tandem_env(data_dir), "TANDEM_HEALTH_TIMEOUT_S": "3", "TANDEM_DRAIN_TIMEOUT_S": "5",
           "TANDEM_LOG_LEVEL": "INFO"}
    log = open(data_dir / "up.log", "w")
    proc = subprocess.Popen([*TANDEM, "up", "--kvstore", "0"], env=env, stdout=log, stderr=subprocess.STDOUT)
    state = wait_for(lambda: find_running(data_dir) or proc.poll() is not None, 180, "tandem up to be ready")
    assert proc.poll() is None, (data_dir / "up.log").read_text()[-3000:]
    proc.log = data_dir / "up.log"
    proc.url = state.nats_url
    proc.data_dir = data_dir
    yield proc
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    log.close()


def decode_ids(up) -> set[str]:
    beats = run_sync(worker_beats(up.url, options=operator_options(up.url, up.data_dir)))
    return {i for i, b in beats.items() if b.service == "decode" and not b.draining}


def serves(up) -> bool:
    async def one() -> int:
        async with connect(up.url, request_timeout_s=10, data_dir=str(up.data_dir)) as client:
            return len((await client.complete(prompt_of(20), max_tokens=4, temperature=0.0, ignore_eos=True)).token_ids)

    try:
        return run_sync(one()) == 4
    except Exception:
        return False


def drain(up, instance: str, exit_after: bool) -> None:
    async def ask() -> None:
        nc = await nats.connect(up.url, **operator_options(up.url, up.data_dir))
        try:
            await nc.request(subjects.drain("decode", instance), encode(DrainRequest(exit=exit_after)), timeout=5)
        finally:
            await nc.close()

    run_sync(ask())


@pytest.mark.parametrize("exit_after", [False, True], ids=["stays-idle", "exits"])
def test_an_outside_drain_gets_a_replacement(up, exit_after):
    (old,) = wait_for(lambda: decode_ids(up) if len(decode_ids(up)) == 1 else None, 30, "one decode worker")
    drain(up, old, exit_after)
    new = wait_for(lambda: decode_ids(up) - {old}, 60, "a replacement decode worker")
    assert new, "no replacement"
    assert wait_for(lambda: serves(up), 30, "requests served again")
    # Seen draining in a heartbeat, or (a quick exit) only leaving with code 0: either way no crash.
    said = (f"{old} is draining, not asked by tandem up", f"{old} left on its own")
    log = wait_for(lambda: any(s in up.log.read_text() for s in said) and up.log.read_text(), 20,
                   f"{said} in up's log")
    assert not re.search(rf"{old} \(pid \d+\) exited with code", log), "a drain with exit is no crash"
    operator = operator_options(up.url, up.data_dir)
    wait_for(lambda: old not in run_sync(worker_beats(up.url, options=operator)), 30, "the drained worker gone")


def test_a_child_silent_on_the_bus_is_restarted(up):
    async def router_pids() -> dict[str, int]:
        nc = await nats.connect(up.url, **operator_options(up.url, up.data_dir))
        try:
            infos = await service_infos(nc, name="tandem-router")
        finally:
            await nc.close()
        return {i["metadata"]["instance_id"]: int(i["metadata"]["pid"]) for i in infos}

    (old, pid), = run_sync(router_pids()).items()
    os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing: as a deaf process would
    try:
        wait_for(lambda: "is off the bus" in up.log.read_text(), 30, "the supervisor noticing the silent router")
        new = wait_for(lambda: set(run_sync(router_pids())) - {old}, 60, "a new router")
        assert new
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert wait_for(lambda: serves(up), 30, "requests served again")
