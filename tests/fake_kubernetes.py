"""A stand-in Kubernetes API server on a real socket, for the planner's Kubernetes actuator and the
manifests' keyring Job, neither of which can meet a real API server here.

:class:`FakeKubernetes` is an ``http.server`` in a thread that speaks the few endpoints tandem calls,
with an API server's semantics where they matter to the caller:

- Deployments: list (``labelSelector``), get, and the ``scale`` subresource (get, patch). Patching
  the replicas down runs a small ReplicaSet controller that removes pods in the real one's order
  (less what cannot differ here: nodes, restarts): pods not ready first, then the lowest
  ``controller.kubernetes.io/pod-deletion-cost``, then the newest; patching them up adds pods.
- Pods: list (``labelSelector``) and patch (a merge patch: ``null`` removes a key).
- Secrets: create (``409 AlreadyExists`` when the name is taken) and get.
- With ``token``, every request must carry ``Authorization: Bearer <token>`` (else 401); with
  ``tls``, it serves HTTPS with a self-signed certificate for 127.0.0.1 (:attr:`ca_file`), as an
  in-cluster client sees the API server.

Every request is recorded in :attr:`requests` (method, path, query, headers with lower-case names,
JSON body, arrival on ``time.monotonic()``), so a test asserts on what was asked and in which
order. ``fail`` makes chosen endpoints answer an error status.
"""

from __future__ import annotations

import datetime
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    at: float = 0.0  # time.monotonic() when it arrived


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: what a strategic merge patch also does for plain maps like the ones patched here."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c=d``), the only kind tandem sends."""
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip().lstrip("="):
            return False
    return True


@dataclass
class FakeKubernetes:
    namespace: str = "tandem"
    token: str | None = None
    deployments: dict[str, dict] = field(default_factory=dict)
    pods: dict[str, dict] = field(default_factory=dict)
    secrets: dict[str, dict] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    fail: dict[tuple[str, str], int] = field(default_factory=dict)  # (method, path) -> status to answer
    _clock: int = 0
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the cluster's state, as a test sets it up ----------------------------------------------------
    def add_deployment(self, name: str, component: str, replicas: int) -> None:
        labels = {"app.kubernetes.io/part-of": "tandem", "app.kubernetes.io/component": component}
        self.deployments[name] = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels},
            "spec": {"replicas": 0, "selector": {"matchLabels": dict(labels)},
                     "template": {"metadata": {"labels": dict(labels)}}},
            "status": {"replicas": 0},
        }
        self._set_replicas(name, replicas)

    def pod_names(self, deployment: str) -> list[str]:
        """The deployment's pods, oldest first."""
        labels = self.deployments[deployment]["spec"]["selector"]["matchLabels"]
        mine = [p for p in self.pods.values() if all(p["metadata"]["labels"].get(k) == v for k, v in labels.items())]
        return [p["metadata"]["name"] for p in sorted(mine, key=lambda p: p["metadata"]["creationTimestamp"])]

    def set_ready(self, pod: str, ready: bool) -> None:
        self.pods[pod]["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    def of(self, method: str, suffix: str = "") -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path.endswith(suffix)]

    # -- a ReplicaSet controller, enough for scale-downs --------------------------------------------
    def _set_replicas(self, name: str, replicas: int) -> None:
        deployment = self.deployments[name]
        deployment["spec"]["replicas"] = replicas
        current = self.pod_names(name)
        for _ in range(replicas - len(current)):
            self._clock += 1
            pod = f"{name}-{self._clock:05d}"
            created = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=self._clock)
            self.pods[pod] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": self.namespace,
                             "labels": dict(deployment["spec"]["template"]["metadata"]["labels"]),
                             "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"), "annotations": {}},
                "spec": {"nodeName": "node-1", "containers": [{"name": "worker", "image": "tandem:latest"}]},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
            }
        if len(current) > replicas:
            # The real controller's order, less what never differs here (node, restarts): not ready
            # first, then the lowest deletion cost, then the newest. Two stable sorts make it.
            def rank(pod: str) -> tuple[bool, int]:
                meta, status = self.pods[pod]["metadata"], self.pods[pod]["status"]
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
                return ready, int((meta.get("annotations") or {}).get(DELETION_COST, "0"))
            newest_first = sorted(current, key=lambda p: self.pods[p]["metadata"]["creationTimestamp"], reverse=True)
            for pod in sorted(newest_first, key=rank)[:len(current) - replicas]:
                del self.pods[pod]
        deployment["status"]["replicas"] = replicas

    # -- HTTP ----------------------------------------------------------------------------------------
    def start(self, tls_dir: Path | None = None) -> FakeKubernetes:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # the test's output stays the test's
                pass

            def do_GET(self) -> None:
                self._serve("GET")

            def do_PATCH(self) -> None:
                self._serve("PATCH")

            def do_POST(self) -> None:
                self._serve("POST")

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                body = json.loads(raw) if raw else None
                headers = {k.lower(): v for k, v in self.headers.items()}  # header names are case-blind
                with fake._lock:
                    fake.requests.append(Recorded(method, parts.path, query, headers, body, time.monotonic()))
                    status, answer = fake._answer(method, parts.path, query, headers, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        self.ca_file: Path | None = None
        if tls_dir is not None:
            cert, key = self_signed(tls_dir)
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme, self.ca_file = "https", cert
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-kubernetes",
                                        daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop serving (the port then refuses connections); safe to call twice."""
        if self._thread is None:
            return
        self._thread, thread = None, self._thread
        self._server.shutdown()
        self._server.server_close()
        thread.join(5)

    def _answer(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
                body: Any) -> tuple[int, Any]:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if self.token is not None and (scheme.lower() != "bearer" or token != self.token):
            return 401, status_body(401, "Unauthorized", "no or wrong bearer token")
        if method == "PATCH" and "merge-patch+json" not in headers.get("content-type", ""):
            # the only patches sent here are maps: as a JSON Patch (a list of operations) one is refused
            return 415, status_body(415, "UnsupportedMediaType", f"a map as {headers.get('content-type')}")
        if (method, path) in self.fail:
            code = self.fail[(method, path)]
            return code, status_body(code, "Forbidden" if code == 403 else "InternalError", f"{method} {path} refused")
        apps = f"/apis/apps/v1/namespaces/{self.namespace}/deployments"
        core = f"/api/v1/namespaces/{self.namespace}"
        selector = query.get("labelSelector", "")
        if method == "GET" and path == apps:
            items = [d for d in self.deployments.values() if matches(d["metadata"]["labels"], selector)]
            return 200, {"apiVersion": "apps/v1", "kind": "DeploymentList", "metadata": {}, "items": items}
        if path.startswith(apps + "/"):
            name, _, sub = path[len(apps) + 1:].partition("/")
            if name not in self.deployments:
                return 404, status_body(404, "NotFound", f'deployments.apps "{name}" not found')
            if sub == "" and method == "GET":
                return 200, self.deployments[name]
            if sub == "scale" and method == "PATCH":
                self._set_replicas(name, int(merge_patch({}, body)["spec"]["replicas"]))
            if sub == "scale" and method in ("GET", "PATCH"):
                d = self.deployments[name]
                labels = d["spec"]["selector"]["matchLabels"]
                return 200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                             "metadata": {"name": name, "namespace": self.namespace},
                             "spec": {"replicas": d["spec"]["replicas"]},
                             "status": {"replicas": d["status"]["replicas"],
                                        "selector": ",".join(f"{k}={v}" for k, v in labels.items())}}
        if method == "GET" and path == f"{core}/pods":
            items = [p for p in self.pods.values() if matches(p["metadata"]["labels"], selector)]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if method == "PATCH" and path.startswith(f"{core}/pods/"):
            name = path.rsplit("/", 1)[1]
            if name not in self.pods:
                return 404, status_body(404, "NotFound", f'pods "{name}" not found')
            self.pods[name] = merge_patch(self.pods[name], body)
            return 200, self.pods[name]
        if method == "POST" and path == f"{core}/secrets":
            name = body["metadata"]["name"]
            if name in self.secrets:
                return 409, status_body(409, "AlreadyExists", f'secrets "{name}" already exists')
            self.secrets[name] = body
            return 201, body
        if method == "GET" and path.startswith(f"{core}/secrets/"):
            name = path.rsplit("/", 1)[1]
            if name not in self.secrets:
                return 404, status_body(404, "NotFound", f'secrets "{name}" not found')
            return 200, self.secrets[name]
        return 404, status_body(404, "NotFound", f"the fake serves no {method} {path}")


def status_body(code: int, reason: str, message: str) -> dict:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason,
            "message": message, "metadata": {}}


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself (so it is its own CA file) and its key."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "ca.crt", folder / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
