"""The planner's decisions carried out under docker compose, through the Docker Engine API.

:class:`DockerActuator` keeps the contract of :mod:`tandem.services.planner.actuator` by doing
what ``docker compose up --scale`` does, over the engine's UNIX socket (plain HTTP; httpx's UDS
transport), so the planner container needs the socket and nothing else (no compose binary, no
compose file):

* **Which project.** The planner's own container carries compose's labels
  (``com.docker.compose.project``); :meth:`DockerActuator.from_environment` finds that container
  by the id in ``/proc/self/mountinfo`` (or its hostname) and reads them.
* **Which service.** A role ("decode") maps to the compose service whose containers run
  ``tandem serve decode`` (``decode``, or ``decode-gpu`` under the gpu profile).
* **Up.** A new replica is a copy of the newest running one: its image (by id), config, host config
  and networks, its compose labels with the next container number (so compose counts it as its own and
  ``docker compose ps`` / ``down`` see it), named as compose names its replicas
  (``project_decode_3`` or ``project-decode-3``, after the copied one), with its own hostname.
* **Down.** The newest replicas go first (highest container number), as under ``tandem up``. Each
  first loses its restart policy (a drained worker exits, and ``unless-stopped`` would start it
  again), then ``drain(hostnames)`` is awaited, then it is stopped and removed. A worker that did
  not leave in time is stopped all the same: its SIGTERM is a second drain, bounded by its
  ``--shutdown-timeout``, within the container's stop timeout (compose's ``stop_grace_period``).

A replica that compose later finds (``docker compose up`` again) is one of its own; compose may
still bring the service back to the count its command line asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem.services.planner.actuator import ActuatorError, Drain

log = logging.getLogger("tandem.planner.docker")

DEFAULT_SOCKET = "/var/run/docker.sock"
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"
COUNTED_STATES = ("running", "restarting")  # a restarting replica is one the engine keeps bringing back
# Fields of an inspected container's Config that belong to that one container, not to its service.
PER_CONTAINER_CONFIG = ("Hostname", "Domainname", "MacAddress")
# Fields of a network endpoint the engine assigns when it connects a container.
PER_CONTAINER_ENDPOINT = ("NetworkID", "EndpointID", "Gateway", "IPAddress", "IPPrefixLen", "IPv6Gateway",
                          "GlobalIPv6Address", "GlobalIPv6PrefixLen", "MacAddress", "DNSNames")
MOUNTED_FROM = re.compile(r"/containers/([0-9a-f]{64})/")
CGROUP_OF = re.compile(r"docker[/-]([0-9a-f]{64})\b")


@dataclass(frozen=True)
class Replica:
    """One container of a compose service, as the engine lists it."""

    id: str
    name: str  # without the leading slash the engine puts before names
    number: int  # compose's container number
    created: int  # seconds since the epoch
    state: str  # "running", "exited", ...

    @property
    def counted(self) -> bool:
        return self.state in COUNTED_STATES


def socket_path(environ: dict[str, str] | None = None) -> str:
    """The engine's socket: ``DOCKER_HOST`` when it names a UNIX socket, else the default."""
    host = (environ if environ is not None else os.environ).get("DOCKER_HOST", "")
    return host.removeprefix("unix://") if host.startswith("unix://") else DEFAULT_SOCKET


def container_number(labels: dict[str, str] | None) -> int:
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return int((labels or {})[NUMBER_LABEL])
    return 0


def replica_from_listing(entry: dict[str, Any]) -> Replica:
    """A :class:`Replica` from one entry of ``GET /containers/json``."""
    names = entry.get("Names") or [entry.get("Id", "")[:12]]
    return Replica(id=entry["Id"], name=names[0].lstrip("/"), number=container_number(entry.get("Labels")),
                   created=int(entry.get("Created") or 0), state=str(entry.get("State") or ""))


def choose_victims(replicas: list[Replica], count: int) -> list[Replica]:
    """The ``count`` replicas a scale-down removes: running ones only, the newest first (highest
    container number, then latest created), so the longest-serving workers (their caches warm) stay."""
    running = sorted((r for r in replicas if r.counted), key=lambda r: (r.number, r.created), reverse=True)
    return running[:max(0, count)]


def next_number(replicas: list[Replica]) -> int:
    """The container number a new replica takes: past every number in use, stopped containers'
    included (their names are still taken)."""
    return max((r.number for r in replicas), default=0) + 1


def replica_name(template: Replica, number: int, project: str, service: str) -> str:
    """The new replica's name in the copied one's style: compose 1 names ``project_service_1``,
    compose 2 ``project-service-1``; a name that shows neither gets compose 2's."""
    suffix = re.search(r"([_-])(\d+)$", template.name)
    if suffix and int(suffix.group(2)) == template.number:
        return f"{template.name[:suffix.start()]}{suffix.group(1)}{number}"
    return f"{project}-{service}-{number}"


def service_runs(command: str | list[str] | None, role: str) -> bool:
    """Whether a container's command is ``tandem serve <role>`` (the listing gives it as one string)."""
    words = command.split() if isinstance(command, str) else list(command or [])
    return len(words) >= 2 and words[-2:] == ["serve", role]


def create_body(inspected: dict[str, Any], number: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """What ``POST /containers/create`` takes to make another replica like ``inspected`` (a
    ``GET /containers/{id}/json`` answer) with container number ``number``, and the networks to
    connect after creating it: the engine's older API versions take only one network at create."""
    config = {k: v for k, v in (inspected.get("Config") or {}).items() if k not in PER_CONTAINER_CONFIG}
    config["Labels"] = {**(config.get("Labels") or {}), NUMBER_LABEL: str(number)}
    # The very image the copied replica runs, not its tag: a tag rebuilt since would mix versions.
    config["Image"] = inspected.get("Image") or config.get("Image")
    service = config["Labels"].get(SERVICE_LABEL, "")
    endpoints: dict[str, dict[str, Any]] = {}
    for network, endpoint in ((inspected.get("NetworkSettings") or {}).get("Networks") or {}).items():
        kept = {k: v for k, v in (endpoint or {}).items() if k not in PER_CONTAINER_ENDPOINT}
        # The copied replica's aliases include its own short id; the new one gets the service name only.
        kept["Aliases"] = [service] if service else []
        endpoints[network] = kept
    host_config = dict(inspected.get("HostConfig") or {})
    mode = host_config.get("NetworkMode", "")
    first = mode if mode in endpoints else next(iter(endpoints), None)
    body = {**config, "HostConfig": host_config}
    if first is not None:
        body["NetworkingConfig"] = {"EndpointsConfig": {first: endpoints.pop(first)}}
    return body, endpoints


def own_container_ids(mountinfo: str = "", cgroup: str = "") -> list[str]:
    """Ids this process's container may have, best first: the engine mounts the container's own
    ``/etc/hostname`` (and resolv.conf, hosts) from ``<data root>/containers/<id>/``, which shows in
    mountinfo under cgroup v1 and v2 alike; cgroup v1 paths name it too (``/docker/<id>``,
    ``docker-<id>.scope``). Image layer ids in the overlay line are not containers: left out."""
    found: list[str] = []
    for pattern, text in ((MOUNTED_FROM, mountinfo), (CGROUP_OF, cgroup)):
        for match in pattern.findall(text):
            if match not in found:
                found.append(match)
    return found


def _own_id_candidates() -> list[str]:
    texts = []
    for path in ("/proc/self/mountinfo", "/proc/self/cgroup"):
        try:
            texts.append(Path(path).read_text())
        except OSError:
            texts.append("")
    ids = own_container_ids(*texts)
    if Path("/.dockerenv").exists():  # the engine names a container's hostname after its short id by default
        ids.append(socket.gethostname())
    return ids


def _socket_problem(path: str) -> str | None:
    """Why the engine cannot be reached at ``path``, as one line naming the fix; None when it can."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return (f"no Docker socket at {path}: mount it into the planner container "
                f"(volumes: - /var/run/docker.sock:{path}) or set DOCKER_HOST=unix://PATH")
    except OSError as exc:
        return f"cannot see the Docker socket {path}: {exc.strerror}"
    if not stat.S_ISSOCK(mode):
        return f"{path} is not a socket: mount the host's /var/run/docker.sock there"
    if not os.access(path, os.R_OK | os.W_OK):
        return (f"this user (uid {os.getuid()}) may not use the Docker socket {path}: add its group "
                f"(gid {os.stat(path).st_gid}) to the planner container (group_add)")
    return None


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("docker", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def in_compose_container(socket_file: str | None = None, timeout_s: float = 2.0) -> bool:
    """True when this process runs in a container of a compose project and can reach the engine
    through its socket: where ``--planner-actuator auto`` picks ``docker``. Blocking, for a start-up
    check (one request to the engine, at most ``timeout_s``)."""
    path = socket_file or socket_path()
    if _socket_problem(path) is not None:
        return False
    for candidate in _own_id_candidates():
        connection = _UnixConnection(path, timeout_s)
        try:
            connection.request("GET", f"/containers/{candidate}/json")
            response = connection.getresponse()
            if response.status != 200:
                continue
            labels = (json.loads(response.read()).get("Config") or {}).get("Labels") or {}
            return PROJECT_LABEL in labels
        except (OSError, ValueError, http.client.HTTPException):
            return False
        finally:
            connection.close()
    return False


class DockerActuator:
    """Scales the compose services of ``project`` (see the module). ``services`` maps a role to
    its compose service where the ``tandem serve <role>`` rule would not find it."""

    where = "docker"

    def __init__(self, project: str, *, socket_file: str | None = None, services: dict[str, str] | None = None,
                 start_timeout_s: float = 60.0, api_timeout_s: float = 30.0) -> None:
        self.project = project
        self.socket_file = socket_file or socket_path()
        self.services = dict(services or {})
        self.start_timeout_s = start_timeout_s
        self.api_timeout_s = api_timeout_s
        self._lock = asyncio.Lock()  # one scaling step at a time: two would pick the same numbers
        self._http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.socket_file),
                                       base_url="http://docker", timeout=api_timeout_s)

    @classmethod
    async def from_environment(cls, *, socket_file: str | None = None, **kwargs: Any) -> DockerActuator:
        """The actuator for the compose project this process's own container belongs to. Raises
        :class:`ActuatorError` (one line, naming the fix) outside one or without the socket."""
        path = socket_file or socket_path()
        problem = _socket_problem(path)
        if problem:
            raise ActuatorError(problem)
        probe = cls("", socket_file=path, **kwargs)
        try:
            for candidate in _own_id_candidates():
                found = await probe._api("GET", f"/containers/{candidate}/json", ok=(200, 404))
                if found is None:
                    continue
                labels = (found.get("Config") or {}).get("Labels") or {}
                if PROJECT_LABEL not in labels:
                    raise ActuatorError(f"container {found.get('Name', candidate).lstrip('/')} has no compose "
                                        "labels: start the planner with docker compose, or pick --planner-actuator up")
                probe.project = labels[PROJECT_LABEL]
                log.info("docker actuator: compose project %s (this container: service %s)", probe.project,
                         labels.get(SERVICE_LABEL, "?"))
                return probe
        except BaseException:
            await probe.close()
            raise
        await probe.close()
        raise ActuatorError("this process runs in no container the Docker engine knows: run the planner under "
                            "docker compose with the socket mounted, or pick --planner-actuator up")

    async def _api(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        """One engine call; its JSON answer (None for a status in ``ok`` without a body, or 404 in ``ok``)."""
        try:
            response = await self._http.request(method, path, timeout=timeout_s or self.api_timeout_s, **kwargs)
        except httpx.HTTPError as exc:
            raise ActuatorError(f"cannot reach the Docker engine at {self.socket_file} ({type(exc).__name__}: "
                                f"{exc}): check the socket is mounted and the engine runs") from None
        if response.status_code not in ok:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise ActuatorError(f"Docker engine refused {method} {path.split('?')[0]}: "
                                f"{response.status_code} {str(message).strip()}")
        if response.status_code == 404 or not response.content:
            return None
        return response.json()

    async def containers(self, compose_service: str | None = None) -> list[Replica]:
        """The project's service containers (not one-off ``compose run`` ones), stopped ones included."""
        labels = [f"{PROJECT_LABEL}={self.project}", f"{ONEOFF_LABEL}=False"]
        if compose_service:
            labels.append(f"{SERVICE_LABEL}={compose_service}")
        listing = await self._api("GET", "/containers/json",
                                  params={"all": "1", "filters": json.dumps({"label": labels})})
        return [replica_from_listing(entry) for entry in listing or []]

    async def compose_service(self, role: str) -> str:
        """The compose service that runs ``tandem serve <role>``: the one with the most running
        replicas when several do (the cpu and the gpu profile's), the role's own name on a tie."""
        if role in self.services:
            return self.services[role]
        labels = [f"{PROJECT_LABEL}={self.project}", f"{ONEOFF_LABEL}=False"]
        listing = await self._api("GET", "/containers/json",
                                  params={"all": "1", "filters": json.dumps({"label": labels})}) or []
        running: dict[str, int] = {}
        for entry in listing:
            service = (entry.get("Labels") or {}).get(SERVICE_LABEL, "")
            if service == role or service_runs(entry.get("Command"), role):
                running[service] = running.get(service, 0) + (entry.get("State") in COUNTED_STATES)
        if not running:
            raise ActuatorError(f"no container of compose project {self.project} runs `tandem serve {role}`: start "
                                f"one (docker compose up -d), the actuator copies an existing replica")
        return max(running, key=lambda s: (running[s], s == role))

    async def replicas(self, service: str) -> int:
        compose = await self.compose_service(service)
        return sum(r.counted for r in await self.containers(compose))

    async def scale(self, service: str, wanted: int, drain: Drain) -> int:
        if wanted < 0:
            raise ActuatorError(f"cannot scale {service} to {wanted} replicas: ask for 0 or more")
        async with self._lock:
            compose = await self.compose_service(service)
            replicas = await self.containers(compose)
            have = sum(r.counted for r in replicas)
            if wanted > have:
                await self._add(compose, replicas, wanted - have)
            elif wanted < have:
                await self._remove(compose, choose_victims(replicas, have - wanted), drain)
            now = sum(r.counted for r in await self.containers(compose))
            log.info("docker: %s (%s) %d -> %d replicas (wanted %d)", service, compose, have, now, wanted)
            return now

    async def _add(self, compose: str, replicas: list[Replica], count: int) -> None:
        running = [r for r in replicas if r.counted]
        pool = running or replicas
        if not pool:
            raise ActuatorError(f"compose service {compose} has no container to copy: docker compose up -d {compose}")
        template = max(pool, key=lambda r: (r.number, r.created))
        inspected = await self._api("GET", f"/containers/{template.id}/json")
        taken = list(replicas)
        for _ in range(count):
            number = next_number(taken)
            body, more_networks = create_body(inspected, number)
            name = replica_name(template, number, self.project, compose)
            created = await self._api("POST", "/containers/create", params={"name": name}, json=body, ok=(201,))
            container_id = created["Id"]
            taken.append(Replica(container_id, name, number, 0, "created"))
            for network, endpoint in more_networks.items():
                await self._api("POST", f"/networks/{network}/connect", ok=(200,),
                                json={"Container": container_id, "EndpointConfig": endpoint})
            await self._api("POST", f"/containers/{container_id}/start", ok=(204, 304))
            log.info("docker: started %s (copy of %s)", name, template.name)
        await self._await_running(compose, len([r for r in replicas if r.counted]) + count)

    async def _await_running(self, compose: str, count: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        while sum(r.state == "running" for r in await self.containers(compose)) < count:
            if loop.time() > deadline:
                raise ActuatorError(f"{compose}: fewer than {count} replicas running {self.start_timeout_s:.0f} s "
                                    f"after starting them: see `docker compose logs {compose}`")
            await asyncio.sleep(0.25)

    async def _remove(self, compose: str, victims: list[Replica], drain: Drain) -> None:
        hosts: dict[str, Replica] = {}
        policies: dict[str, dict[str, Any]] = {}
        for victim in victims:
            inspected = await self._api("GET", f"/containers/{victim.id}/json")
            hosts[(inspected.get("Config") or {}).get("Hostname") or victim.id[:12]] = victim
            policies[victim.id] = (inspected.get("HostConfig") or {}).get("RestartPolicy") or {"Name": "no"}
            await self._api("POST", f"/containers/{victim.id}/update", json={"RestartPolicy": {"Name": "no"}})
        try:
            left = set(await drain(list(hosts)))
        except BaseException:
            for victim in victims:  # they stay: give them back their restart policy
                with contextlib.suppress(ActuatorError):
                    await self._api("POST", f"/containers/{victim.id}/update",
                                    json={"RestartPolicy": policies[victim.id]})
            raise
        for host, victim in hosts.items():
            if host not in left:
                log.warning("docker: %s (host %s) did not drain in time; stopping it (its SIGTERM drains again, "
                            "bounded by its --shutdown-timeout)", victim.name, host)
            # The container's own stop timeout applies (compose's stop_grace_period); allow for it.
            await self._api("POST", f"/containers/{victim.id}/stop", ok=(204, 304), timeout_s=self.api_timeout_s + 120)
            await self._api("DELETE", f"/containers/{victim.id}", params={"v": "1"}, ok=(204, 404))
            log.info("docker: removed %s", victim.name)

    async def close(self) -> None:
        await self._http.aclose()
