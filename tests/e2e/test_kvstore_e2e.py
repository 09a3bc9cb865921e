"""The KV-store in the serving path: a prefill worker offers its prompts' full blocks to the store;
after the worker restarts (its own cache empty) the router sends it to fetch the cached prefix
from the store, and the output is token-identical to computing it fresh and to the reference.
Parametrized over the store serving from its RAM tier and from its disk tier."""

from __future__ import annotations

import asyncio

import pytest
from support import greedy_complete, kvstore_stats, prompt_of

from tandem.shared.model.reference import reference_generate

PROMPT_TOKENS = 100  # six full blocks and a partial one
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=["ram", pytest.param("disk", marks=pytest.mark.slow)])
def system(request, start_system):
    # A 64 KiB RAM tier holds one tiny-model block: the rest of the prefix is served from disk.
    ram = ["--kvstore-ram-mib", "64"] if request.param == "ram" else ["--kvstore-ram-mib", "0.0625"]
    system = start_system(prefill=1, decode=1, kvstore=1, kvstore_args=ram)
    system.tier = request.param
    yield system
    system.stop_all()



async def test_prefix_from_the_kvstore_matches_fresh_computation(system, tiny):
    store = system.instance("kvstore")
    prompt = prompt_of(PROMPT_TOKENS, salt=7)
    fresh = await greedy_complete(system.url, prompt, NEW_TOKENS)
    await asyncio.sleep(0.6)  # the offered blocks are stored and their events reach the router
    stored = await kvstore_stats(system.url, store)
    assert stored["ram_blocks"] + stored["disk_blocks"] >= PROMPT_TOKENS // 16, f"blocks not offered: {stored}"

    system.restart(system.instance("prefill"))  # its prefix cache is gone; the store still has the blocks
    await asyncio.sleep(0.5)
    again = await greedy_complete(system.url, prompt + "", NEW_TOKENS)
    after = await kvstore_stats(system.url, store)
    served = (after["hits_ram"] - stored["hits_ram"]) + (after["hits_disk"] - stored["hits_disk"])
    assert served == (PROMPT_TOKENS - 1) // 16, f"the store served {served} blocks: {after}"
    if system.tier == "disk":
        assert after["hits_disk"] > stored["hits_disk"], f"no block came from the disk tier: {after}"

    expected, _ = reference_generate(tiny.model, fresh.prompt_token_ids, NEW_TOKENS)
    assert fresh.token_ids == expected, "computed fresh, the output differs from the reference"
    assert again.token_ids == fresh.token_ids, "with the prefix from the kvstore, the output changed"


async def test_finished_sequences_leave_their_blocks_in_the_store(system):
    store = system.instance("kvstore")
    before = await kvstore_stats(system.url, store)
    prompt = prompt_of(40, salt=3)  # two full prompt blocks; 40 generated tokens fill two more
    result = await greedy_complete(system.url, prompt, 40)
    assert len(result.token_ids) == 40
    expected = (40 + 40 - 1) // 16  # the last token's K/V is never computed
    for _ in range(50):  # the prefill worker offers the prompt's blocks, decode the rest when it ends
        after = await kvstore_stats(system.url, store)
        if after["puts"] - before["puts"] >= expected:
            break
        await asyncio.sleep(0.1)
    assert after["puts"] - before["puts"] == expected, f"store puts {before['puts']} -> {after['puts']}"
