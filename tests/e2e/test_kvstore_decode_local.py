"""The KV-store when the decode worker prefills itself (no prefill worker: one GPU's placement):
it offers a finished sequence's blocks to the store, and after a restart (its own cache empty) the
router sends it to fetch the cached prefix from the store before it prefills the rest. The output
is token-identical to computing it fresh and to the reference."""

from __future__ import annotations

import asyncio

import pytest
from support import greedy_complete, kvstore_stats, prompt_of

from tandem.shared.model.reference import reference_generate

PROMPT_TOKENS = 100  # six full blocks and a partial one
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def system(start_system):
    system = start_system(prefill=0, decode=1, kvstore=1)
    yield system
    system.stop_all()



async def test_a_decode_worker_prefilling_alone_takes_the_prefix_from_the_kvstore(system, tiny):
    store = system.instance("kvstore")
    prompt = prompt_of(PROMPT_TOKENS, salt=11)
    fresh = await greedy_complete(system.url, prompt, NEW_TOKENS)
    full_blocks = (PROMPT_TOKENS + NEW_TOKENS - 1) // 16  # the last token's K/V is never computed
    for _ in range(50):  # offered when the sequence ends; its events then reach the router
        stored = await kvstore_stats(system.url, store)
        if stored["ram_blocks"] + stored["disk_blocks"] >= full_blocks:
            break
        await asyncio.sleep(0.1)
    assert stored["ram_blocks"] + stored["disk_blocks"] >= full_blocks, f"blocks not offered: {stored}"
    await asyncio.sleep(0.5)

    system.restart(system.instance("decode"))  # its prefix cache is gone; the store still has the blocks
    await asyncio.sleep(0.5)
    again = await greedy_complete(system.url, prompt, NEW_TOKENS)
    after = await kvstore_stats(system.url, store)
    served = (after["hits_ram"] - stored["hits_ram"]) + (after["hits_disk"] - stored["hits_disk"])
    assert served == (PROMPT_TOKENS - 1) // 16, f"the store served {served} blocks to the decode worker: {after}"

    expected, _ = reference_generate(tiny.model, fresh.prompt_token_ids, NEW_TOKENS)
    assert fresh.token_ids == expected, "computed fresh, the output differs from the reference"
    assert again.token_ids == fresh.token_ids, "with the prefix from the kvstore, the output changed"
