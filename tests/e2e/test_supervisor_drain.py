"""Draining workers with requests in hand: nothing is lost, new requests go elsewhere, and the
drained processes exit cleanly. Also a decode worker that a prefill worker still owes a hand-off
waits for it. Real processes, no supervisor (the supervisor test drives drains through the planner)."""

from __future__ import annotations

import asyncio
import subprocess

import nats
import pytest
from support import prompt_of

from tandem.client import connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import Ack
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, RoutingDecision

SOURCE_PROMPT = prompt_of(150)


def long_prompt(i: int) -> str:
    return (SOURCE_PROMPT * 8)[i: i + 1000]


@pytest.fixture(scope="module")
def system(start_system):
    return start_system(prefill=1, decode=2)  # the prefill worker drained, the decode one prefills later ones


@pytest.mark.slow  # 11 s: workers drained to their exit
async def test_drained_workers_finish_what_they_hold_and_exit(system):
    placements: list[RoutingDecision] = []
    nc = await nats.connect(system.url)

    async def on_decision(msg) -> None:
        placements.append(decode(msg.data, RoutingDecision))

    await nc.subscribe(subjects.ROUTER_DECISIONS, cb=on_decision)
    async with connect(system.url) as client:
        first = [asyncio.create_task(client.complete(long_prompt(i), max_tokens=24, temperature=0.0, ignore_eos=True))
                 for i in range(6)]
        while len(placements) < 6:
            await asyncio.sleep(0.01)
        # Drain a prefill worker and a decode worker that both hold some of these requests now.
        prefill_id = placements[0].prefill_worker
        decode_id = placements[0].decode_worker
        for service, iid in (("prefill", prefill_id), ("decode", decode_id)):
            reply = await nc.request(subjects.drain(service, iid), encode(DrainRequest()), timeout=5)
            assert isinstance(decode(reply.data), Ack)
        await asyncio.sleep(0.3)  # the draining heartbeat reached the router
        later = [await client.complete(prompt_of(40, salt=i), max_tokens=4, temperature=0.0, ignore_eos=True)
                 for i in range(4)]
        done = await asyncio.gather(*first)
    await nc.close()
    assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in done), "a drain lost a request"
    assert any(r.prefill_worker == prefill_id for r in done) and any(r.decode_worker == decode_id for r in done)
    assert all(r.prefill_worker != prefill_id and r.decode_worker != decode_id for r in later), \
        "a draining worker got new requests"
    for iid in (prefill_id, decode_id):
        proc = system.processes[iid]
        try:
            code = await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{iid} did not exit after its drain\n{system.logs()}")
        assert code == 0, f"{iid} exited with {code}"
        system.processes.pop(iid)
