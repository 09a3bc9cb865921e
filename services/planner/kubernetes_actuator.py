"""Carrying out the planner's decisions on Kubernetes: the prefill and decode Deployments' replicas.

The planner runs in a pod of the deployment (``compose/kubernetes/``) under a ServiceAccount whose
Role lets it read Deployments and their ``scale``, list pods and patch them and the scale, in its own
namespace and nowhere else. :meth:`KubernetesActuator.in_cluster` connects as that account (the
token and CA the kubelet mounts; the token file is read again when it is renewed) in the namespace
the account lives in.

Which Deployment is a service's is said by labels, not names, so an overlay may rename
(``namePrefix``) freely: ``app.kubernetes.io/part-of=tandem`` and
``app.kubernetes.io/component=<prefill|decode>``; exactly one Deployment in the namespace must carry
them.

Scaling up patches the replicas. Scaling down (the contract in :mod:`.actuator`):

1. picks the pods to go, in the order the ReplicaSet controller itself prefers (pods not yet
   scheduled, pending, or not ready first: they serve nothing), then the newest;
2. awaits ``drain(their names)``: a pod's hostname is its name, which is what its worker beats with;
3. marks them with ``controller.kubernetes.io/pod-deletion-cost`` at the lowest value (and takes the
   mark off any other pod that kept one from an earlier step), so the controller removes exactly
   those. A drained worker has exited, so its pod shows not ready, which the controller would
   remove first anyway; the mark settles ties and the pods that still drain;
4. patches the replicas. A pod whose worker did not finish in time still gets a graceful stop:
   its SIGTERM drains it for ``--shutdown-timeout`` (the pods' grace period is longer than that).

The ``kubernetes`` package is optional (``pip install 'tandem[kubernetes]'``) and imported only here,
when this actuator is chosen. Its client is synchronous: each call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tandem.services.planner.actuator import ActuatorError, Drain

PART_OF = "app.kubernetes.io/part-of"
COMPONENT = "app.kubernetes.io/component"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LEAVING_COST = str(-(2**31))  # the lowest a pod-deletion-cost may be (an int32)
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
INSTALL_HINT = "pip install 'tandem[kubernetes]'"
SERVICES = ("prefill", "decode")

log = logging.getLogger("tandem.planner")
T = TypeVar("T")


@dataclass(frozen=True)
class Kube:
    """What is used of the ``kubernetes`` package, imported in one guarded place."""

    client: Any  # kubernetes.client
    in_cluster_loader: Any  # kubernetes.config.incluster_config.InClusterConfigLoader
    config_error: type[Exception]  # its ConfigException
    api_error: type[Exception]  # kubernetes.client.exceptions.ApiException
    transport_error: type[Exception]  # urllib3's HTTPError: no server there, TLS refused


def import_client() -> Kube:
    """The ``kubernetes`` package's parts, or :class:`ActuatorError` saying how to install it."""
    try:
        from kubernetes import client
        from kubernetes.client import rest
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config.config_exception import ConfigException
        from kubernetes.config.incluster_config import InClusterConfigLoader
    except ImportError:
        raise ActuatorError(f"--planner-actuator kubernetes needs the kubernetes package: {INSTALL_HINT}") from None
    # urllib3 as the client itself imported it: it is the client's dependency, not tandem's
    return Kube(client, InClusterConfigLoader, ConfigException, ApiException, rest.urllib3.exceptions.HTTPError)


def in_pod(environ: Mapping[str, str] = os.environ, account_dir: Path = SERVICE_ACCOUNT_DIR) -> bool:
    """Whether this process runs in a Kubernetes pod with a service account token to act with."""
    return bool(environ.get("KUBERNETES_SERVICE_HOST")) and (account_dir / "token").is_file()


class KubernetesActuator:
    """Scales the ``prefill`` and ``decode`` Deployments of one namespace (see the module)."""

    where = "kubernetes"

    def __init__(self, api_client: Any, namespace: str, part_of: str = "tandem") -> None:
        self.kube = import_client()
        self.api_client = api_client
        self.apps = self.kube.client.AppsV1Api(api_client)
        self.core = self.kube.client.CoreV1Api(api_client)
        self.namespace = namespace
        self.part_of = part_of
        self.found: dict[str, tuple[str, str]] = {}  # service -> (Deployment name, its pods' label selector)

    @classmethod
    def in_cluster(cls, account_dir: Path = SERVICE_ACCOUNT_DIR,
                   environ: Mapping[str, str] | None = None) -> KubernetesActuator:
        """Connected as this pod's service account, in its namespace."""
        kube = import_client()
        configuration = kube.client.Configuration()
        try:
            kube.in_cluster_loader(token_filename=str(account_dir / "token"), cert_filename=str(account_dir / "ca.crt"),
                                   environ=dict(os.environ if environ is None else environ)
                                   ).load_and_set(configuration)
            namespace = (account_dir / "namespace").read_text().strip()
        except (kube.config_error, OSError) as exc:
            raise ActuatorError(f"kubernetes: no in-cluster service account to act with ({exc}); run the planner "
                                "in its pod, or choose another --planner-actuator") from None
        return cls(kube.client.ApiClient(configuration), namespace)

    # -- the contract --------------------------------------------------------------------------------
    async def replicas(self, service: str) -> int:
        name, _ = await self.deployment(service)
        scale = await self.call(f"GET deployments/{name}/scale", self.apps.read_namespaced_deployment_scale,
                                name, self.namespace)
        return int(scale.spec.replicas or 0)

    async def scale(self, service: str, wanted: int, drain: Drain) -> int:
        try:
            return await self._scale(service, wanted, drain)
        except ActuatorError:
            self.found.pop(service, None)  # the Deployment may have been replaced: look it up again next time
            raise

    async def _scale(self, service: str, wanted: int, drain: Drain) -> int:
        name, selector = await self.deployment(service)
        current = await self.replicas(service)
        if wanted == current:
            return current
        if wanted > current:
            await self.patch_replicas(name, wanted)
            log.info("kubernetes: %s: Deployment %s scaled %d -> %d", service, name, current, wanted)
            return wanted
        pods = await self.pods(selector)
        leaving = choose_leaving(pods, current - wanted)
        names = [pod.metadata.name for pod in leaving]
        log.info("kubernetes: %s: scaling Deployment %s %d -> %d; draining pods %s", service, name, current, wanted,
                 ", ".join(names) or "(none: the pods to go are not created yet)")
        left = set(await drain(names)) if names else set()
        busy = [n for n in names if n not in left]
        if busy:
            log.warning("kubernetes: %s: pods %s still busy at the drain's timeout; their SIGTERM drains them",
                        service, ", ".join(busy))
        else:
            log.info("kubernetes: %s: drained %s", service, ", ".join(names) or "nothing")
        keep = [pod for pod in pods if pod.metadata.name not in names]
        for pod in keep:  # an old step's mark on a pod that stays would make the controller take it instead
            if (pod.metadata.annotations or {}).get(DELETION_COST) is not None:
                await self.mark(pod.metadata.name, None)
                log.info("kubernetes: %s: cleared the deletion cost of %s, which stays", service, pod.metadata.name)
        for pod_name in names:
            await self.mark(pod_name, LEAVING_COST)
        if names:
            log.info("kubernetes: %s: marked %s to go first (%s=%s)", service, ", ".join(names), DELETION_COST,
                     LEAVING_COST)
        await self.patch_replicas(name, wanted)
        log.info("kubernetes: %s: Deployment %s scaled %d -> %d", service, name, current, wanted)
        return wanted

    async def close(self) -> None:
        await asyncio.to_thread(self.api_client.close)

    # -- the API calls -------------------------------------------------------------------------------
    async def deployment(self, service: str) -> tuple[str, str]:
        """The Deployment of ``service`` and the label selector of its pods (found once, by labels)."""
        if service not in SERVICES:
            raise ActuatorError(f"kubernetes: no Deployment is scaled for {service!r} (only {', '.join(SERVICES)})")
        if service not in self.found:
            labels = f"{PART_OF}={self.part_of},{COMPONENT}={service}"
            listed = await self.call("GET deployments", self.apps.list_namespaced_deployment, self.namespace,
                                     label_selector=labels)
            if len(listed.items) != 1:
                names = ", ".join(d.metadata.name for d in listed.items)
                raise ActuatorError(f"kubernetes: {len(listed.items)} Deployments labelled {labels} in namespace "
                                    f"{self.namespace}{f' ({names})' if names else ''}; exactly one must be")
            found = listed.items[0]
            match = (found.spec.selector.match_labels or {}) if found.spec and found.spec.selector else {}
            if not match:
                raise ActuatorError(f"kubernetes: Deployment {found.metadata.name} selects its pods by no "
                                    "matchLabels; give it some")
            self.found[service] = (found.metadata.name, ",".join(f"{k}={v}" for k, v in sorted(match.items())))
        return self.found[service]

    async def pods(self, selector: str) -> list[Any]:
        """The Deployment's pods that are not already terminating."""
        listed = await self.call("GET pods", self.core.list_namespaced_pod, self.namespace, label_selector=selector)
        return [pod for pod in listed.items if pod.metadata.deletion_timestamp is None]

    async def mark(self, pod: str, cost: str | None) -> None:
        body = {"metadata": {"annotations": {DELETION_COST: cost}}}  # None: a merge patch removes the key
        await self.call(f"PATCH pods/{pod}", self.core.patch_namespaced_pod, pod, self.namespace, body)

    async def patch_replicas(self, name: str, replicas: int) -> None:
        await self.call(f"PATCH deployments/{name}/scale", self.apps.patch_namespaced_deployment_scale, name,
                        self.namespace, {"spec": {"replicas": replicas}})

    async def call(self, what: str, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One API call in a thread; any failure is one :class:`ActuatorError` line naming the call."""
        try:
            return await asyncio.to_thread(method, *args, **kwargs)
        except self.kube.api_error as exc:
            hint = "; the planner's Role must allow it (compose/kubernetes/base/planner.yaml)" if exc.status == 403 \
                else ""
            raise ActuatorError(f"kubernetes: {what} in namespace {self.namespace}: {exc.status} {exc.reason}: "
                                f"{api_message(exc)}{hint}") from None
        except (self.kube.transport_error, OSError) as exc:  # no API server there, TLS refused
            raise ActuatorError(f"kubernetes: {what} in namespace {self.namespace}: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def api_message(exc: Any) -> str:
    """The API server's own message in an error (its Status body), else the client's text."""
    import json

    try:
        return str(json.loads(exc.body)["message"])
    except Exception:
        return (str(exc.body or "") or str(exc)).splitlines()[0]


def choose_leaving(pods: list[Any], count: int) -> list[Any]:
    """The ``count`` pods to remove: those serving nothing first (not scheduled, pending, not ready),
    as the ReplicaSet controller itself would, then the newest; a tie goes to the name, so the
    choice never depends on the API's list order."""
    def serving(pod: Any) -> tuple[bool, bool, bool]:
        status = pod.status
        ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or [])) if status else False
        return bool(pod.spec and pod.spec.node_name), bool(status and status.phase == "Running"), ready

    by_age = sorted(pods, key=lambda p: (p.metadata.creation_timestamp is not None, p.metadata.creation_timestamp
                                         or 0, p.metadata.name), reverse=True)
    return sorted(by_age, key=serving)[:count]
