"""Conditional disaggregation by device (services/router/policy.py): a prompt goes to a prefill worker
only when the uncached part is long enough and the prefill worker computes on another device than
the decode worker; the rule alone, then the router applying it to heartbeats on an in-process bus.

Run: ``python3 -m pytest -q tests/unit/router/test_policy_devices.py``.
"""

from __future__ import annotations

import pytest
from fakebus import FakeBus, bus_settings, serving, take_work

from tandem.services.router.policy import remote_prefill_workers, shares_device
from tandem.services.router.service import Router
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import Heartbeat, RoutingDecision
from tandem.shared.protocol.serving import (
    DecodeRequest,
    GenerateAccepted,
    GenerateRequest,
    PrefillRequest,
    SamplingParams,
)

BS = 16
PROMPT = [(5 * i + 1) % 250 for i in range(4 * BS)]
A, B = "GPU-aaaaaaaa-0000", "GPU-bbbbbbbb-1111"


@pytest.mark.parametrize(("a", "b", "shared"), [(A, A, True), (A, B, False), ("", "", False), (A, "", False)],
                         ids=["same-gpu", "two-gpus", "both-unknown", "one-unknown"])
def test_only_equal_known_devices_are_shared(a: str, b: str, shared: bool) -> None:
    assert shares_device(a, b) is shared and shares_device(b, a) is shared


@pytest.mark.parametrize(("uncached", "local_max", "prefill", "on_shared", "remote", "why"), [
    (64, 0, [("p1", A)], False, [], "shares the decode worker's device (GPU-aaaaaaaa-0000)"),
    (64, 0, [("p1", A)], True, ["p1"], ""),
    (64, 0, [("p1", A), ("p2", B)], False, ["p2"], ""),
    (64, 0, [("p2", B), ("p1", A), ("p3", "")], False, ["p2", "p3"], ""),
    (64, 64, [("p2", B)], False, [], "64 uncached tokens (at most --local-prefill-max-tokens 64)"),
    (65, 64, [("p2", B)], False, ["p2"], ""),
    (64, 0, [], False, [], "no prefill worker is alive"),
], ids=["shared-only", "shared-as-asked", "the-other-gpu", "order-kept-unknown-taken", "short", "one-past-short",
        "none"])
def test_remote_prefill_only_where_it_pays(uncached, local_max, prefill, on_shared, remote, why) -> None:
    got, reason = remote_prefill_workers(uncached, local_max, A, prefill, on_shared)
    assert got == remote, reason
    assert (why in reason) if why else reason == "", reason
    if not remote:
        assert reason.endswith("decode prefills locally") or "decode prefills locally," in reason, reason


def beat(service: str, instance_id: str, model: str, device: str) -> Heartbeat:
    return Heartbeat(service=service, instance_id=instance_id, host="test", pid=1, model=model, free_blocks=100,
                     num_blocks=100, block_size=BS, max_model_len=2048, kv_namespace="tiny/test/bs16", device=device)


@pytest.mark.parametrize(("prefill_device", "on_shared", "remote"), [
    (A, False, False), (B, False, True), (A, True, True), ("", False, True),
], ids=["same-gpu-local", "other-gpu-remote", "same-gpu-as-asked", "unknown-device-remote"])
async def test_the_router_places_by_the_heartbeats_devices(tmp_path, prefill_device: str, on_shared: bool,
                                                           remote: bool) -> None:
    bus = FakeBus()
    settings = bus_settings(tmp_path, instance_id="router-d", router_prefill_on_shared_device=on_shared)
    async with serving(Router(settings), bus) as router:
        work: dict[str, list] = {"prefill": [], "decode": []}
        await take_work(bus, subjects.prefill("prefill-p"), PrefillRequest, work["prefill"])
        await take_work(bus, subjects.decode_admit("decode-d"), DecodeRequest, work["decode"])
        for service, instance_id, device in (("decode", "decode-d", A), ("prefill", "prefill-p", prefill_device)):
            message = encode(beat(service, instance_id, router.meta.name, device))
            await bus.publish(subjects.heartbeat(service, instance_id), message)
        await bus.settle()
        request = GenerateRequest(request_id="r1", prompt_token_ids=PROMPT, stream_subject="_INBOX.tandem.client.r1",
                                  params=SamplingParams(max_tokens=4, temperature=0.0))
        reply = decode((await bus.request(subjects.router_generate("tandem"), encode(request), timeout=10)).data)
        assert isinstance(reply, GenerateAccepted), reply
        assert reply.prefill_worker == ("prefill-p" if remote else None)
        assert (len(work["prefill"]), len(work["decode"])) == ((1, 0) if remote else (0, 1)), work
        (decision,) = [decode(m.data, RoutingDecision) for m in bus.messages_on(subjects.ROUTER_DECISIONS)]
        if remote:
            assert decision.reason.startswith("prefill remote"), decision.reason
            assert ("as asked" in decision.reason) is (prefill_device == A), decision.reason
        else:
            assert f"shares the decode worker's device ({A})" in decision.reason, decision.reason
    assert not bus.errors, bus.errors
