"""Chaos: kill -9 of a worker with 16 streams in flight, on real processes. Every stream completes,
token-exact against an undisturbed run of the same requests on the same system (greedy, seeded
sampling, penalties, min_tokens, a stop string), the killed worker's requests migrated by their
clients (see tandem/client/migration.py). Each test prints streams token-exact / total and the time
from the kill to the migrated streams' next token (p50, max). And a request outlives the restart
of the only decode worker (as ``tandem up`` restarts a crashed one), and the kill of the router
holding queued requests (streams placed before go on; the queued ones are placed again once a
router is back). tests/e2e/test_nats_restart.py does the same for the nats-server. The disturbed runs' clients
wait up to 120 s for output: on a slow machine the surviving prefill worker takes a while over the
migrated prompts queued behind its own.

Run: ``python3 -m pytest -q -m slow tests/e2e/test_migration.py -s``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from chaos_support import Record, consume, mixed_workload, report, until

from tandem.client import connect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STREAMS = 16


async def undisturbed(url: str, workload: list[dict]) -> list[Record]:
    records = [Record() for _ in workload]
    async with connect(url) as client:
        await asyncio.gather(*(consume(client, request, record) for request, record in zip(workload, records)))
    assert all(r.error is None for r in records), [r.error for r in records if r.error]
    return records


@pytest.fixture
def two_decode_workers(start_system):
    system = start_system(prefill=1, decode=2)
    yield system
    system.stop_all()  # the next test's system must not share the bus with this one


async def test_kill_of_a_decode_worker_mid_stream_migrates_its_streams_token_exact(two_decode_workers):
    system = two_decode_workers
    workload = mixed_workload(STREAMS, max_tokens=320)
    expected = await undisturbed(system.url, workload)
    records = [Record() for _ in workload]
    async with connect(system.url, request_timeout_s=120) as client:
        tasks = [asyncio.create_task(consume(client, request, record)) for request, record in zip(workload, records)]
        # Every stream well under way (or over): then kill the decode worker holding the most.
        await until(lambda: all(len(r.token_ids) >= 16 or r.finish_reason or r.error for r in records), 120,
                    "every stream to be under way")
        holders = Counter(r.stream.accepted.decode_worker for r in records if not r.finish_reason)
        victim, held = holders.most_common(1)[0]
        killed_at = time.monotonic()
        system.processes[victim].kill()
        await asyncio.gather(*tasks)
    figures = report(f"kill -9 of decode worker {victim} ({held} streams on it)", records, expected, killed_at)
    assert figures["failed"] == 0, [r.error for r in records if r.error]
    assert figures["exact"] == STREAMS, [(i, r.token_ids[:8], e.token_ids[:8]) for i, (r, e)
                                         in enumerate(zip(records, expected)) if r.token_ids != e.token_ids]
    assert figures["migrated"] >= 1, "the killed worker held streams: they must have migrated"


@pytest.fixture(params=["another prefill worker", "the decode worker prefilling"])
def prefill_system(request, start_system):
    """Prefill slow enough (16-token chunks) that requests are still prefilling when it dies; after
    the kill the request goes to the other prefill worker, or, none being left, to the decode worker."""
    count = 2 if request.param == "another prefill worker" else 1
    system = start_system(prefill=count, decode=1, prefill_args=["--max-num-batched-tokens", "16"])
    yield system
    system.stop_all()


async def test_kill_of_a_prefill_worker_before_its_hand_offs_migrates_token_exact(prefill_system):
    system = prefill_system
    workload = mixed_workload(STREAMS, max_tokens=48, prompt_len=lambda i: 400 + 37 * i)
    expected = await undisturbed(system.url, workload)
    records = [Record() for _ in workload]
    async with connect(system.url, request_timeout_s=120) as client:
        tasks = [asyncio.create_task(consume(client, request, record)) for request, record in zip(workload, records)]
        await until(lambda: all(r.stream is not None and r.stream.accepted is not None for r in records), 60,
                    "every request to be placed")
        # The prefill worker holding the most requests not yet handed off (fewer than 2 tokens).
        holders = Counter(r.stream.accepted.prefill_worker for r in records if len(r.token_ids) < 2)
        holders.pop(None, None)
        assert holders, "every request was handed off before the kill: prefill is too fast for this test"
        victim, held = holders.most_common(1)[0]
        killed_at = time.monotonic()
        system.processes[victim].kill()
        await asyncio.gather(*tasks)
    figures = report(f"kill -9 of prefill worker {victim} ({held} requests not handed off)", records, expected,
                     killed_at)
    assert figures["failed"] == 0, [r.error for r in records if r.error]
    assert figures["exact"] == STREAMS, [i for i, (r, e) in enumerate(zip(records, expected))
                                         if r.token_ids != e.token_ids]
    assert figures["migrated"] >= 1


@pytest.fixture
def one_decode_worker(start_system):
    system = start_system(prefill=0, decode=1)
    yield system
    system.stop_all()


async def test_a_request_outlives_the_restart_of_the_only_decode_worker(one_decode_worker):
    system = one_decode_worker
    name = system.instance("decode")
    (request,) = mixed_workload(1, max_tokens=400)
    (expected,) = await undisturbed(system.url, [request])
    record = Record()
    async with connect(system.url, request_timeout_s=120) as client:
        task = asyncio.create_task(consume(client, request, record))
        await until(lambda: len(record.token_ids) >= 16, 60, "the stream to be under way")
        killed_at = time.monotonic()
        system.processes[name].kill()
        # The client finds no decode worker while the new one starts, and tries again meanwhile.
        await asyncio.to_thread(system.restart, name)
        await task
    figures = report(f"kill -9 and restart of the only decode worker {name}", [record], [expected], killed_at)
    assert (figures["failed"], figures["exact"], figures["migrated"]) == (0, 1, 1), record.error


@pytest.fixture
def queueing_system(start_system):
    """One decode worker that the router lets hold 12 requests: of 16, four wait in the router's queue."""
    system = start_system(prefill=1, decode=1, router_args=["--router-max-inflight-per-worker", "12"])
    yield system
    system.stop_all()


async def test_kill_of_the_router_holding_queued_requests(queueing_system):
    system = queueing_system
    name = system.instance("router")
    workload = mixed_workload(STREAMS, max_tokens=200)
    expected = await undisturbed(system.url, workload)
    records = [Record() for _ in workload]
    async with connect(system.url, request_timeout_s=120) as client:
        tasks = [asyncio.create_task(consume(client, request, record)) for request, record in zip(workload, records)]
        placed = lambda r: r.stream is not None and r.stream.accepted is not None  # noqa: E731
        await until(lambda: sum(placed(r) for r in records) >= 12 and sum(len(r.token_ids) >= 4 for r in records) >= 8,
                    120, "12 requests placed, 8 under way")
        queued = [i for i, r in enumerate(records) if not placed(r)]
        killed_at = time.monotonic()
        system.processes[name].kill()
        # The queued requests find their router gone (asked every half second) and, no router
        # answering, try again until one is: the restarted one, as tandem up would start it.
        await asyncio.to_thread(system.restart, name)
        await asyncio.gather(*tasks)
    figures = report(f"kill -9 of router {name} ({len(queued)} requests queued in it)", records, expected, killed_at)
    assert figures["failed"] == 0, [r.error for r in records if r.error]
    assert figures["exact"] == STREAMS, [i for i, (r, e) in enumerate(zip(records, expected))
                                         if r.token_ids != e.token_ids]
    assert queued, "no request was queued in the router when it died: the test shows nothing"
    assert all(records[i].migrations >= 1 for i in queued), [records[i].migrations for i in queued]


# A long constrained output: eight records, so a stream is well under way when its worker dies.
RECORDS = {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "pattern": "^[a-z]{3,8}$"}, "ok": {"type": "boolean"}}}}


async def test_kill_of_a_decode_worker_migrates_constrained_streams_valid_and_token_exact(two_decode_workers):
    """A migrated stream's matcher is rebuilt from the tokens already delivered: the output still
    follows its schema and is the undisturbed run's, token for token (Dynamo turns migration off
    for guided decoding; tandem keeps it)."""
    import json

    import jsonschema

    system = two_decode_workers
    spec = {"kind": "json_schema", "spec": json.dumps(RECORDS)}
    workload = [{"prompt": f"records = # {i}\n", "max_tokens": 400, "temperature": 1.0, "seed": 500 + i,
                 "structured_output": spec} for i in range(8)]
    expected = await undisturbed(system.url, workload)
    records = [Record() for _ in workload]
    async with connect(system.url, request_timeout_s=120) as client:
        tasks = [asyncio.create_task(consume(client, request, record)) for request, record in zip(workload, records)]
        await until(lambda: all(len(r.token_ids) >= 16 or r.finish_reason or r.error for r in records), 120,
                    "every stream to be under way")
        holders = Counter(r.stream.accepted.decode_worker for r in records if not r.finish_reason)
        victim, held = holders.most_common(1)[0]
        killed_at = time.monotonic()
        system.processes[victim].kill()
        await asyncio.gather(*tasks)
    figures = report(f"kill -9 of decode worker {victim} ({held} constrained streams on it)", records, expected,
                     killed_at)
    assert figures["failed"] == 0, [r.error for r in records if r.error]
    assert figures["exact"] == len(workload), "a migrated constrained stream differs from the undisturbed run"
    assert figures["migrated"] >= 1, "the killed worker held streams: they must have migrated"
    for record in records:
        assert record.finish_reason == "stop", f"ended {record.finish_reason!r}: {record.text!r}"
        jsonschema.validate(json.loads(record.text), RECORDS)
