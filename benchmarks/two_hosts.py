"""Two "hosts" on one machine: network namespaces with a private /dev/shm each, joined by a veth
link, a clustered nats-server on each, tandem services on either.

``tests/e2e/test_two_hosts.py`` and ``benchmarks/kv_across_hosts.py`` both build their setup with
it; it lives here, beside the benchmark that users run, because a script under benchmarks/ should
not reach into tests/, while a test may load a module by path.

A host is a holder process (``sleep``) that unshare(1) put into new network, mount and UTS
namespaces, with a fresh tmpfs mounted on /dev/shm inside. :func:`tandem.shared.kvtransfer.ring.host_id`
is boot id + /dev/shm's device + pid namespace, so the private tmpfs makes the two hosts' ids
differ honestly: a ring made on one host is not there on the other, whatever the code tried. Every
other process of a host (nats-server, ``tandem serve``, the client) joins the holder's namespaces
with nsenter(1). The hosts share the kernel, the pid namespace and the disk (so the model and the
logs), not the network, the hostname or /dev/shm.

The hosts' only link is a veth pair (``to-b`` on A, ``to-a`` on B) on a private subnet that exists
in those two namespaces alone, so no address can collide with the machine's. Each host's
nats-server listens for clients on its own 127.0.0.1 and for routes on its veth address, port 6222
(free in a fresh namespace), routing to the other: a message between the hosts crosses the veth.
Requires root (CAP_SYS_ADMIN and CAP_NET_ADMIN): :func:`namespaces_unavailable` says why not.

Run as a script, this file is the agent that runs inside a host (``nats``: a clustered server
until stdin closes; ``ready``: wait for services; ``client``: requests and what the bus said about
them, as JSON)::

    with TwoHosts.make(Path("/tmp/two")) as hosts:
        nats_a, nats_b = hosts.start_nats()
        hosts.serve(hosts.a, "router", "router-a", nats_a.url, [], env)
        ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.shared.infra.natsserver import die_with_parent

ROUTE_PORT = 6222
SUBNET = "10.251.0"  # only inside the two namespaces
AGENT = str(Path(__file__).resolve())


class HostsError(RuntimeError):
    """The two hosts could not be built or a step on them failed; the message is one line."""


def namespaces_unavailable() -> str | None:
    """Why two hosts cannot be made here (one line), or None when they can."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--",
         "sh", "-c", "mount -t tmpfs tandem-probe /dev/shm && ip link add p0 type veth peer name p1"],
        capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        lines = (probe.stderr or probe.stdout).strip().splitlines() or [f"exit code {probe.returncode}"]
        return f"cannot make network and mount namespaces: {lines[-1]}"
    return None


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _read_json_line(proc: subprocess.Popen, timeout_s: float, what: str) -> dict[str, Any]:
    """The next JSON line ``proc`` prints; :class:`HostsError` if it exits or stays silent.
    ``proc.stdout`` must be unbuffered (``bufsize=0``): a buffer could hold the next line where
    select cannot see it."""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(min(0.5, max(0.0, deadline - time.monotonic()))):
                line = proc.stdout.readline()
                if not line:
                    break
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue  # not ours: something the agent's imports printed
    if proc.poll() is None:
        raise HostsError(f"{what}: nothing within {timeout_s:.0f}s")
    raise HostsError(f"{what}: exited with code {proc.wait()}")


@dataclass
class Host:
    """One host: the holder process whose namespaces every process of the host joins."""

    name: str
    ip: str
    holder: subprocess.Popen

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this host, in the caller's working directory (nsenter would start in /)."""
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--uts", f"--wd={os.getcwd()}",
                "--", *cmd]

    def popen(self, cmd: Sequence[str], *, env: dict[str, str] | None = None, stdout: Any = subprocess.DEVNULL,
              stdin: Any = subprocess.DEVNULL) -> subprocess.Popen:
        # nsenter execs the command (no pid namespace, no fork), so the pid is the command's, and
        # die_with_parent's signal survives the exec: nothing outlives a killed test or benchmark.
        return subprocess.Popen(self.argv(cmd), env=env, stdout=stdout, stderr=subprocess.STDOUT, stdin=stdin,
                                preexec_fn=die_with_parent)

    def run(self, cmd: Sequence[str], timeout_s: float = 30.0) -> str:
        """``cmd``'s output; :class:`HostsError` with its last line when it fails."""
        done = subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise HostsError(f"{self.name}: {' '.join(cmd)}: {_one_line(done.stderr or done.stdout)}")
        return done.stdout

    def shm_files(self) -> list[str]:
        return self.run(["ls", "-1", "/dev/shm"]).split()

    def link_bytes(self, dev: str) -> tuple[int, int]:
        """(received, sent) bytes of a network device of this host."""
        (link,) = json.loads(self.run(["ip", "-j", "-s", "link", "show", "dev", dev]))
        return int(link["stats64"]["rx"]["bytes"]), int(link["stats64"]["tx"]["bytes"])


@dataclass
class NatsOnHost:
    """A clustered nats-server that the agent started on a host (stdin closed: it stops)."""

    host: Host
    agent: subprocess.Popen
    url: str
    cluster_url: str
    log: Path
    routes: list[dict[str, Any]] = field(default_factory=list)  # /routez's, once clustered

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.agent.poll() is None:
            self.agent.stdin.close()
            try:
                self.agent.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()


class TwoHosts:
    """Hosts ``a`` and ``b``, linked; every process started through it is stopped by :meth:`close`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.hosts: list[Host] = []
        self.nats: list[NatsOnHost] = []
        self.services: dict[str, tuple[Host, subprocess.Popen]] = {}
        self.linked = False
        self.jobs = 0
        self.netns: set[int] = set()  # the hosts' network namespaces, by inode: for leftovers()

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    @classmethod
    def make(cls, workdir: Path) -> TwoHosts:
        """Both hosts and the link between them; on any failure what was made is removed again."""
        workdir.mkdir(parents=True, exist_ok=True)
        hosts = cls(workdir)
        try:
            for i, name in enumerate(("host-a", "host-b")):
                hosts._holder(f"tandem-{name}", f"{SUBNET}.{i + 1}")
            a, b = hosts.hosts
            # Made inside A with its peer put straight into B: the pair never exists in the
            # machine's own namespace, so nothing there can collide with it or be left behind.
            a.run(["ip", "link", "add", "to-b", "type", "veth", "peer", "name", "to-a", "netns", str(b.holder.pid)])
            hosts.linked = True
            for host, dev in ((a, "to-b"), (b, "to-a")):
                host.run(["ip", "addr", "add", f"{host.ip}/24", "dev", dev])
                host.run(["ip", "link", "set", dev, "up"])
        except BaseException:
            hosts.close()
            raise
        print(f"two hosts: {a.name} ({a.ip}, holder pid {a.holder.pid}) <-veth-> {b.name} ({b.ip}, holder pid "
              f"{b.holder.pid}), each with its own /dev/shm", flush=True)
        return hosts

    def _holder(self, name: str, ip: str) -> Host:
        script = (f"mount -t tmpfs -o mode=1777 tandem-shm /dev/shm && ip link set lo up && hostname {name} "
                  "&& echo '{}' && exec sleep infinity")
        holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, bufsize=0,
            preexec_fn=lambda: die_with_parent(signal.SIGKILL))
        host = Host(name, ip, holder)
        self.hosts.append(host)  # for close(), whatever happens next
        try:
            _read_json_line(holder, 30, f"{name}'s namespaces")
        except HostsError:
            holder.kill()
            holder.wait()
            raise HostsError(f"{name}: {_one_line(holder.stderr.read().decode(errors='replace'))}") from None
        self.netns.add(os.stat(f"/proc/{holder.pid}/ns/net").st_ino)
        return host

    def start_nats(self, timeout_s: float = 60.0) -> tuple[NatsOnHost, NatsOnHost]:
        """A nats-server on each host, routed to each other; returns once the route is up and
        JetStream's cluster has a leader (services create their streams at start)."""
        routes = [f"nats-route://{host.ip}:{ROUTE_PORT}" for host in self.hosts]
        for host in self.hosts:
            log = self.workdir / f"nats-{host.name}.agent.log"
            cmd = [sys.executable, AGENT, "nats", "--ip", host.ip, "--server-name", host.name,
                   "--workdir", str(self.workdir / f"nats-{host.name}")]
            cmd += [arg for route in routes for arg in ("--route", route)]
            agent = subprocess.Popen(host.argv(cmd), stdout=subprocess.PIPE, stderr=open(log, "wb"),
                                     stdin=subprocess.PIPE, bufsize=0, preexec_fn=die_with_parent)
            try:
                started = _read_json_line(agent, timeout_s, f"nats-server on {host.name} (log: {log})")
            except HostsError:
                agent.kill()
                agent.wait()
                raise
            self.nats.append(NatsOnHost(host, agent, started["url"], started["cluster_url"], log))
            print(f"{host.name}: nats-server at {started['url']} (inside {host.name}), routes on "
                  f"{started['cluster_url']}", flush=True)
        for server in self.nats:
            server.routes = _read_json_line(server.agent, timeout_s, f"cluster route from {server.host.name} "
                                                                     f"(log: {server.log})")["routes"]
        print("nats cluster up: " + "; ".join(
            f"{s.host.name} routes to {sorted({r['ip'] for r in s.routes})}" for s in self.nats), flush=True)
        return self.nats[0], self.nats[1]

    def serve(self, host: Host, service: str, instance_id: str, url: str, args: Sequence[str],
              env: dict[str, str]) -> subprocess.Popen:
        """``tandem serve <service>`` on ``host`` against ``url`` (its host's server), logging to
        ``<workdir>/<instance_id>.log``."""
        cmd = [sys.executable, "-m", "tandem", "serve", service, "--nats-url", url, "--instance-id", instance_id,
               *args]
        proc = host.popen(cmd, env=env, stdout=open(self.workdir / f"{instance_id}.log", "wb"))
        self.services[instance_id] = (host, proc)
        return proc

    def check_alive(self) -> None:
        dead = {name: proc.returncode for name, (_, proc) in self.services.items() if proc.poll() is not None}
        if dead:
            raise HostsError(f"service processes exited: {dead} (logs in {self.workdir})")

    def stop_service(self, instance_id: str, timeout_s: float = 30.0) -> None:
        _, proc = self.services.pop(instance_id)
        _stop([proc], timeout_s)

    def agent(self, host: Host, command: str, url: str, job: dict[str, Any], env: dict[str, str],
              timeout_s: float) -> dict[str, Any]:
        """Run the agent's ``ready`` or ``client`` command on ``host`` against ``url``: its JSON
        answer. Its progress goes to the terminal; a service dying meanwhile fails it at once."""
        self.jobs += 1
        job_file = self.workdir / f"job-{self.jobs}.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.Popen(host.argv([sys.executable, AGENT, command, "--url", url, "--job", str(job_file)]),
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None, bufsize=0,
                                preexec_fn=die_with_parent)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    answer = _read_json_line(proc, 1.0, f"{command} on {host.name}")
                    break
                except HostsError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise
                    self.check_alive()
            if "error" in answer:
                raise HostsError(f"{command} on {host.name}: {answer['error']}")
            return answer
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def logs(self, tail_chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail_chars:]}"
                         for p in sorted(self.workdir.glob("*.log")))

    def close(self) -> None:
        """Stop every service, then the servers, then remove the link and the hosts. Safe to call
        twice; never raises, so a test's teardown always gets to the namespaces."""
        _stop([proc for _, proc in self.services.values()], 30.0)
        self.services.clear()
        for server in self.nats:
            try:
                server.stop()
            except Exception as exc:
                print(f"stopping nats-server on {server.host.name}: {exc}", file=sys.stderr)
        self.nats.clear()
        if self.linked:  # deleting one end deletes the pair
            try:
                self.a.run(["ip", "link", "del", "to-b"])
            except Exception as exc:
                print(f"removing the veth link: {exc}", file=sys.stderr)
            self.linked = False
        for host in self.hosts:  # the namespaces (and the tmpfs on /dev/shm) go with their last process
            if host.holder.poll() is None:
                host.holder.kill()
            host.holder.wait()
        self.hosts.clear()

    def leftovers(self) -> list[int]:
        """Pids still inside the hosts' network namespaces: none once :meth:`close` returned (the
        namespaces, their veth ends and tmpfs go with their last process)."""
        inside = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.stat(entry / "ns" / "net").st_ino in self.netns:
                        inside.append(int(entry.name))
                except OSError:
                    pass  # gone meanwhile, or a kernel thread
        return inside

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM all at once (each drains in parallel), then SIGKILL what is still there."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the agent: runs inside a host ----------------------------------------------------------------


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _agent_nats(args: argparse.Namespace) -> None:
    """Start a clustered server, say where it listens, say once it is routed and JetStream is
    healthy, then hold it until stdin closes."""
    from tandem.shared.infra.natsserver import Cluster, NatsServer

    cluster = Cluster(routes=tuple(args.route), host=args.ip, port=ROUTE_PORT, server_name=args.server_name)
    # Its monitoring port, on a free port, tells when the routes are up and JetStream is healthy.
    server = NatsServer.start(workdir=Path(args.workdir), cluster=cluster, monitor_port=0)
    try:
        _say({"url": server.url, "cluster_url": server.cluster_url})
        monitor = f"http://127.0.0.1:{server.monitor_port}"
        deadline, routes = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            routes = json.loads(urllib.request.urlopen(f"{monitor}/routez", timeout=5).read()).get("routes") or []
            try:  # 200 only once JetStream's meta group has a leader
                healthy = urllib.request.urlopen(f"{monitor}/healthz", timeout=5).status == 200
            except OSError:
                healthy = False
            if routes and healthy:
                break
            time.sleep(0.2)
        else:
            raise SystemExit(f"no route or no JetStream leader after 60 s (routes: {len(routes)})")
        _say({"routes": [{"ip": r.get("ip"), "port": r.get("port"), "remote": r.get("remote_name")} for r in routes]})
        sys.stdin.read()  # until the parent closes it (or dies)
    finally:
        server.stop()


async def _agent_ready(url: str, job: dict[str, Any]) -> dict[str, Any]:
    from tandem.cli.supervisor import wait_until_ready

    await wait_until_ready(url, job["want"], lambda: None, job.get("timeout_s", 120))
    return {"ready": job["want"]}


async def _agent_client(url: str, job: dict[str, Any]) -> dict[str, Any]:
    """Send ``job["requests"]`` one at a time (greedy), collecting the KV transfer events and the
    workers' heartbeats; returns each request's tokens with its transfers, and the last beats."""
    import nats

    from tandem.client import connect
    from tandem.shared.kvtransfer.ring import host_id
    from tandem.shared.protocol import subjects
    from tandem.shared.protocol.codec import decode
    from tandem.shared.protocol.fleet import Heartbeat
    from tandem.shared.protocol.views import KVTransferEvent

    nc = await nats.connect(url)
    transfers: list[dict[str, Any]] = []
    beats: dict[str, dict[str, Any]] = {}

    async def on_transfer(msg) -> None:
        transfers.append(decode(msg.data, KVTransferEvent).model_dump())

    async def on_beat(msg) -> None:
        beat = decode(msg.data, Heartbeat)
        beats[beat.instance_id] = beat.model_dump()

    await nc.subscribe(subjects.KV_TRANSFERS, cb=on_transfer)
    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
    await nc.flush()
    results = []
    async with connect(url) as client:
        for i, req in enumerate(job["requests"]):
            done = await client.complete(req["prompt"], max_tokens=req["max_tokens"], temperature=0.0,
                                         ignore_eos=True)
            results.append({"request_id": done.request_id, "token_ids": done.token_ids, "text": done.text,
                            "prompt_tokens": len(done.prompt_token_ids), "decode_worker": done.decode_worker,
                            "prefill_worker": done.prefill_worker, "finish_reason": done.finish_reason})
            print(f"  request {i + 1}/{len(job['requests'])}: {len(done.prompt_token_ids)} prompt tokens, "
                  f"{len(done.token_ids)} out, prefill {done.prefill_worker} -> decode {done.decode_worker}",
                  file=sys.stderr, flush=True)

    def mine(result: dict[str, Any]) -> list[dict[str, Any]]:  # a placement's id starts with its request's
        return [t for t in transfers if t["request_id"].startswith(result["request_id"]) and t["path"] != "store"]

    # Events and heartbeats come on other connections than the tokens: wait for them to catch up.
    deadline = time.monotonic() + 10
    decoders = {r["decode_worker"] for r in results}

    def counted() -> int:
        return sum(beats.get(d, {}).get("kv_transfers_ring", 0) + beats.get(d, {}).get("kv_transfers_nats", 0)
                   for d in decoders)

    while time.monotonic() < deadline and (not all(mine(r) for r in results) or counted() < len(results)):
        await asyncio.sleep(0.1)
    for result in results:
        result["transfers"] = mine(result)
    await nc.close()
    return {"results": results, "heartbeats": beats, "host_id": host_id()}


def main() -> None:
    p = argparse.ArgumentParser(description="the agent that runs inside one of the two hosts")
    sub = p.add_subparsers(dest="command", required=True)
    n = sub.add_parser("nats", help="a clustered nats-server until stdin closes")
    n.add_argument("--ip", required=True)
    n.add_argument("--server-name", required=True)
    n.add_argument("--workdir", required=True)
    n.add_argument("--route", action="append", default=[])
    for name in ("ready", "client"):
        agent = sub.add_parser(name, help=f"{name}: a JSON job from a file, a JSON answer on stdout")
        agent.add_argument("--url", required=True)
        agent.add_argument("--job", required=True, help="the job's JSON file")
    args = p.parse_args()
    if args.command == "nats":
        _agent_nats(args)
        return
    job = json.loads(Path(args.job).read_text())
    run = _agent_ready if args.command == "ready" else _agent_client
    try:
        _say(asyncio.run(run(args.url, job)))
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
