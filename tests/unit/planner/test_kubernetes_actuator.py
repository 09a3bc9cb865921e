"""The Kubernetes actuator against a stand-in API server on a real socket (``tests/fake_kubernetes.py``):
HTTPS with its own CA and a bearer token, connected the in-cluster way (a service-account folder
and ``KUBERNETES_SERVICE_HOST/PORT``), so the official client's configuration, its requests and
their bodies are the real ones. The fake's ReplicaSet controller removes pods in the real one's
order, so "the pods drained are the pods removed" is checked on the outcome, not only on the
annotations sent.

Run: ``python3 -m pytest -q tests/unit/planner/test_kubernetes_actuator.py``.
"""

from __future__ import annotations

import logging
import sys

import pytest

pytest.importorskip("kubernetes", reason="the kubernetes extra: pip install 'tandem[kubernetes]'")

from fake_kubernetes import DELETION_COST, FakeKubernetes  # noqa: E402

from tandem.services.planner.actuator import ActuatorError  # noqa: E402
from tandem.services.planner.kubernetes_actuator import (  # noqa: E402
    INSTALL_HINT,
    LEAVING_COST,
    KubernetesActuator,
    import_client,
    in_pod,
)

TOKEN = "fake-service-account-token"
SCALE = "/apis/apps/v1/namespaces/tandem/deployments/tandem-decode/scale"


@pytest.fixture
def fake(tmp_path):
    """The API server with a prefill Deployment of 1 and a decode Deployment of 3 pods."""
    server = FakeKubernetes(namespace="tandem", token=TOKEN)
    server.add_deployment("tandem-prefill", "prefill", 1)
    server.add_deployment("tandem-decode", "decode", 3)
    server.start(tls_dir=tmp_path / "tls")
    yield server
    server.stop()


def service_account(folder, fake: FakeKubernetes, token: str = TOKEN):
    """The files a kubelet mounts into a pod for its service account."""
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text(token)
    (folder / "ca.crt").write_bytes(fake.ca_file.read_bytes())
    (folder / "namespace").write_text(fake.namespace + "\n")
    return folder


@pytest.fixture
async def actuator(fake, tmp_path):
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(fake.port)}
    act = KubernetesActuator.in_cluster(service_account(tmp_path / "sa", fake), environ=env)
    yield act
    await act.close()


class Drains:
    """A ``drain`` that records what it was asked and what the API server had been sent by then."""

    def __init__(self, fake: FakeKubernetes, leave: bool = True) -> None:
        self.fake, self.leave = fake, leave
        self.asked: list[list[str]] = []
        self.patches_before: list[int] = []

    async def __call__(self, hosts: list[str]) -> list[str]:
        self.asked.append(list(hosts))
        self.patches_before.append(len(self.fake.of("PATCH")))
        return list(hosts) if self.leave else []


async def test_scale_up_patches_the_replicas_and_drains_nothing(fake, actuator):
    drain = Drains(fake)
    assert await actuator.scale("decode", 5, drain) == 5
    patches = fake.of("PATCH")
    assert [(r.path, r.body) for r in patches] == [(SCALE, {"spec": {"replicas": 5}})], \
        f"one patch of the decode Deployment's scale expected, got {[(r.path, r.body) for r in patches]}"
    assert "merge-patch+json" in patches[0].headers["content-type"], \
        f"a map body must go as a merge patch, not {patches[0].headers['content-type']}"
    assert drain.asked == [], "scaling up drains nobody"
    assert len(fake.pod_names("tandem-decode")) == 5
    assert await actuator.replicas("decode") == 5
    assert await actuator.replicas("prefill") == 1, "the prefill Deployment is left as it was"


async def test_every_request_is_the_service_accounts_over_tls(fake, actuator):
    await actuator.scale("decode", 3, Drains(fake))
    assert fake.scheme == "https" and fake.requests, "the fake must serve HTTPS and have been asked"
    assert {r.headers.get("authorization", "").lower() for r in fake.requests} == {f"bearer {TOKEN}"}, \
        "every request must carry the mounted service-account token"


async def test_same_count_changes_nothing(fake, actuator):
    assert await actuator.scale("decode", 3, Drains(fake)) == 3
    assert fake.of("PATCH") == [], "no patch when the Deployment already has the wanted replicas"


async def test_scale_down_drains_the_newest_then_marks_them_then_patches(fake, actuator):
    oldest, middle, newest = fake.pod_names("tandem-decode")
    drain = Drains(fake)
    assert await actuator.scale("decode", 1, drain) == 1
    assert drain.asked == [[newest, middle]], f"the two newest pods are drained, newest first; asked {drain.asked}"
    assert drain.patches_before == [0], "nothing may be patched before the drain returned"
    steps = [(r.path.rsplit("/", 1)[-1], r.body) for r in fake.of("PATCH")]
    marks = [(pod, {"metadata": {"annotations": {DELETION_COST: LEAVING_COST}}}) for pod in (newest, middle)]
    assert steps == [*marks, ("scale", {"spec": {"replicas": 1}})], \
        f"expected the two deletion-cost marks and then the scale patch, in that order; got {steps}"
    assert fake.pod_names("tandem-decode") == [oldest], "the ReplicaSet must have removed exactly the drained pods"


async def test_a_pod_that_is_not_ready_goes_before_a_newer_ready_one(fake, actuator):
    oldest, middle, newest = fake.pod_names("tandem-decode")
    fake.set_ready(oldest, False)  # serving nothing: it is what the ReplicaSet would remove first anyway
    drain = Drains(fake)
    await actuator.scale("decode", 2, drain)
    assert drain.asked == [[oldest]], f"the pod that is not ready should go; asked {drain.asked}"
    assert fake.pod_names("tandem-decode") == [middle, newest]


async def test_an_earlier_mark_on_a_pod_that_stays_is_cleared(fake, actuator):
    oldest, middle, newest = fake.pod_names("tandem-decode")
    fake.pods[oldest]["metadata"]["annotations"][DELETION_COST] = LEAVING_COST  # left by an interrupted step
    await actuator.scale("decode", 2, Drains(fake))
    cleared = [r.body for r in fake.of("PATCH", f"/pods/{oldest}")]
    assert cleared == [{"metadata": {"annotations": {DELETION_COST: None}}}], \
        f"the staying pod's old mark must be removed (a null in the merge patch); sent {cleared}"
    assert fake.pod_names("tandem-decode") == [oldest, middle], "the newest goes, not the one marked long ago"


async def test_pods_still_draining_at_the_timeout_are_removed_all_the_same(fake, actuator, caplog):
    oldest, middle, newest = fake.pod_names("tandem-decode")
    with caplog.at_level(logging.INFO, logger="tandem.planner"):
        assert await actuator.scale("decode", 2, Drains(fake, leave=False)) == 2
    assert fake.pod_names("tandem-decode") == [oldest, middle], "a drain that timed out still ends in the scale-down"
    assert any("still busy" in r.getMessage() and newest in r.getMessage() for r in caplog.records), \
        f"a warning should name the pod still busy; logged {[r.getMessage() for r in caplog.records]}"


async def test_terminating_pods_are_not_chosen(fake, actuator):
    oldest, middle, newest = fake.pod_names("tandem-decode")
    fake.pods[newest]["metadata"]["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    drain = Drains(fake)
    await actuator.scale("decode", 2, drain)
    assert drain.asked == [[middle]], f"a pod already terminating is gone already; asked {drain.asked}"


@pytest.mark.parametrize("setup, expected", [
    (lambda f: f.fail.update({("PATCH", SCALE): 403}), "403 Forbidden"),
    (lambda f: f.deployments.pop("tandem-decode"), "0 Deployments labelled"),
    (lambda f: f.add_deployment("tandem-decode-gpu", "decode", 1), "2 Deployments labelled"),
], ids=["refused", "missing", "ambiguous"])
async def test_the_platforms_refusals_are_one_actuator_error(fake, actuator, setup, expected):
    setup(fake)
    with pytest.raises(ActuatorError) as raised:
        await actuator.scale("decode", 4, Drains(fake))
    message = str(raised.value)
    assert expected in message and "\n" not in message, f"expected one line with {expected!r}, got {message!r}"
    if "403" in expected:
        assert "Role" in message, "a refusal should point at the planner's Role"


async def test_a_wrong_token_is_refused(fake, tmp_path):
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(fake.port)}
    act = KubernetesActuator.in_cluster(service_account(tmp_path / "other", fake, token="stolen"), environ=env)
    try:
        with pytest.raises(ActuatorError, match="401"):
            await act.replicas("decode")
    finally:
        await act.close()


async def test_no_api_server_there_is_an_actuator_error(fake, actuator):
    fake.stop()
    with pytest.raises(ActuatorError, match="kubernetes: GET deployments"):
        await actuator.replicas("decode")


def test_outside_a_pod_in_cluster_config_is_one_error(tmp_path):
    with pytest.raises(ActuatorError, match="no in-cluster service account"):
        KubernetesActuator.in_cluster(tmp_path, environ={})


@pytest.mark.parametrize("host, token, expected", [
    ("10.0.0.1", True, True), ("", True, False), ("10.0.0.1", False, False)], ids=["pod", "no-host", "no-token"])
def test_in_pod(tmp_path, host, token, expected):
    if token:
        (tmp_path / "token").write_text("t")
    assert in_pod({"KUBERNETES_SERVICE_HOST": host}, tmp_path) is expected


def test_without_the_package_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed: import raises ImportError
    with pytest.raises(ActuatorError) as raised:
        import_client()
    assert INSTALL_HINT in str(raised.value) and "\n" not in str(raised.value)


async def test_a_replaced_deployment_is_found_again_after_a_failed_step(fake, actuator):
    await actuator.scale("decode", 3, Drains(fake))  # found and remembered as tandem-decode
    fake.deployments.pop("tandem-decode")
    fake.add_deployment("tandem-decode-v2", "decode", 2)
    with pytest.raises(ActuatorError, match="404"):
        await actuator.scale("decode", 4, Drains(fake))
    assert await actuator.scale("decode", 4, Drains(fake)) == 4
    assert len(fake.pod_names("tandem-decode-v2")) == 4, "the next step must find the new Deployment by its labels"
