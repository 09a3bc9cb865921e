"""``tandem up``: the whole system on one machine, each service its own OS process.

Starts an embedded nats-server (unless given a URL; on ``--port`` if given), then KV-stores, decode
and prefill workers, a router and (for ``tandem up``) the HTTP frontend as child processes, waits
until every one answers ``$SRV.PING`` (``--planner`` starts the planner then, once it can count the
workers), reads every URL the children serve from their ``$SRV.INFO`` metadata (``metrics_url``,
the frontend's ``http_url``) and writes them to the state file (:mod:`tandem.client.runstate`) so
``tandem generate``, the console and a Prometheus scrape config find them. While it runs,
:mod:`tandem.cli.scaling` keeps the wanted number of each service alive: it restarts a child that
crashed, and with the planner on it carries out the planner's decisions within
``--min/--max-prefill`` and ``--min/--max-decode``, draining a worker before it goes; and it
restarts the embedded nats-server in place if that dies (:meth:`Supervisor.ensure_server`). At the
end :mod:`tandem.cli.shutdown` drains the system, then :meth:`Supervisor.stop` stops what is left (the
server last) and removes the state file and the server's folder. Children die with it even if it
is killed with SIGKILL (Linux PDEATHSIG: SIGHUP, which a service takes as "stop at once"). GPUs:
see :mod:`tandem.cli.gpus`.

Ports a client may hold stay the same across restarts. The frontend's HTTP port: with ``--http-port
0`` the first frontend takes a free port, and every later one (a crashed one restarted, a hung one
replaced) is started on that same port, so a client holding the URL finds it again; a replacement
waits until the port can be listened on (the one it replaces may still be leaving) rather than
crash on it. Metrics ports: ``--metrics-port 0`` gives every child a free port, ``-1`` none, and
``N`` is a base: the i-th child in start order gets ``N + i``, since one fixed port cannot serve
several children. A restarted child takes the lowest slot free again and that slot's port (``N``
plus the slot; with ``0``, the port the slot's previous child got, unless something else took it
meanwhile), so its URL stays the same.

The embedded nats-server's HTTP monitoring port is off unless ``--nats-monitor-port`` asks for it:
it has no authentication, and it lists every connection and subscription to any user of the host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats

from tandem.cli.flags import SERVICE_SETTINGS, argv
from tandem.cli.gpus import memory_share, pick_gpus, visible_gpus
from tandem.client.access import bus_options
from tandem.client.discovery import service_infos, service_pongs
from tandem.client.runstate import RunState, remove_state, state_file, write_state
from tandem.shared.auth.credentials import connect_options
from tandem.shared.auth.keyring import Keyring, private_folder, write_private
from tandem.shared.auth.roles import role_for_service
from tandem.shared.infra.config import Settings
from tandem.shared.infra.natsserver import NatsServer, NatsServerError, die_with_parent
from tandem.shared.protocol import subjects

log = logging.getLogger("tandem.cli.up")

SERVICE_ORDER = ("frontend", "planner", "router", "prefill", "decode", "kvstore")  # stop order
STOP_STAGES = (("frontend",), ("planner", "router"), ("prefill", "decode"), ("kvstore",))  # SERVICE_ORDER, in steps
START_ORDER = ("kvstore", "decode", "prefill", "router", "frontend", "planner")
ENGINE_SERVICES = ("prefill", "decode")
SILENT = ("router", "frontend")  # they answer $SRV.PING but publish no heartbeats
AT_ONCE_KILL_AFTER_S = 3.0  # a stop at once: SIGKILL for what has not left this long after SIGHUP
SERVER_RETRY_S = 1.0  # between attempts to restart a dead nats-server
# A child whose parent dies gets SIGHUP: it stops at once (no one is left to drain for), not a drain.
CHILD_PREEXEC = functools.partial(die_with_parent, signal.SIGHUP)
NATS_HOST = "127.0.0.1"  # where the embedded server listens (natsserver's config)
# Settings the supervisor decides for each child itself (so a value given to `up` is not handed on as is).
DECIDED_HERE = ("nats_url", "nats_creds", "nats_binary", "model", "log_level", "instance_id", "data_dir",
                "torch_threads", "gpu_memory_utilization", "tensor_parallel_size", "metrics_port",
                "planner_min_prefill", "planner_max_prefill", "planner_min_decode", "planner_max_decode")


@dataclass
class Child:
    service: str
    process: subprocess.Popen
    instance_id: str
    gpus: tuple[int, ...] = ()  # indices into the supervisor's GPU list, one per rank (none: all visible)
    metrics_slot: int = 0  # its metrics port is the base plus this (with a fixed --metrics-port)
    draining_since: float | None = None  # monotonic time a drain was asked
    stop_sent: float | None = None  # monotonic time SIGTERM went out
    kill_after_s: float | None = None  # SIGKILL this long after SIGTERM (None: the scaler's default)

    @property
    def leaving(self) -> bool:
        return self.draining_since is not None or self.stop_sent is not None


class UsageError(ValueError):
    """A setting given to ``tandem up`` that cannot work; the message is one line naming the flag."""


@dataclass
class Supervisor:
    settings: Settings
    num_prefill: int = 1
    num_decode: int = 1
    num_kvstore: int = 0
    prefill_ranks: int = 1  # each worker's tensor-parallel size (its GPUs)
    decode_ranks: int = 1
    # Settings given as flags to `up` (flat name -> value): each child gets those of its service's sections.
    overrides: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)  # more flags for the engine workers
    planner: bool = False
    min_prefill: int | None = None  # limits for the planner's decisions (default: see limits())
    max_prefill: int | None = None
    min_decode: int | None = None
    max_decode: int | None = None
    children: list[Child] = field(default_factory=list)
    server: NatsServer | None = None
    url: str = ""
    wanted: dict[str, int] = field(default_factory=dict)
    gpus: list[str] | None = None  # CUDA ids handed out one per worker (None: detect at start)
    stop_requested: bool = False  # set by up's signal handler; every loop here ends on it
    stop_now: bool = False  # a second stop signal: no more draining
    server_retry_at: float = 0.0  # monotonic time of the next restart attempt of a dead server
    frontend: bool = False  # one HTTP frontend too (tandem up; the benchmarks talk NATS and need none)
    nats_workdir: Path | None = None  # the embedded server's folder (None: a temporary one)
    http_url: str = ""  # the frontend's, from its $SRV.INFO metadata
    http_port: int = 0  # the port the first frontend got: every later one is started on it (0: none yet)
    slot_ports: dict[int, int] = field(default_factory=dict)  # with --metrics-port 0: metrics slot -> port it got
    metrics_urls: dict[str, str] = field(default_factory=dict)  # instance id -> /metrics, likewise
    state: RunState | None = None  # as last written to the state file (None: not written)
    keyring: Keyring | None = None  # the embedded server's identities (None: --insecure or --nats-url)
    creds_dir: Path | None = None  # each child's own user credentials, minted here (None: no keyring)

    def limits(self, service: str) -> tuple[int, int]:
        """(min, max) workers of ``service``: as given, else ``min(1, count)`` .. ``max(count, 2)``."""
        count = self.num_prefill if service == "prefill" else self.num_decode
        lo = self.min_prefill if service == "prefill" else self.min_decode
        hi = self.max_prefill if service == "prefill" else self.max_decode
        lo = min(1, count) if lo is None else lo
        hi = max(count, 2) if hi is None else hi
        return lo, max(lo, hi)

    def start(self) -> None:
        if self.settings.bus.nats_url:
            self.url = self.settings.bus.nats_url
        else:
            if not self.settings.supervisor.insecure:
                self.keyring = Keyring.generate()
            self.server = NatsServer.start(binary=self.settings.supervisor.nats_binary,
                                           port=self.settings.supervisor.nats_port, workdir=self.nats_workdir,
                                           auth_config=self.keyring.server_config() if self.keyring else "",
                                           monitor_port=self.settings.supervisor.nats_monitor_port)
            self.url = self.server.url
            if self.keyring is not None:
                self.creds_dir = private_folder(self.server.workdir / "auth")
        if self.gpus is None:
            self.gpus = visible_gpus(self.settings.engine.device)
        self.wanted = {"kvstore": self.num_kvstore, "decode": self.num_decode, "prefill": self.num_prefill,
                       "router": 1, "frontend": int(self.frontend), "planner": int(self.planner)}
        for service in START_ORDER:
            if service != "planner":  # started by wait_ready() once the workers are up: it counts them
                for _ in range(self.wanted[service]):
                    self.spawn(service)

    def own_connect_options(self, name: str) -> dict[str, Any]:
        """``nats.connect`` options for up's own connections: the operator's identity (with
        ``--nats-url``, the credentials given with ``--creds``, as the children get them)."""
        if self.keyring is not None:
            return connect_options(self.keyring.role_key("operator"), name)
        bus = self.settings.bus
        return bus_options("operator", name, self.url, creds=bus.nats_creds, tls_ca=bus.tls_ca,
                           tls_cert=bus.tls_cert, tls_key=bus.tls_key)

    def client_creds(self) -> str | None:
        """The credentials file a client of this system connects with: the client role's key, as
        the state file holds it (a client's every connection mints its own user); with
        ``--nats-url``, whatever ``--creds`` gave."""
        if self.creds_dir is None or self.keyring is None:
            return self.settings.bus.nats_creds
        path = self.creds_dir / "client.key"
        if not path.exists():
            write_private(path, self.keyring.role_key("client").to_text())
        return str(path)

    def most_children(self) -> int:
        """The most children alive at once (so the most metrics ports taken)."""
        return (self.num_kvstore + self.most_workers("prefill") + self.most_workers("decode") + 1 + int(self.frontend)
                + int(self.planner))

    def pinned_ports(self) -> list[tuple[str, str, int]]:
        """(flag, host, port) of every fixed port the system will listen on."""
        pinned = []
        if not self.settings.bus.nats_url and self.settings.supervisor.nats_port:
            pinned.append(("--port", NATS_HOST, self.settings.supervisor.nats_port))
        if not self.settings.bus.nats_url and self.settings.supervisor.nats_monitor_port > 0:
            pinned.append(("--nats-monitor-port", NATS_HOST, self.settings.supervisor.nats_monitor_port))
        if self.frontend and self.settings.frontend.port:
            pinned.append(("--http-port", self.settings.frontend.host, self.settings.frontend.port))
        if self.settings.metrics.port > 0:
            pinned += [("--metrics-port", self.settings.metrics.host, self.settings.metrics.port + i)
                       for i in range(self.most_children())]
        return pinned

    def check_ports(self) -> None:
        """Raise :class:`UsageError` naming the flag if a fixed port cannot be listened on, before
        anything starts: a child that cannot bind its port would only crash and restart forever."""
        base = self.settings.metrics.port
        if base > 0 and base + self.most_children() - 1 > 65535:
            raise UsageError(f"--metrics-port {base}: the children take ports {base}..{base + self.most_children() - 1}"
                             ", past 65535; pick a lower base (0: free ports, -1: none)")
        held: list[socket.socket] = []
        try:
            for flag, host, port in self.pinned_ports():
                try:
                    held.append(listen_on(host, port))
                except OSError as exc:
                    given = base if flag == "--metrics-port" else port
                    which = f" (child {port - base} in start order)" if flag == "--metrics-port" else ""
                    hint = {"--port": "pick another port (0: a free one), or --nats-url to use a running server",
                            "--nats-monitor-port": "pick another port (0: a free one, -1: none)",
                            "--http-port": "pick another port (0: a free one)",
                            "--metrics-port": "pick another base (0: free ports, -1: none)"}[flag]
                    raise UsageError(f"{flag} {given}: cannot listen on {host}:{port}{which}: "
                                     f"{exc.strerror or exc}; {hint}") from None
        finally:
            for sock in held:
                sock.close()

    def worker_threads(self) -> int:
        """CPU threads per engine worker: the machine's cores shared out, so workers on one host do
        not oversubscribe the cores (torch's default gives every process all of them)."""
        if self.settings.engine.torch_threads:
            return self.settings.engine.torch_threads
        ranks = self.num_prefill * self.prefill_ranks + self.num_decode * self.decode_ranks
        return max(1, (os.cpu_count() or 1) // max(1, ranks))

    def ranks(self, service: str) -> int:
        """The tensor-parallel size of a ``service`` worker (1: one device)."""
        return {"prefill": self.prefill_ranks, "decode": self.decode_ranks}.get(service, 1)

    def most_workers(self, service: str) -> int:
        count = self.num_prefill if service == "prefill" else self.num_decode
        return self.limits(service)[1] if self.planner else count

    def metrics_port(self, slot: int) -> int:
        """A child's ``--metrics-port``: -1 (none) as given, a fixed base plus its slot, and with 0 the
        port the slot's previous child got while it can still be listened on (else 0: a free one; a
        worker that cannot bind its metrics port would crash, and a crash costs it its model load)."""
        base = self.settings.metrics.port
        if base > 0:
            return base + slot
        kept = self.slot_ports.get(slot) if base == 0 else None
        if kept is None:
            return base
        if not can_listen(self.settings.metrics.host, kept):
            log.warning("metrics port %d (slot %d) is taken by another process; the new child gets a free one",
                        kept, slot)
            del self.slot_ports[slot]
            return 0
        return kept

    def fixed_http_port(self) -> int:
        """The port every frontend is started on: ``--http-port`` if fixed, else the first one's (0: not known yet)."""
        return self.settings.frontend.port or self.http_port

    def port_in_use(self, service: str) -> int | None:
        """The fixed port a new ``service`` child would listen on, when something still listens there
        (the child it replaces, still leaving); None when it may start now."""
        if service != "frontend":
            return None
        port = self.fixed_http_port()
        if port and not can_listen(self.settings.frontend.host, port):
            return port
        return None

    def free_slot(self) -> int:
        """The lowest metrics slot no child holds (a child still leaving holds its port until it exits)."""
        taken = {c.metrics_slot for c in self.children}
        return next(i for i in itertools.count() if i not in taken)

    def child_creds(self, service: str, instance_id: str) -> str | None:
        """The credentials a child connects with: a user of its service's role named after its
        instance id, minted here, so it may act under that id only (it holds no role key to mint
        another); with ``--nats-url``, whatever ``--creds`` gave."""
        if self.creds_dir is None or self.keyring is None:
            return self.settings.bus.nats_creds
        return str(self.keyring.write_user(self.creds_dir, role_for_service(service), instance_id))

    def forget(self, child: Child) -> None:
        """A child has exited: its credentials go (a replacement gets its own, under a new id)."""
        if self.creds_dir is not None:
            (self.creds_dir / f"{child.instance_id}.creds").unlink(missing_ok=True)

    def command(self, service: str, instance_id: str, slot: int = 0) -> list[str]:
        """The command line of a ``service`` child: the flags given to `up` that its service takes,
        and what the supervisor decides per child (URL, id, threads, GPU share, metrics port, limits)."""
        specs = SERVICE_SETTINGS[service]
        decided = {"nats_url": self.url, "model": self.settings.model, "log_level": self.settings.log_level,
                   "instance_id": instance_id, "metrics_port": self.metrics_port(slot),
                   "nats_creds": self.child_creds(service, instance_id)}
        skip = DECIDED_HERE
        if service == "frontend" and self.fixed_http_port():
            decided["http_port"] = self.fixed_http_port()
            skip = (*DECIDED_HERE, "http_port")
        cmd = [sys.executable, "-m", "tandem", "serve", service, *argv(decided, *specs)]
        cmd += argv(self.overrides, *specs, skip=skip)
        if service == "planner":
            limits = {}
            for kind in ENGINE_SERVICES:
                limits[f"planner_min_{kind}"], limits[f"planner_max_{kind}"] = self.limits(kind)
            cmd += argv(limits, "planner")
        elif service in ENGINE_SERVICES:
            share = memory_share(self.settings.engine.gpu_memory_utilization, service, len(self.gpus or []),
                                 self.most_workers("prefill") * self.prefill_ranks,
                                 self.most_workers("decode") * self.decode_ranks)
            cmd += argv({"torch_threads": self.worker_threads()}, "engine") + self.extra_args
            cmd += argv({"gpu_memory_utilization": f"{share:.4f}",
                         "tensor_parallel_size": self.ranks(service)}, "engine")
        return cmd

    def spawn(self, service: str) -> Child:
        host = socket.gethostname().split(".")[0].replace("_", "-")[:24] or "host"
        instance_id = f"{service}-{host}-{uuid.uuid4().hex[:6]}"
        slot = self.free_slot()
        cmd = self.command(service, instance_id, slot)
        env = dict(os.environ, TANDEM_DATA_DIR=str(self.settings.data_dir), PYTHONUNBUFFERED="1")
        env.pop("TANDEM_INSTANCE_ID", None)
        chosen: list[int] = []
        if service in ENGINE_SERVICES:
            gpus = self.gpus or []
            if len(gpus) >= 2:
                occupancy = [sum(g in c.gpus for c in self.children) for g in range(len(gpus))]
                chosen = pick_gpus(len(gpus), occupancy, service, self.ranks(service))
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[g] for g in chosen)
        process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=CHILD_PREEXEC)
        child = Child(service, process, instance_id, tuple(chosen), slot)
        self.children.append(child)
        where = (f" on GPU{'s' if len(chosen) > 1 else ''} {','.join(self.gpus[g] for g in chosen)}"
                 if chosen else "")
        log.info("started %s %s (pid %d)%s", service, instance_id, process.pid, where)
        return child

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until every child answers ``$SRV.PING`` and the router has heard from every worker; then
        the planner (it counts the workers when it starts) and every child's URLs."""
        want = {s: [c.instance_id for c in self.children if c.service == s] for s in SERVICE_ORDER}
        options = self.own_connect_options("tandem-up")
        await wait_until_ready(self.url, want, self.check_children, timeout_s, options)
        if self.wanted.get("planner") and not any(c.service == "planner" for c in self.children):
            self.spawn("planner")
            planners = [c.instance_id for c in self.children if c.service == "planner"]
            await wait_until_ready(self.url, {"planner": planners}, self.check_children, timeout_s, options)
        nc = await nats.connect(self.url, **options)
        try:
            missing = await self.read_urls(nc)
            deadline = time.monotonic() + 10.0
            while missing and time.monotonic() < deadline:  # each answered PING: INFO follows at once
                await asyncio.sleep(0.25)
                missing = await self.read_urls(nc)
        finally:
            await nc.close()
        if missing:
            log.warning("no URL from %s in $SRV.INFO: left out of the state file", ", ".join(missing))

    async def read_urls(self, nc: nats.NATS) -> list[str]:
        """Set :attr:`http_url` and :attr:`metrics_urls` from the live children's ``$SRV.INFO``
        metadata; returns the instance ids whose URLs are not there yet (empty: all read)."""
        infos = await service_infos(nc)
        metadata = {m.get("instance_id"): m for m in (i.get("metadata") for i in infos) if isinstance(m, dict)}
        missing, metrics, http = [], {}, ""
        for child in self.children:
            if child.process.poll() is not None:
                continue
            meta = metadata.get(child.instance_id, {})
            if meta.get("metrics_url"):
                metrics[child.instance_id] = meta["metrics_url"]
                port = url_port(meta["metrics_url"])
                if self.settings.metrics.port == 0 and port:
                    self.slot_ports[child.metrics_slot] = port
            elif self.settings.metrics.port != -1:
                missing.append(child.instance_id)
            if child.service == "frontend":
                if meta.get("http_url"):
                    http = meta["http_url"]
                    self.http_port = self.http_port or url_port(http) or 0
                elif child.instance_id not in missing:
                    missing.append(child.instance_id)
        self.metrics_urls, self.http_url = metrics, http
        return missing

    def url_lines(self) -> list[str]:
        """Every URL but NATS and HTTP (those are on the ready line), one line each, for the terminal."""
        lines = [f"  metrics: {instance} {url}" for instance, url in self.metrics_urls.items()]
        if self.server is not None and self.server.monitor_port:
            lines.append(f"  nats monitoring: http://{NATS_HOST}:{self.server.monitor_port} (warning: no "
                         "authentication: any user of this host can list every connection and subscription on "
                         "it; --nats-monitor-port -1 turns it off)")
        lines.append(f"  state: {self.state_path()} (these URLs as JSON)")
        if self.keyring is not None:
            lines.append("  bus: identities required (anonymous connections are refused); tandem commands on this "
                         "machine use the keys in the state file, mode 0600")
        elif self.server is not None:
            lines.append("  bus: --insecure: no identities, anyone who reaches the NATS port may do anything")
        return lines

    def state_path(self) -> Path:
        return state_file(self.settings.data_dir)

    def check_children(self) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(f"{child.service} (pid {child.process.pid}) exited with code {code}")

    async def supervise(self) -> None:
        """Keep the system as wanted until cancelled (Ctrl-C): restarts, the planner's decisions."""
        from tandem.cli.scaling import Scaler

        await Scaler(self).run()

    def write_state(self) -> bool:
        """Write the state file with the URLs read last; returns whether it changed."""
        monitor = f"http://{NATS_HOST}:{self.server.monitor_port}" if self.server and self.server.monitor_port else ""
        state = RunState(pid=os.getpid(), nats_url=self.url, http_url=self.http_url,
                         metrics_urls=dict(self.metrics_urls), nats_monitor_url=monitor,
                         data_dir=str(self.settings.data_dir), keys=self.command_keys())
        if state == self.state:
            return False
        write_state(self.settings.data_dir, state)
        self.state = state
        return True

    def command_keys(self) -> dict[str, dict[str, str]]:
        """The role keys the commands that find this up connect with (see :mod:`tandem.client.access`)."""
        if self.keyring is None:
            return {}
        return {role: dataclasses.asdict(self.keyring.role_key(role)) for role in ("client", "operator")}

    def ensure_server(self) -> bool:
        """Restart the embedded nats-server in place if it died (the children reconnect by
        themselves); True when it was restarted. A failed attempt is retried a second later."""
        server = self.server
        if server is None or server.process.poll() is None or time.monotonic() < self.server_retry_at:
            return False
        old_pid, code = server.process.pid, server.process.returncode
        try:
            server.restart()
        except NatsServerError as exc:
            self.server_retry_at = time.monotonic() + SERVER_RETRY_S
            log.warning("nats-server (pid %d) exited with code %d; restarting it failed (%s), trying again in %.0fs",
                        old_pid, code, exc, SERVER_RETRY_S)
            return False
        log.warning("nats-server (pid %d) exited with code %d; restarted on %s with its JetStream store (pid %d)",
                    old_pid, code, server.url, server.process.pid)
        return True

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every child left, stage by stage (:data:`STOP_STAGES`), then the server; with
        :attr:`stop_now` (a second Ctrl-C) all at once, SIGKILL for any not gone within
        :data:`AT_ONCE_KILL_AFTER_S`. After :mod:`tandem.cli.shutdown`'s drain, only services that
        hold no requests are left."""
        groups = [[c for c in self.children if c.service in stage] for stage in STOP_STAGES]
        signum = signal.SIGTERM
        if self.stop_now:  # SIGHUP: a service's "stop at once", what it is in the middle of ends with an error
            groups, timeout_s, signum = [[c for g in groups for c in g]], AT_ONCE_KILL_AFTER_S, signal.SIGHUP
        for group in groups:
            group = [c for c in group if c.process.poll() is None]
            if group:
                log.info("stopping %s", ", ".join(f"{c.service} {c.instance_id}" for c in group))
            for child in group:
                child.process.send_signal(signum)
            deadline = time.monotonic() + timeout_s
            for child in group:
                try:
                    child.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) did not stop within %.0fs of %s; killing it", child.service,
                                child.process.pid, timeout_s, signal.Signals(signum).name)
                    child.process.kill()
                    child.process.wait()
        self.children.clear()
        if self.server is not None:
            self.server.stop()
        remove_state(self.settings.data_dir, os.getpid())


async def wait_until_ready(url: str, want: Mapping[str, int | Collection[str]], check: Callable[[], None],
                           timeout_s: float, options: dict[str, Any] | None = None) -> None:
    """Wait until the instances in ``want`` answer ``$SRV.PING`` and then until a heartbeat from each
    worker among them arrives: a router was subscribed before it answered the ping, so it has heard
    those heartbeats too and can place work (the router and the frontend send none).

    ``want[service]``: how many instances, or which (their instance ids). Give the ids wherever other
    instances of the service may be on the bus (another system's, an earlier run's): by count they
    would stand in for the new ones, and a new router that has heard no worker yet would be taken
    as ready. ``check`` raises if a child died; ``options``: ``nats.connect``'s (the identity to ask with)."""
    named = {s: set(w) for s, w in want.items() if not isinstance(w, int)}
    counts = {s: w if isinstance(w, int) else len(w) for s, w in want.items()}
    workers = sum(n for s, n in counts.items() if s not in SILENT)
    nc = await nats.connect(url, **(options or {}))
    try:
        deadline = time.monotonic() + timeout_s
        seen: dict[str, int] = {}
        while True:
            check()
            seen = await ping_services(nc, named)
            if all(seen.get(f"tandem-{s}", 0) >= n for s, n in counts.items()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"services not ready after {timeout_s:.0f}s (want {counts}, saw {seen})")
            await asyncio.sleep(0.25)
        beats = {subjects.heartbeat(s, i) for s, ids in named.items() for i in ids}
        anyone = tuple(subjects.heartbeat(s, "") for s in counts if s not in named)
        beating: set[str] = set()

        async def on_beat(msg) -> None:
            if msg.subject in beats or msg.subject.startswith(anyone):
                beating.add(msg.subject)

        sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
        while len(beating) < workers:
            check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(beating)} of {workers} workers send heartbeats")
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
    finally:
        await nc.close()


async def ping_services(nc: nats.NATS, named: Mapping[str, Collection[str]] | None = None,
                        wait_s: float = 0.3) -> dict[str, int]:
    """How many instances of each micro service answer ``$SRV.PING`` within ``wait_s``; of a service
    in ``named`` (service -> instance ids), only those instances."""
    counts: dict[str, int] = {}
    for pong in await service_pongs(nc, wait_s):
        name = pong.get("name")
        if name is None:
            continue
        ids = (named or {}).get(name.removeprefix("tandem-"))
        if ids is not None and (pong.get("metadata") or {}).get("instance_id") not in ids:
            continue
        counts[name] = counts.get(name, 0) + 1
    return counts


def url_port(url: str) -> int | None:
    """The port an ``http://HOST:PORT/...`` URL names (None: none, or not a URL)."""
    try:
        return urlsplit(url).port
    except ValueError:
        return None


def can_listen(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (as :func:`listen_on` would)."""
    try:
        listen_on(host, port).close()
    except OSError:
        return False
    return True


def listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (raises OSError where that is impossible). SO_REUSEADDR as
    the servers set it, so a port a stopped server left in TIME_WAIT counts as free, a listening one not."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock
