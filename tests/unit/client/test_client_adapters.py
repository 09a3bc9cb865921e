"""``Client.load_adapter`` / ``unload_adapter`` / ``adapters`` against a real router (in this process)
on the session's nats-server, serving a small Llama 3 checkpoint with PEFT adapters made by ``peft``:
a load returns the published record and the registry lists it at once; loading the same files again
changes nothing; a refusal is the router's typed error naming its field; an unload removes it; with
no router a load fails at once; and a client key, which the bus's roles refuse, hears so at once
rather than after its timeout.

Run: ``python3 -m pytest -q tests/unit/client/test_client_adapters.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import nats
import pytest
from fakebus import bus_settings, serving
from lora_support import ALL_TARGETS, make_peft_adapter
from model_support import make_hf_checkpoint

from tandem.client import Client, InvalidRequestError, NoWorkersError, UnknownModelError
from tandem.services.router.service import Router
from tandem.shared.auth.credentials import connect_options
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol.adapters import AdapterRecord

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A Llama 3 checkpoint and two PEFT adapters of it (rank 8 everywhere, rank 4 on attention)."""
    root = tmp_path_factory.mktemp("client-adapters")
    hf_model = make_hf_checkpoint("llama3", root / "base")
    adapters = {"all-r8": make_peft_adapter(hf_model, root / "all-r8", 8, ALL_TARGETS, seed=1),
                "attn-r4": make_peft_adapter(hf_model, root / "attn-r4", 4, ["q_proj", "v_proj"], seed=2)}
    return root / "base", adapters


def unique(name: str) -> str:
    """Adapter names of this run: the registry stream outlives a test on the session's server."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def client(nats_server):
    nc = await nats.connect(nats_server.url)
    client = Client(nc, request_timeout_s=10.0)
    yield client
    await client.close()


@pytest.fixture
async def router(nats_server, checkpoint, tmp_path, client):
    """A router serving the checkpoint, once it answers on ``tandem.v1.router.adapters`` (its
    endpoints are served after ``setup``, which is when ``serving`` yields)."""
    base, _ = checkpoint
    settings = bus_settings(tmp_path, nats_url=nats_server.url, model=str(base), instance_id=unique("router-adapters"))
    nc = await nats.connect(nats_server.url)
    async with serving(Router(settings), nc) as service:
        deadline = time.monotonic() + 10
        while True:
            try:
                await client.unload_adapter(unique("probe"))
            except UnknownModelError:  # the router's answer: it serves
                break
            except NoWorkersError:
                assert time.monotonic() < deadline, "the router never answered on its adapters endpoint"
                await asyncio.sleep(0.05)
        yield service


async def test_load_list_and_unload(client, router, checkpoint) -> None:
    _, paths = checkpoint
    name = unique("sql")
    record = await client.load_adapter(name, paths["all-r8"])
    assert isinstance(record, AdapterRecord) and not record.removed
    assert (record.name, record.path, record.rank, record.base_model) == (name, str(paths["all-r8"]), 8,
                                                                          router.meta.name)
    assert record.version and record.source == "api"
    listed = {r.name: r for r in await client.adapters()}
    assert listed[name] == record, "the registry lists it at once"
    assert name in {r.name for r in await client.adapters(router.meta.name)}
    assert name not in {r.name for r in await client.adapters("another-model")}

    assert await client.load_adapter(name, paths["all-r8"]) == record, "the same files again: nothing new"
    newer = await client.load_adapter(name, paths["attn-r4"], version="v2")
    assert (newer.version, newer.rank) == ("v2", 4)
    assert {r.name: r for r in await client.adapters()}[name] == newer

    removed = await client.unload_adapter(name)
    assert removed.removed and removed.version == "v2"
    assert name not in {r.name for r in await client.adapters()}
    with pytest.raises(UnknownModelError, match=f"no adapter '{name}' is served") as caught:
        await client.unload_adapter(name)
    assert caught.value.param == "lora_name"


async def test_refusals_are_typed_and_name_their_field(client, router, checkpoint, tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="base model's name") as caught:
        await client.load_adapter(router.meta.name, checkpoint[1]["all-r8"])
    assert caught.value.param == "lora_name"
    with pytest.raises(InvalidRequestError) as caught:
        await client.load_adapter(unique("missing"), tmp_path / "nowhere")
    assert caught.value.param == "lora_path" and "\n" not in str(caught.value)
    with pytest.raises(InvalidRequestError, match="name") as caught:  # checked here, before anything is sent
        await client.load_adapter("has a space", checkpoint[1]["all-r8"])
    assert caught.value.param == "name"


async def test_without_a_router_a_load_fails_at_once(client, checkpoint) -> None:
    started = time.monotonic()
    with pytest.raises(NoWorkersError, match="no router is running"):
        await client.load_adapter(unique("sql"), checkpoint[1]["all-r8"])
    assert time.monotonic() - started < 2


async def test_a_client_key_is_refused_at_once(tmp_path) -> None:
    ring = Keyring.generate()
    server = NatsServer.start(workdir=tmp_path / "server", auth_config=ring.server_config())
    try:
        nc = await nats.connect(server.url, **connect_options(ring.role_key("client"), "c"))
        client = Client(nc, request_timeout_s=30.0)
        try:
            started = time.monotonic()
            with pytest.raises(InvalidRequestError, match="may not .*operator's credentials"):
                await client.load_adapter("sql", "/adapters/sql")
            with pytest.raises(InvalidRequestError, match="read the adapter registry"):
                await client.adapters()
            assert time.monotonic() - started < 3, "refusals heard only after a timeout"
        finally:
            await client.close()
    finally:
        server.stop()
