"""Where the router places a request that names a LoRA adapter (tests/fakebus.py, workers played by
the test): only on workers with adapter slots and a rank limit that holds it, preferring the one with
the adapter in a slot unless its load costs more; its spec carries the adapter, its prefix hashes the
adapter's chain; unknown names and fleets that cannot serve it are one-line refusals."""

from __future__ import annotations

import time

import pytest
from fakebus import FakeBus, bus_settings, serving
from test_router_placement import PROMPT, FakeWorker, decisions, generate, place

from tandem.services.router.service import Router
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import AdapterRecord, adapter_hash_root
from tandem.shared.protocol.base import ErrorCode, ErrorReply
from tandem.shared.protocol.block_hashes import prefix_hashes
from tandem.shared.protocol.codec import encode
from tandem.shared.protocol.kv import KVEvent
from tandem.shared.protocol.serving import DecodeRequest, GenerateAccepted

NS, BS = "tiny/float32/test-layout/bs16", 16


@pytest.fixture
async def router(tmp_path):
    bus = FakeBus()
    async with serving(Router(bus_settings(tmp_path, instance_id="router-a")), bus) as service:
        service.adapters.registry.apply(AdapterRecord(name="sql", version="v1", path="/adapters/sql",
                                                      base_model=service.meta.name, rank=16, targets=["q_proj"],
                                                      published_at=time.time()))
        yield bus, service
    assert not bus.errors, f"handlers on the bus failed: {bus.errors}"


async def decoders(bus: FakeBus, model: str, *specs: tuple[str, int, int, list[str]]) -> dict[str, FakeWorker]:
    """``(instance id, running, max_loras, resident adapters)`` each, rank limit 16."""
    out = {}
    for instance_id, running, slots, resident in specs:
        worker = FakeWorker(bus, "decode", instance_id, model, running)
        worker.beat_msg = worker.beat_msg.model_copy(update={"max_loras": slots, "max_lora_rank": 16 if slots else 0,
                                                             "adapters_resident": resident})
        await worker.answer()
        await worker.beat()
        out[instance_id] = worker
    return out


@pytest.mark.parametrize("busy, winner", [(0, "decode-warm"), (12, "decode-cold")],
                         ids=["resident-wins", "load-outweighs-residency"])
async def test_the_worker_holding_the_adapter_wins_unless_busier(router, busy: int, winner: str) -> None:
    bus, service = router
    fleet = await decoders(bus, service.meta.name, ("decode-none", 0, 0, []), ("decode-cold", 0, 2, []),
                           ("decode-warm", busy, 2, ["sql@v1"]))
    reply = await place(bus, generate(model="sql"))
    assert isinstance(reply, GenerateAccepted), reply
    assert reply.decode_worker == winner, decisions(bus)[-1].candidates
    (work,) = fleet[winner].work
    assert isinstance(work, DecodeRequest) and work.spec.adapter is not None
    assert (work.spec.adapter.name, work.spec.adapter.version, work.spec.adapter.path) == ("sql", "v1", "/adapters/sql")
    ids = {c.instance_id for c in decisions(bus)[-1].candidates}
    assert "decode-none" not in ids, "a worker without adapter slots was a candidate"


async def test_the_prefix_index_counts_the_adapters_own_blocks(router) -> None:
    """Blocks a worker cached for the base model are no prefix of the adapter's prompt: only those
    under the adapter's chain root count."""
    bus, service = router
    await decoders(bus, service.meta.name, ("decode-a", 0, 2, []), ("decode-b", 0, 2, []))
    root = adapter_hash_root(service.adapters.registry.lookup("sql").ref())
    base_blocks, adapter_blocks = prefix_hashes(PROMPT, BS)[:4], prefix_hashes(PROMPT, BS, root)[:2]
    for source, hashes in (("decode-a", base_blocks), ("decode-b", adapter_blocks)):
        event = KVEvent(source=source, service="decode", namespace=NS, seq=0, stored=hashes)
        await bus.publish(subjects.kv_events("decode", source), encode(event))
    reply = await place(bus, generate(model="sql"))
    assert isinstance(reply, GenerateAccepted) and reply.decode_worker == "decode-b", reply
    cached = {c.instance_id: c.cached_blocks for c in decisions(bus)[-1].candidates}
    assert cached == {"decode-a": 0, "decode-b": 2}, cached


@pytest.mark.parametrize("model, fleet, code, words", [
    ("nope", [("decode-a", 0, 2, [])], ErrorCode.UNKNOWN_MODEL, "'sql'"),
    ("sql", [("decode-a", 0, 0, [])], ErrorCode.NO_WORKERS, "--max-loras"),
], ids=["unknown-name-lists-the-adapters", "no-worker-has-slots"])
async def test_refusals_name_what_to_change(router, model: str, fleet: list, code: ErrorCode, words: str) -> None:
    bus, service = router
    await decoders(bus, service.meta.name, *fleet)
    reply = await place(bus, generate(model=model))
    assert isinstance(reply, ErrorReply) and reply.code is code and words in reply.message, reply
    assert "\n" not in reply.message
