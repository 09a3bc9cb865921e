"""Helpers shared by the end-to-end tests: prompts of exact token lengths, worker heartbeats, a flush
that proves what went before it reached the server."""

from __future__ import annotations

import asyncio

import msgpack
import nats

from tandem.client import connect
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS

# Prompt lengths (byte tokenizer: one token per byte) on and around block (16) and chunk (32) edges.
PARITY_LENGTHS = [1, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 95, 96, 97, 130, 200]
SOURCE = (
    "import os\nimport sys\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
    "        if name.endswith('.py'):\n            print(name, os.path.getsize(name))\n    return 0\n\n"
    "class Tree:\n    def __init__(self, value, children=()):\n        self.value = value\n"
    "        self.children = list(children)\n\n    def walk(self):\n        yield self.value\n"
)


# Sampling parameters out of their bounds, each one msgpack can carry (a raw bus message can hold it):
# the client, the router, the workers and the engine all refuse every one of them.
BAD_SAMPLING: list[tuple[str, object]] = [
    ("top_k", 2**63),  # once passed every check and failed the whole engine step (host_values_to)
    ("top_k", 2**31),
    ("top_k", -2),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2**31),
    ("seed", 2**63),
    ("seed", -1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", -1.0),
    ("temperature", 100.5),
    ("top_p", float("nan")),
    ("top_p", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("stop_token_ids", [2**31]),
    ("stop_token_ids", [2**64 - 1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("stop", [""]),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("logprobs", -1),
    ("logprobs", 21),
]
# Prompt token ids out of [0, 2**31), each one msgpack can carry.
BAD_PROMPT_TOKEN_IDS: list[list[int]] = [[2**31], [2**64 - 1], [-1]]


async def flushed(nc, timeout: float = 10.0) -> None:
    """``nc.flush()`` that returns only once the server has read every command sent before it.
    nats-py (2.16) writes a flush's PING to the socket at once but leaves the SUB and PUB commands
    before it in its pending buffer for its flusher task, so the PING goes out first and its PONG
    can come back before the server has read them (on a loaded machine another connection's request
    then found no subscriber: NoRespondersError). By the first PONG the flusher has written them,
    so the second round trip goes after them."""
    await nc.flush(timeout=timeout)
    await nc.flush(timeout=timeout)


def value_id(value: object) -> str:
    """A short pytest id for a parameter value (long lists by their length)."""
    if isinstance(value, list) and len(value) > 4:
        return f"{len(value)}-ids"
    return repr(value).replace(" ", "")


def prompt_of(length: int, salt: int = 0) -> str:
    text = (SOURCE * 4)[salt : salt + length]
    assert len(text.encode()) == length
    return text


async def worker_beats(url: str, wait_s: float = 0.6, options: dict | None = None) -> dict[str, Heartbeat]:
    """Every worker's latest heartbeat within ``wait_s`` (``options``: nats.connect's, an identity)."""
    beats: dict[str, Heartbeat] = {}
    nc = await nats.connect(url, **(options or {}))

    async def on_beat(msg):
        beat = decode(msg.data, Heartbeat)
        beats[beat.instance_id] = beat

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
    await asyncio.sleep(wait_s)
    await nc.close()
    return beats


async def assert_pools_free(url: str, timeout_s: float = 10.0) -> None:
    """Every worker reports no sequences and every block free (polling: heartbeats lag a step)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        beats = await worker_beats(url)
        busy = {i: (b.running, b.waiting, b.num_blocks - b.free_blocks) for i, b in beats.items()
                if b.running or b.waiting or b.free_blocks != b.num_blocks}
        if beats and not busy:
            return
        assert loop.time() < deadline, f"workers still hold sequences or blocks (running, waiting, used): {busy}"


async def kvstore_stats(url: str, store: str) -> dict:
    """A KV-store instance's stats reply, decoded."""
    nc = await nats.connect(url)
    try:
        return msgpack.unpackb((await nc.request(subjects.kvstore_stats(store), b"", timeout=5)).data)
    finally:
        await nc.close()


async def greedy_complete(url: str, prompt: str, max_tokens: int):
    """One greedy completion of exactly ``max_tokens`` tokens through a fresh client."""
    async with connect(url) as client:
        return await client.complete(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def service_metadata(url: str, name: str) -> dict[str, dict[str, str]]:
    """Each running instance of the micro service ``name`` (``tandem-frontend``): its instance id ->
    its ``$SRV.INFO`` metadata (``pid``, a frontend's ``http_url``, ...)."""
    from tandem.client.discovery import service_infos

    nc = await nats.connect(url)
    try:
        infos = await service_infos(nc, name=name)
    finally:
        await nc.close()
    return {i["metadata"]["instance_id"]: i["metadata"] for i in infos}


async def bus_connections(monitor_port: int) -> dict[str, int]:
    """Every client connection the nats-server holds now, by name -> its connection id (a client
    whose connection was reset comes back under a new id) from the server's monitoring ``/connz``."""
    import httpx

    async with httpx.AsyncClient() as http:
        page = (await http.get(f"http://127.0.0.1:{monitor_port}/connz", params={"limit": 4096})).json()
    return {c.get("name", ""): c["cid"] for c in page.get("connections", [])}
