"""The Kubernetes manifests (``compose/kubernetes/``): the base and the GPU overlay rendered by a real
kustomize (``kustomize build``, else ``kubectl kustomize``), every object validated against the
Kubernetes OpenAPI schemas (``kubernetes-validate``, strict: an unknown field is an error) for the
oldest and newest versions it knows of here, then read for what tandem needs of them: the bus's
identities as compose wires them, NATS with JetStream on a claim, readiness on ``$SRV``, GPUs in
the overlay only, the KV-store's disk, the planner's Role exactly as wide as the calls its actuator
makes (those calls made for real, against ``tests/fake_kubernetes.py``), and the keyring Job's
script against that fake too.

Run: ``python3 -m pytest -q tests/unit/deploy/``.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.cli.auth_init import init_keyring, wanted_files
from tandem.shared.auth.roles import ROLES, SERVICE_ROLES
from tandem.shared.infra.config import FIELDS, Settings
from tandem.shared.infra.natsserver import MAX_PAYLOAD, MAX_PENDING, find_nats_server

ROOT = Path(__file__).resolve().parents[3]
KUBE = ROOT / "compose" / "kubernetes"
OVERLAYS = {"base": KUBE / "base", "gpu": KUBE / "overlays" / "gpu"}
TANDEM_IMAGE, GPU_IMAGE = "tandem:latest", "tandem:latest-gpu"
SCALED = ("prefill", "decode")
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def kustomize_command() -> list[str] | None:
    """A real renderer: kustomize itself, else kubectl's built-in one (kubectl >= 1.14)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def render():
    """``render("base" | "gpu")`` -> the objects that overlay renders to (rendered once each)."""
    command = kustomize_command()
    if command is None:
        pytest.skip("no kustomize and no kubectl on PATH (Debian: apt-get install kubernetes-client)")
    cache: dict[str, list[dict]] = {}

    def rendered(name: str) -> list[dict]:
        if name not in cache:
            done = subprocess.run([*command, str(OVERLAYS[name])], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{' '.join(command)} {OVERLAYS[name]} failed:\n{done.stderr}"
            cache[name] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
        return cache[name]

    return rendered


def find(objects: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def tandem_containers(objects: list[dict]):
    """(workload, container) for every container of the tandem image, init containers too."""
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            spec = pod_spec(obj)
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                if container["image"].split(":")[0] == "tandem":
                    yield obj, container


def environment(objects: list[dict], container: dict) -> dict[str, str]:
    """A container's variables as the kubelet gives them: its envFrom ConfigMaps, then its env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def served(container: dict) -> str | None:
    """The service of a ``tandem serve SERVICE`` container."""
    command = container.get("command", [])
    return command[2] if command[:2] == ["tandem", "serve"] else None


# -- rendering and the schemas -------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_the_kustomization_renders_every_part(render, overlay):
    objects = render(overlay)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for expected in [("Namespace", "tandem"), ("StatefulSet", "nats"), ("Service", "nats"), ("Job", "tandem-auth-init"),
                     ("Deployment", "tandem-router"), ("Deployment", "tandem-frontend"),
                     ("Service", "tandem-frontend"), ("StatefulSet", "tandem-kvstore"),
                     ("Deployment", "tandem-planner"), ("Deployment", "tandem-prefill"),
                     ("Deployment", "tandem-decode"), ("ServiceAccount", "tandem-planner"), ("Role", "tandem-planner"),
                     ("RoleBinding", "tandem-planner")]:
        assert expected in kinds, f"{overlay}: {expected} missing from the rendering"
    outside = [o["metadata"]["name"] for o in objects if o["kind"] != "Namespace"
               and o["metadata"].get("namespace") != "tandem"]
    assert outside == [], f"{overlay}: every namespaced object goes to the tandem namespace; not: {outside}"


def schema_versions() -> list[str]:
    """1.27, the oldest the README claims (every feature used, pod-deletion-cost and Job TTLs among
    them, is older), and the newest kubernetes-validate knows."""
    kv = pytest.importorskip("kubernetes_validate", reason="the test extra: pip install kubernetes-validate")
    folder = Path(kv.__file__).parent / "kubernetes-json-schema"
    known = sorted({m.group(1) for p in folder.iterdir() if (m := re.fullmatch(r"v(\d+\.\d+\.\d+)-local", p.name))},
                   key=lambda v: tuple(map(int, v.split("."))))
    assert "1.27.0" in known, f"kubernetes-validate knows no 1.27 schemas: {known}"
    return ["1.27.0", known[-1]]


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_object_matches_the_kubernetes_schemas(render, overlay):
    import kubernetes_validate as kv

    versions = schema_versions()
    problems = []
    for obj in render(overlay):
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                problems.append(f"{obj['kind']} {obj['metadata']['name']} ({version}): "
                                f"{'.'.join(map(str, exc.path))}: {exc.message}")
    assert problems == [], "\n".join(problems)


BASE_FILES = sorted(p.name for p in (KUBE / "base").glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", BASE_FILES)
def test_every_base_file_matches_the_schemas_as_written(path):
    """The files themselves, before kustomize: checked even where no kustomize is installed."""
    import kubernetes_validate as kv

    versions = schema_versions()
    docs = [d for d in yaml.safe_load_all((KUBE / "base" / path).read_text()) if d]
    assert docs, f"{path} holds no object"
    for doc in docs:
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{path}: {doc['kind']} {doc['metadata']['name']} ({version}): "
                            f"{'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_validation_does_catch_a_bad_object(render):
    """So the test above could fail: a misspelt field and a wrong type are refused."""
    import kubernetes_validate as kv

    decode = find(render("base"), "Deployment", "tandem-decode")
    for broken in ({**decode, "spec": {**decode["spec"], "replica": 2}},
                   {**decode, "spec": {**decode["spec"], "replicas": "two"}}):
        with pytest.raises(kv.ValidationError):
            kv.validate(broken, "1.27.0", strict=True)


# -- the bus's identities ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_service_mounts_only_its_own_roles_key(render, overlay):
    objects = render(overlay)
    seen = set()
    for obj, container in tandem_containers(objects):
        service = served(container)
        if service is None:
            continue
        seen.add(service)
        env = environment(objects, container)
        assert env.get("TANDEM_NATS_CREDS") == f"/auth/{service}.key", f"{obj['metadata']['name']}: creds"
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        assert mounts["auth"]["mountPath"] == "/auth" and mounts["auth"].get("readOnly"), obj["metadata"]["name"]
        volume = next(v for v in pod_spec(obj)["volumes"] if v["name"] == "auth")["secret"]
        assert volume["secretName"] == "tandem-auth"
        assert volume["items"] == [{"key": f"{service}.key", "path": f"{service}.key"}], \
            f"{obj['metadata']['name']} must see its role's key and no other: {volume['items']}"
        security = pod_spec(obj).get("securityContext", {})
        assert security.get("fsGroup") == security.get("runAsUser") == 1000 and volume["defaultMode"] == 0o440, \
            f"{obj['metadata']['name']}: the key must be readable by the image's user (uid 1000) through its group"
    assert seen == set(SERVICE_ROLES) - {"trainer"}, f"services deployed: {sorted(seen)}"


def test_the_keyring_job_makes_the_secret_once_with_every_file(render):
    objects = render("base")
    job = find(objects, "Job", "tandem-auth-init")
    spec = pod_spec(job)
    (init,), (maker,) = spec["initContainers"], spec["containers"]
    assert init["command"][:3] == ["tandem", "auth", "init"], init["command"]
    folder = init["command"][3]
    assert maker["command"][1:] == ["/scripts/make_secret.py", folder, "tandem-auth"], maker["command"]
    keys = next(v for v in spec["volumes"] if v["name"] == "keys")
    assert keys["emptyDir"].get("medium") == "Memory", "the seeds should not touch the node's disk"
    script = next(v for v in spec["volumes"] if v["name"] == "script")["configMap"]["name"]
    data = find(objects, "ConfigMap", script)["data"]
    assert data["make_secret.py"] == (KUBE / "base" / "make_secret.py").read_text()
    role = find(objects, "Role", "tandem-auth-init")["rules"]
    assert role == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
                    {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["tandem-auth"], "verbs": ["get"]}]
    assert spec["serviceAccountName"] == "tandem-auth-init"


def test_nats_trusts_the_keyring_keeps_jetstream_on_a_claim_and_passes_nats_server_t(render, tmp_path):
    objects = render("base")
    nats = find(objects, "StatefulSet", "nats")
    (container,) = pod_spec(nats)["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    claim = nats["spec"]["volumeClaimTemplates"][0]
    assert mounts["/data"]["name"] == claim["metadata"]["name"], "JetStream's store must be on the claim"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    auth = next(v for v in pod_spec(nats)["volumes"] if v["name"] == mounts["/etc/nats/auth"]["name"])["secret"]
    assert auth["secretName"] == "tandem-auth" and [i["key"] for i in auth["items"]] == ["nats-auth.conf"], \
        "nats-server gets the server config of the keyring and no role key"
    config = next(v for v in pod_spec(nats)["volumes"] if v["name"] == mounts["/etc/nats/nats.conf"]["name"])
    conf = find(objects, "ConfigMap", config["configMap"]["name"])["data"]["nats.conf"]
    assert int(re.search(r"^max_payload:\s*(\d+)", conf, re.M).group(1)) == MAX_PAYLOAD
    assert int(re.search(r"^max_pending:\s*(\d+)", conf, re.M).group(1)) == MAX_PENDING
    assert re.search(r'^jetstream\s*\{\s*store_dir:\s*"/data"', conf, re.M)
    assert container["args"] == ["-c", "/etc/nats/nats.conf"]
    # The config as the pod sees it, with a real keyring beside it, must satisfy nats-server itself.
    (tmp_path / "nats.conf").write_text(conf.replace('"/data"', f'"{tmp_path}/js"'))
    init_keyring(tmp_path / "auth")
    check = subprocess.run([find_nats_server(), "-c", str(tmp_path / "nats.conf"), "-t"], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    service = find(objects, "Service", "nats")
    assert {p["port"] for p in service["spec"]["ports"]} == {4222}, "nats-server's monitoring (no authentication) " \
        "is reachable through the Service"
    assert re.search(r'^http:\s*"127\.0\.0\.1:8222"', conf, re.M), "monitoring must listen on the pod's loopback only"
    env = environment(objects, next(c for _, c in tandem_containers(objects) if served(c) == "router"))
    assert env["TANDEM_NATS_URL"] == "nats://nats:4222"


# -- what the services are given ---------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_tandem_variable_is_a_setting_with_a_valid_value(render, overlay):
    objects = render(overlay)
    by_env = {knob.env: knob.flat for knob in FIELDS}
    for obj, container in tandem_containers(objects):
        env = {k: v for k, v in environment(objects, container).items() if k.startswith("TANDEM_")}
        unknown = sorted(set(env) - set(by_env))
        assert unknown == [], f"{obj['metadata']['name']}: not settings (silently ignored): {unknown}"
        Settings(**{by_env[k]: v for k, v in env.items()})  # raises on a value out of bounds


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_readiness_asks_the_bus_and_grace_outlasts_the_drain(render, overlay):
    objects = render(overlay)
    shutdown_s = Settings().bus.shutdown_timeout_s
    for obj, container in tandem_containers(objects):
        service = served(container)
        if service is None:
            continue
        probe = container.get("readinessProbe", {})
        if service == "frontend":
            assert probe["httpGet"]["path"] == "/health", "the front end is ready when its /health finds a router"
        else:
            assert probe["exec"]["command"] == ["tandem", "ping", service], \
                f"{obj['metadata']['name']}: readiness must be its own instance answering $SRV.PING"
        assert "livenessProbe" not in container, f"{obj['metadata']['name']}: a liveness probe would kill a worker " \
                                                 "still loading its model; losing the bus ends it anyway"
        grace = pod_spec(obj)["terminationGracePeriodSeconds"]
        assert grace > shutdown_s, f"{obj['metadata']['name']}: {grace}s grace <= {shutdown_s}s shutdown timeout"


def test_the_probe_command_is_one_the_cli_takes(render):
    from tandem.cli.main import parser

    root = parser()
    commands = root._subparsers._group_actions[0].choices
    if "ping" not in commands:
        pytest.skip("`tandem ping` is not in tandem/cli/main.py yet (the readiness probes need it: see "
                    "compose/kubernetes/README.md)")
    for _, container in tandem_containers(render("gpu")):
        command = (container.get("readinessProbe", {}).get("exec") or {}).get("command")
        if command:
            root.parse_args(command[1:])  # SystemExit (exit 2) on a command the CLI refuses


def test_the_probe_passes_for_its_own_instance_only_with_its_roles_key(tmp_path):
    """``tandem ping router`` as the router pod's probe runs it: a real router on a server that
    requires identities, the probe holding the router's role key (its container's TANDEM_NATS_CREDS)."""
    from tandem.cli.main import parser

    if "ping" not in parser()._subparsers._group_actions[0].choices:
        pytest.skip("`tandem ping` is not in tandem/cli/main.py yet")
    from tandem.shared.auth.keyring import Keyring
    from tandem.shared.infra.natsserver import NatsServer

    ring = Keyring.generate()
    keys = ring.write_role_keys(tmp_path / "auth")
    server = NatsServer.start(auth_config=ring.server_config(), jetstream=False)
    env = {**os.environ, "TANDEM_NATS_URL": server.url, "TANDEM_NATS_CREDS": str(keys["router"]),
           "TANDEM_DATA_DIR": str(tmp_path / "data"), "TANDEM_METRICS_PORT": "-1"}
    router = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "router"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def probe(*extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "tandem", "ping", "router", *extra], env=env,
                                  capture_output=True, text=True, timeout=60)
        for _ in range(30):  # the router is up within seconds; the probe fails until then
            done = probe()
            if done.returncode == 0:
                break
        assert done.returncode == 0, f"the router's own probe never passed: {done.stderr}"
        elsewhere = probe("--host", "another-pod", "--wait", "0.5")
        assert elsewhere.returncode == 1 and "another-pod" in elsewhere.stderr, \
            "a router on another host must not make this pod ready"
    finally:
        router.terminate()
        router.wait(30)
        server.stop()


def test_gpus_in_the_overlay_only_and_only_for_the_workers(render):
    base, gpu = render("base"), render("gpu")
    for obj, container in tandem_containers(base):
        assert "nvidia.com/gpu" not in str(container.get("resources")) and container["image"] == TANDEM_IMAGE, \
            f"base {obj['metadata']['name']} must be CPU only"
    for obj, container in tandem_containers(gpu):
        env = environment(gpu, container)
        if served(container) in SCALED:
            assert container["image"] == GPU_IMAGE, obj["metadata"]["name"]
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, obj["metadata"]["name"]
            assert env["TANDEM_DEVICE"] == "cuda", obj["metadata"]["name"]
            assert [e["name"] for e in container["env"]].count("TANDEM_DEVICE") == 1, "TANDEM_DEVICE replaced, once"
            tolerations = pod_spec(obj).get("tolerations", [])
            assert any(t["key"] == "nvidia.com/gpu" for t in tolerations), "GPU nodes are often tainted"
        else:
            assert container["image"] == TANDEM_IMAGE and "nvidia.com/gpu" not in str(container.get("resources")), \
                f"{obj['metadata']['name']} needs no GPU"


def test_the_kvstore_keeps_its_disk_tier_on_a_claim(render):
    objects = render("base")
    store = find(objects, "StatefulSet", "tandem-kvstore")
    (container,) = pod_spec(store)["containers"]
    env = environment(objects, container)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claim = store["spec"]["volumeClaimTemplates"][0]
    assert mounts[claim["metadata"]["name"]] == env["TANDEM_KVSTORE_DIR"], "the disk tier's folder is the claim"
    claimed_mib = int(claim["spec"]["resources"]["requests"]["storage"].removesuffix("Gi")) * 1024
    assert float(env["TANDEM_KVSTORE_DISK_MIB"]) < claimed_mib, "the tier must fit on its claim"


# -- the planner and what it may do --------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_the_actuators_labels_find_exactly_one_deployment_per_scaled_service(render, overlay):
    from tandem.services.planner.kubernetes_actuator import COMPONENT, PART_OF

    objects = render(overlay)
    for service in SCALED:
        hits = [o for o in objects if o["kind"] == "Deployment"
                and o["metadata"].get("labels", {}).get(PART_OF) == "tandem"
                and o["metadata"]["labels"].get(COMPONENT) == service]
        assert len(hits) == 1, f"{overlay}: {len(hits)} Deployments carry the labels of {service}"
        selector = hits[0]["spec"]["selector"]["matchLabels"]
        labels = hits[0]["spec"]["template"]["metadata"]["labels"]
        assert selector and selector.items() <= labels.items(), "the pods the actuator lists are the Deployment's"
    accounts = {o["metadata"]["name"]: pod_spec(o)["serviceAccountName"] for o in objects
                if o["kind"] in WORKLOADS and "serviceAccountName" in pod_spec(o)}
    assert accounts == {"tandem-planner": "tandem-planner", "tandem-auth-init": "tandem-auth-init"}, \
        f"only the planner and the keyring Job run under an account of their own: {accounts}"


def test_the_planner_runs_under_its_account_and_acts_on_kubernetes(render):
    objects = render("base")
    planner = find(objects, "Deployment", "tandem-planner")
    assert pod_spec(planner)["serviceAccountName"] == "tandem-planner"
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"]["type"] == "Recreate"
    (container,) = pod_spec(planner)["containers"]
    assert environment(objects, container)["TANDEM_PLANNER_ACTUATOR"] == "kubernetes"
    binding = find(objects, "RoleBinding", "tandem-planner")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tandem-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tandem-planner", "namespace": "tandem"}]
    for obj in objects:  # no other workload holds an API token it has no use for
        if obj["kind"] in ("Deployment", "StatefulSet") and obj["metadata"]["name"] != "tandem-planner":
            assert pod_spec(obj).get("automountServiceAccountToken") is False, obj["metadata"]["name"]


def api_permission(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource with its subresource, verb) of one request, as RBAC names it."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    assert rest[0] == "namespaces", f"every call stays in the namespace: {path}"
    resource = rest[2] + ("/" + rest[4] if len(rest) > 4 else "")
    verb = {"GET": "get" if len(rest) > 3 else "list", "PATCH": "patch", "POST": "create", "PUT": "update",
            "DELETE": "delete"}[method]
    return group, resource, verb


async def test_the_planners_role_allows_exactly_the_calls_its_actuator_makes(render, tmp_path):
    pytest.importorskip("kubernetes")
    from fake_kubernetes import FakeKubernetes

    from tandem.services.planner.kubernetes_actuator import KubernetesActuator

    fake = FakeKubernetes(namespace="tandem")
    fake.add_deployment("tandem-prefill", "prefill", 1)
    fake.add_deployment("tandem-decode", "decode", 2)
    fake.start()
    from kubernetes import client

    api = client.ApiClient(client.Configuration(host=fake.url))
    actuator = KubernetesActuator(api, "tandem")
    try:
        fake.pods[fake.pod_names("tandem-decode")[0]]["metadata"]["annotations"][
            "controller.kubernetes.io/pod-deletion-cost"] = "-1"  # so the clearing patch is made too

        async def drained(hosts: list[str]) -> list[str]:
            return hosts

        await actuator.scale("decode", 3, drained)
        await actuator.scale("decode", 1, drained)
        await actuator.scale("prefill", 2, drained)
        await actuator.replicas("prefill")
    finally:
        await actuator.close()
        fake.stop()
    used = {api_permission(r.method, r.path) for r in fake.requests}
    rules = find(render("base"), "Role", "tandem-planner")["rules"]
    granted = {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert all("resourceNames" not in rule for rule in rules)
    assert used == granted, f"calls made but not granted: {sorted(used - granted)}; " \
                            f"granted but never used: {sorted(granted - used)}"


# -- the keyring Job's script, against the fake API server -------------------------------------------------
@pytest.fixture
def api(tmp_path):
    from fake_kubernetes import FakeKubernetes

    fake = FakeKubernetes(namespace="tandem", token="job-token").start(tls_dir=tmp_path / "tls")
    account = tmp_path / "account"
    account.mkdir()
    (account / "token").write_text("job-token")
    (account / "namespace").write_text("tandem")
    (account / "ca.crt").write_bytes(fake.ca_file.read_bytes())
    yield fake, account
    fake.stop()


def make_secret(fake, account: Path, folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(fake.port)}
    return subprocess.run([sys.executable, str(KUBE / "base" / "make_secret.py"), str(folder), "tandem-auth",
                           "--account-dir", str(account)], env=env, capture_output=True, text=True, timeout=60)


def test_make_secret_puts_the_keyring_in_a_secret_and_keeps_it_on_a_rerun(api, tmp_path):
    fake, account = api
    first = tmp_path / "ring"
    init_keyring(first)
    done = make_secret(fake, account, first)
    assert done.returncode == 0, done.stderr
    data = fake.secrets["tandem-auth"]["data"]
    assert set(data) == {p.name for p in wanted_files(first)} == {"nats-auth.conf", *(f"{r}.key" for r in ROLES)}
    assert all(base64.b64decode(data[p.name]) == p.read_bytes() for p in wanted_files(first)), "contents differ"
    assert fake.of("POST")[0].headers["authorization"] == "Bearer job-token"
    second = tmp_path / "ring2"  # the Job again (re-applied, or retried): a new keyring it must not install
    init_keyring(second)
    again = make_secret(fake, account, second)
    assert again.returncode == 0 and "kept" in again.stdout, again.stdout + again.stderr
    assert fake.secrets["tandem-auth"]["data"] == data, "a re-run must leave the keys in use as they are"


def test_make_secret_refuses_an_incomplete_secret(api, tmp_path):
    fake, account = api
    ring = tmp_path / "ring"
    init_keyring(ring)
    fake.secrets["tandem-auth"] = {"metadata": {"name": "tandem-auth"}, "data": {"router.key": "eA=="}}
    done = make_secret(fake, account, ring)
    assert done.returncode == 1 and "lacks" in done.stderr and len(done.stderr.strip().splitlines()) == 1, \
        done.stderr


def test_make_secret_reports_a_refusal(api, tmp_path):
    fake, account = api
    ring = tmp_path / "ring"
    init_keyring(ring)
    fake.fail[("POST", "/api/v1/namespaces/tandem/secrets")] = 403
    done = make_secret(fake, account, ring)
    assert done.returncode == 1 and "403" in done.stderr, done.stderr
