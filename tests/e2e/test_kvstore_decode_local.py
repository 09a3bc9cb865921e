"""The KV-store when the decode worker prefills itself (no prefill worker: one GPU's placement):
it offers a finished sequence's blocks to the store, and after a restart (its own cache empty) the
router sends it to fetch the cached prefix from the store before it prefills the rest. The output
is token-identical to computing it fresh and to the reference. A request migrated by that restart
(kill -9 mid-stream) fetches its prompt's prefix too, and computes only the rest of the prompt and
the tokens its client already has."""

from __future__ import annotations

import asyncio
import time

import pytest
from chaos_support import Record, consume, report, until
from support import greedy_complete, kvstore_stats, prompt_of

from tandem.client import connect
from tandem.shared.model.reference import reference_generate

# slow: its own system with a KV-store, about 14 s on 2 cores (the store's prefix path runs by default in
# test_kvstore_e2e.py); .ci/run runs it
pytestmark = pytest.mark.slow

PROMPT_TOKENS = 100  # six full blocks and a partial one
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def system(start_system):
    system = start_system(prefill=0, decode=1, kvstore=1)
    yield system
    system.stop_all()


async def offered(url: str, store: str, blocks: int) -> dict:
    """The store's stats once it holds ``blocks`` blocks (offered when a sequence ends)."""
    for _ in range(50):
        stored = await kvstore_stats(url, store)
        if stored["ram_blocks"] + stored["disk_blocks"] >= blocks:
            await asyncio.sleep(0.5)  # its KV events reach the router
            return stored
        await asyncio.sleep(0.1)
    raise AssertionError(f"blocks not offered: {stored}")


def served_between(before: dict, after: dict) -> int:
    return (after["hits_ram"] - before["hits_ram"]) + (after["hits_disk"] - before["hits_disk"])


async def test_a_decode_worker_prefilling_alone_takes_the_prefix_from_the_kvstore(system, tiny):
    store = system.instance("kvstore")
    prompt = prompt_of(PROMPT_TOKENS, salt=11)
    fresh = await greedy_complete(system.url, prompt, NEW_TOKENS)
    full_blocks = (PROMPT_TOKENS + NEW_TOKENS - 1) // 16  # the last token's K/V is never computed
    stored = await offered(system.url, store, full_blocks)

    system.restart(system.instance("decode"))  # its prefix cache is gone; the store still has the blocks
    await asyncio.sleep(0.5)
    again = await greedy_complete(system.url, prompt, NEW_TOKENS)
    after = await kvstore_stats(system.url, store)
    served = served_between(stored, after)
    assert served == (PROMPT_TOKENS - 1) // 16, f"the store served {served} blocks to the decode worker: {after}"

    expected, _ = reference_generate(tiny.model, fresh.prompt_token_ids, NEW_TOKENS)
    assert fresh.token_ids == expected, "computed fresh, the output differs from the reference"
    assert again.token_ids == fresh.token_ids, "with the prefix from the kvstore, the output changed"


async def test_a_request_migrated_by_a_restart_takes_its_prefix_from_the_kvstore(system):
    store, name = system.instance("kvstore"), system.instance("decode")
    request = {"prompt": prompt_of(PROMPT_TOKENS, salt=23), "max_tokens": 300, "ignore_eos": True,
               "temperature": 0.0}
    expected = Record()
    async with connect(system.url) as client:
        await consume(client, request, expected)
    assert expected.error is None, expected.error
    stored = await offered(system.url, store, (PROMPT_TOKENS + 300 - 1) // 16)

    record = Record()
    async with connect(system.url, request_timeout_s=120) as client:
        task = asyncio.create_task(consume(client, request, record))
        await until(lambda: len(record.token_ids) >= 16, 60, "the stream to be under way")
        killed_at = time.monotonic()
        system.processes[name].kill()  # with the request in hand: its client places it again
        await asyncio.to_thread(system.restart, name)
        await task
    figures = report(f"kill -9 and restart of decode worker {name} with a KV-store", [record], [expected], killed_at)
    assert (figures["failed"], figures["exact"], figures["migrated"]) == (0, 1, 1), (record.error, figures)
    served = served_between(stored, await kvstore_stats(system.url, store))
    assert served == (PROMPT_TOKENS - 1) // 16, (
        f"the migrated request took {served} blocks from the store, not its prompt's {(PROMPT_TOKENS - 1) // 16}")
