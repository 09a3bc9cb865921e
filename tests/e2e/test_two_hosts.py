"""Two hosts: a request served across two clustered nats-servers, its KV handed off as NATS frames.

``benchmarks/two_hosts.py`` builds the hosts: two network namespaces linked by a veth pair, each
with its own tmpfs on /dev/shm (so ``host_id()`` differs and no ring can be shared) and its own
nats-server, the two routed to each other across the link. Host A runs the router, the prefill
worker and the client; host B the decode worker, connected to its own server only. A greedy
request is prefilled on A, its KV goes to B as frames through the route (the prefill worker sees
another host id), B streams the tokens back to the client on A; the same requests on one host (the
suite's own server, where the hand-off takes the ring) give the same tokens.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from cli_support import service_env
from support import prompt_of, worker_beats

from tandem.client import connect

pytestmark = pytest.mark.slow


def _load_two_hosts():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "two_hosts.py"
    spec = importlib.util.spec_from_file_location("two_hosts", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


two_hosts = _load_two_hosts()

PROMPTS = [prompt_of(40), prompt_of(300, salt=7), prompt_of(1000, salt=11)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = two_hosts.namespaces_unavailable()
    if reason:
        pytest.skip(f"two hosts: {reason}")
    hosts = two_hosts.TwoHosts.make(tmp_path_factory.mktemp("two-hosts"))
    yield hosts
    hosts.close()  # services, servers, veth and namespaces, also when a test failed
    assert not hosts.leftovers(), f"processes left in the hosts' namespaces: {hosts.leftovers()}"


@pytest.fixture(scope="module")
def split(hosts, data_dir):
    """Router + prefill on A (server A), decode on B (server B), all ready as seen from A."""
    nats_a, nats_b = hosts.start_nats()
    env = service_env(data_dir)
    hosts.serve(hosts.a, "router", "router-a", nats_a.url, [], env)
    hosts.serve(hosts.a, "prefill", "prefill-a", nats_a.url, [], env)
    hosts.serve(hosts.b, "decode", "decode-b", nats_b.url, [], env)
    try:
        hosts.agent(hosts.a, "ready", nats_a.url, {"want": {"router": 1, "prefill": 1, "decode": 1}}, env, 180)
    except BaseException:
        print(hosts.logs())
        raise
    return hosts, nats_a, nats_b, env


@pytest.fixture(scope="module")
def across(split):
    """The requests sent by a client on A, with what the bus said about them, and the bytes the
    veth carried from A to B meanwhile."""
    hosts, nats_a, _, env = split
    _, sent_before = hosts.a.link_bytes("to-b")
    job = {"requests": [{"prompt": p, "max_tokens": NEW_TOKENS} for p in PROMPTS]}
    try:
        answer = hosts.agent(hosts.a, "client", nats_a.url, job, env, 240)
    except BaseException:
        print(hosts.logs())
        raise
    _, sent_after = hosts.a.link_bytes("to-b")
    answer["veth_sent_a_to_b"] = sent_after - sent_before
    return answer


def test_the_hosts_are_apart(split, across):
    hosts, nats_a, nats_b, _ = split
    beats = across["heartbeats"]
    decode = beats["decode-b"]
    assert decode["host_id"] and decode["host_id"] != across["host_id"], "A and B must have different host ids"
    assert (beats["prefill-a"]["host"], decode["host"]) == ("tandem-host-a", "tandem-host-b")
    # B's ring is in B's /dev/shm only: A cannot open it whatever it tried.
    assert decode["kv_ring"] in hosts.b.shm_files() and decode["kv_ring"] not in hosts.a.shm_files()
    assert {r["ip"] for r in nats_a.routes} == {hosts.b.ip} and {r["ip"] for r in nats_b.routes} == {hosts.a.ip}


def test_kv_went_as_nats_frames_across_the_route(across):
    results, decode = across["results"], across["heartbeats"]["decode-b"]
    for result in results:
        assert (result["prefill_worker"], result["decode_worker"]) == ("prefill-a", "decode-b")
        assert len(result["token_ids"]) == NEW_TOKENS and result["finish_reason"] == "length"
        (transfer,) = result["transfers"]
        assert (transfer["path"], transfer["source"], transfer["dest"]) == ("nats", "prefill-a", "decode-b"), transfer
        assert transfer["bytes"] > 0 and transfer["blocks"] > 0
    assert (decode["kv_transfers_nats"], decode["kv_transfers_ring"]) == (len(results), 0)
    # The frames crossed the link: A sent B at least the KV bytes (and the rest of the bus besides).
    kv_bytes = sum(r["transfers"][0]["bytes"] for r in results)
    assert across["veth_sent_a_to_b"] >= kv_bytes, (across["veth_sent_a_to_b"], kv_bytes)


async def test_tokens_match_the_same_requests_on_one_host(across, start_system):
    system = start_system(prefill=1, decode=1)
    async with connect(system.url) as client:
        done = [await client.complete(p, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True) for p in PROMPTS]
    beats = await worker_beats(system.url)
    (decode,) = [b for i, b in beats.items() if i.startswith("decode")]
    assert decode.kv_transfers_ring == len(PROMPTS) and decode.kv_transfers_nats == 0, "one host: the ring"
    for one, two in zip(done, across["results"], strict=True):
        assert one.prompt_token_ids and len(one.prompt_token_ids) == two["prompt_tokens"]
        assert one.token_ids == two["token_ids"], f"{len(one.prompt_token_ids)}-token prompt differs across hosts"
