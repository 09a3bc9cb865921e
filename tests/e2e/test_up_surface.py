"""What ``tandem up`` shows and refuses, as a user runs it.

One ``tandem up`` (module-scoped: 1 prefill, 1 decode, no KV-store) on pinned ports (``--port``,
``--http-port``, ``--metrics-port``, chosen free here): its ready line names the NATS and HTTP URLs,
every child's metrics URL is printed (the i-th child in start order on base + i), written to the
state file and answers with a Prometheus page; a second ``up`` on the data dir is refused in one
line while the first keeps serving and keeps its state file; a killed frontend comes back on its
ports; the embedded nats-server has no monitoring port; a SIGKILLed ``up`` leaves its state file and
nats folder, which the next ``up`` removes. An ``up`` on free ports (``0`` for the HTTP, metrics and
monitoring ports) prints its monitoring port with a warning, and a killed frontend comes back on the
port the first one got. Without any ``up`` running: a bad ``--model`` and a taken port are refused
in one line before anything starts.

Run: ``python3 -m pytest -q tests/e2e/test_up_surface.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from cli_support import TANDEM, operator_options, tandem_env, wait_for

from tandem.cli.supervisor import listen_on
from tandem.client import connect
from tandem.client.discovery import service_infos

START_ORDER = ("decode", "prefill", "router", "frontend")  # with --kvstore 0
METRICS_LINE = re.compile(r"^  metrics: (\S+) (http://\S+)$", re.M)


def outside_ephemeral_ports() -> range:
    """Ports the kernel does not hand to outgoing connections: below its ephemeral range, else above it.

    The up under test binds its metrics ports only once each child is on the bus, after every child
    has opened connections of its own; a port chosen inside the ephemeral range can be taken by one of
    those connections in between (a clean-clone run here found one of its metrics ports, 38840-38843,
    already in use when the child bound it)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    below, above = range(10000, low), range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def free_ports(n: int, block: int) -> list[int]:
    """``n`` free single ports, then the base of ``block`` more: ``n + block`` consecutive ports outside
    the ephemeral range, listened on to check, then let go (the up under test takes them a moment later)."""
    ports = outside_ephemeral_ports()
    span = len(ports) - (n + block)
    assert span > 0, f"no room for {n + block} ports in {ports}"
    offset = os.getpid() * 101 % span  # runs side by side start at different places
    for step in range(0, span, n + block):
        base = ports.start + (offset + step) % span
        trial = []
        try:
            trial = [listen_on("127.0.0.1", base + i) for i in range(n + block)]
        except OSError:
            continue
        finally:
            for sock in trial:
                sock.close()
        return [base + i for i in range(n)] + [base + n]
    raise AssertionError(f"no {n + block} consecutive free ports in {ports}")


def env_for(data_dir: Path) -> dict[str, str]:
    # INFO: the refusals below must be one line even with up's own log lines on.
    return {**tandem_env(data_dir), "TANDEM_DEVICE": "cpu", "TANDEM_LOG_LEVEL": "INFO"}


@dataclass
class Up:
    proc: subprocess.Popen
    data_dir: Path
    nats_port: int
    http_port: int
    metrics_base: int
    name: str  # its output goes to <data_dir>/<name>.out and .err

    @property
    def stdout(self) -> str:
        return (self.data_dir / f"{self.name}.out").read_text()

    @property
    def stderr(self) -> str:
        return (self.data_dir / f"{self.name}.err").read_text()

    def state(self) -> dict:
        return json.loads((self.data_dir / "run" / "up.json").read_text())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)


def start_up(data_dir: Path, nats_port: int, http_port: int, metrics_base: int, name: str = "up",
             flags: list[str] | None = None) -> Up:
    """``tandem up`` on the pinned ports (or with ``flags`` instead of them), once it has printed every URL."""
    out, err = open(data_dir / f"{name}.out", "w"), open(data_dir / f"{name}.err", "w")
    if flags is None:
        flags = ["--port", str(nats_port), "--http-port", str(http_port), "--metrics-port", str(metrics_base)]
    proc = subprocess.Popen([*TANDEM, "up", "--kvstore", "0", *flags], env=env_for(data_dir), stdout=out, stderr=err)
    up = Up(proc, data_dir, nats_port, http_port, metrics_base, name)
    wait_for(lambda: "  state: " in up.stdout or proc.poll() is not None, 180, "tandem up to print its URLs")
    assert proc.poll() is None, f"tandem up exited early:\n{up.stdout}\n{up.stderr[-3000:]}"
    return up


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


def printed_metrics(up: Up) -> dict[str, str]:
    return dict(METRICS_LINE.findall(up.stdout))


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    nats_port, http_port, metrics_base = free_ports(2, len(START_ORDER))
    system = start_up(tmp_path_factory.mktemp("up-surface"), nats_port, http_port, metrics_base)
    yield system
    system.stop()


def test_the_ready_line_names_nats_and_http_on_the_pinned_ports(up):
    ready = (f"tandem up: NATS at nats://127.0.0.1:{up.nats_port}, HTTP at http://127.0.0.1:{up.http_port} "
             "(router, 1 prefill, 1 decode, 0 kvstore; planner off; Ctrl-C stops)")
    assert ready in up.stdout.splitlines(), up.stdout
    status, _, body = get(f"http://127.0.0.1:{up.http_port}/v1/models")
    assert status == 200 and json.loads(body)["data"], body
    state = up.state()
    assert (state["nats_url"], state["http_url"]) == (f"nats://127.0.0.1:{up.nats_port}",
                                                      f"http://127.0.0.1:{up.http_port}"), state


def test_every_metrics_url_is_printed_written_and_answers(up):
    printed = printed_metrics(up)
    services = [instance.split("-")[0] for instance in printed]
    assert services == list(START_ORDER), f"one line per child, in start order: {printed}"
    ports = [int(url.rsplit(":", 1)[1].split("/")[0]) for url in printed.values()]
    assert ports == [up.metrics_base + i for i in range(len(START_ORDER))], f"base + i in start order: {printed}"
    assert up.state()["metrics_urls"] == printed, "the state file's metrics URLs differ from the printed ones"
    for instance, url in printed.items():
        status, kind, page = get(url)
        assert status == 200 and kind.startswith("text/plain"), f"{instance}: {status} {kind}"
        assert "# TYPE " in page and "# HELP " in page, f"{instance}'s {url} is no Prometheus page: {page[:300]}"


async def test_a_second_up_on_the_data_dir_is_refused_and_the_first_keeps_serving(up):
    before = (up.data_dir / "run" / "up.json").read_bytes()
    state = up.state()
    second = subprocess.run([*TANDEM, "up", "--kvstore", "0"], env=env_for(up.data_dir), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 1, second.stdout + second.stderr
    assert second.stderr.splitlines() == [
        f"tandem up: already running (pid {up.proc.pid}, NATS at {state['nats_url']}, HTTP at {state['http_url']}) "
        f"on data dir {up.data_dir}; stop it first or use --data-dir"], second.stderr
    assert second.stdout == ""
    assert (up.data_dir / "run" / "up.json").read_bytes() == before, "the refused up touched the state file"
    assert up.proc.poll() is None
    async with connect(state["nats_url"], request_timeout_s=60, data_dir=str(up.data_dir)) as client:
        result = await client.complete("def add(a, b):", max_tokens=4, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == 4


async def test_a_killed_frontend_comes_back_on_its_ports(up):
    nc = await nats.connect(up.state()["nats_url"], **operator_options(up.state()["nats_url"], up.data_dir))
    try:
        (info,) = await service_infos(nc, name="tandem-frontend")
        old_id = info["metadata"]["instance_id"]
        os.kill(int(info["metadata"]["pid"]), signal.SIGKILL)
        wait_for(lambda: old_id not in up.state()["metrics_urls"] and any(
            i.startswith("frontend-") for i in up.state()["metrics_urls"]), 60, "the restarted frontend's URLs")
    finally:
        await nc.close()
    new_id, url = next((i, u) for i, u in up.state()["metrics_urls"].items() if i.startswith("frontend-"))
    assert url == f"http://127.0.0.1:{up.metrics_base + START_ORDER.index('frontend')}/metrics", \
        "the restarted frontend did not get its predecessor's metrics port"
    assert up.state()["http_url"] == f"http://127.0.0.1:{up.http_port}"
    assert get(f"http://127.0.0.1:{up.http_port}/v1/models")[0] == 200
    assert f"frontend {old_id}" in up.stderr and "restarting" in up.stderr, up.stderr[-2000:]


def test_the_nats_monitoring_port_is_off_by_default(up):
    nats_dir = up.data_dir / "run" / "nats"
    assert up.state()["nats_monitor_url"] == "", "the state file names a monitoring port no one asked for"
    assert "nats monitoring" not in up.stdout + up.stderr
    assert "http_port" not in (nats_dir / "nats.conf").read_text(), "the server's config asks for a monitoring port"
    (ports,) = nats_dir.glob("*.ports")
    assert "monitoring" not in json.loads(ports.read_text()), f"the server listens for monitoring: {ports.read_text()}"


def frontend_of(up: Up) -> tuple[str, str] | None:
    """(instance id, metrics URL) of the frontend the state file names (None: none, as between a
    killed one leaving the file and its replacement entering it)."""
    return next(((i, u) for i, u in up.state()["metrics_urls"].items() if i.startswith("frontend-")), None)


def answers_health(http_url: str) -> bool:
    try:
        return get(f"{http_url}/health")[0] == 200
    except OSError:
        return False


# slow: a whole up of its own (8 s on 2 cores; then 4 s to kill and restart its frontend)
@pytest.mark.slow
class TestOnFreePorts:
    """One ``up`` with every port it may take given as 0 (a free one), monitoring asked for."""

    @pytest.fixture(scope="class")
    def free_up(self, tmp_path_factory):
        system = start_up(tmp_path_factory.mktemp("up-free-ports"), 0, 0, 0, name="free-up",
                          flags=["--http-port", "0", "--metrics-port", "0", "--nats-monitor-port", "0"])
        yield system
        system.stop()

    def test_a_monitoring_port_asked_for_answers_and_is_printed_with_a_warning(self, free_up):
        url = free_up.state()["nats_monitor_url"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), f"no monitoring URL in the state file: {url!r}"
        printed = [line for line in (free_up.stdout + free_up.stderr).splitlines() if "nats monitoring" in line]
        assert printed == [f"  nats monitoring: {url} (warning: no authentication: any user of this host can list "
                           "every connection and subscription on it; --nats-monitor-port -1 turns it off)"], printed
        assert get(f"{url}/varz")[0] == 200

    async def test_a_killed_frontend_comes_back_on_the_port_the_first_one_got(self, free_up):
        http_url = free_up.state()["http_url"]
        old_id, old_metrics = frontend_of(free_up) or pytest.fail(f"no frontend in {free_up.state()}")
        assert answers_health(http_url), f"{http_url}/health does not answer before the kill"
        url = free_up.state()["nats_url"]
        nc = await nats.connect(url, **operator_options(url, free_up.data_dir))
        try:
            (info,) = await service_infos(nc, name="tandem-frontend")
            os.kill(int(info["metadata"]["pid"]), signal.SIGKILL)
        finally:
            await nc.close()

        def replacement() -> tuple[str, str] | None:
            found = frontend_of(free_up)
            return found if found and found[0] != old_id else None

        _, new_metrics = wait_for(replacement, 60, "the restarted frontend in the state file")
        assert free_up.state()["http_url"] == http_url, \
            "the restarted frontend is on another port: a client holding the old URL gets connection refused"
        wait_for(lambda: answers_health(http_url), 30, f"{http_url}/health to answer again")
        assert new_metrics == old_metrics, "the restarted frontend did not keep its metrics port"


# slow: two whole ups, one killed with kill -9 (16 s on 2 cores)
@pytest.mark.slow
def test_a_killed_up_leaves_what_the_next_up_removes(up):
    """Last in the module: it replaces the module's up with a new one on the same data dir and ports."""
    old_pid = up.proc.pid
    up.proc.send_signal(signal.SIGKILL)
    up.proc.wait()
    leftover = up.data_dir / "run" / "nats" / "left-by-the-killed-up"
    assert (up.data_dir / "run" / "up.json").exists(), "(SIGKILL leaves the state file: nothing runs to remove it)"
    leftover.write_text("x")
    ports = (up.nats_port, up.http_port, *range(up.metrics_base, up.metrics_base + len(START_ORDER)))
    wait_for(lambda: all(listen_on_ok(p) for p in ports), 30, "the killed up's children to let go of their ports")
    new = start_up(up.data_dir, up.nats_port, up.http_port, up.metrics_base, name="next-up")
    up.proc = new.proc  # the module fixture stops this one
    assert new.state()["pid"] == new.proc.pid != old_pid
    assert not leftover.exists(), "the new up kept the killed one's nats-server folder"
    assert f"removed the state file of pid {old_pid}" in new.stderr, new.stderr[-2000:]
    assert new.stop() == 0
    assert not (up.data_dir / "run" / "up.json").exists() and not (up.data_dir / "run" / "nats").exists()


def listen_on_ok(port: int) -> bool:
    try:
        listen_on("127.0.0.1", port).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(("spec", "reason"), [
    ("missing-dir", "is neither 'coder', 'tiny' nor an existing directory"),
    ("no-config", "missing config.json in {model}"),
])
def test_a_bad_model_is_one_line_before_anything_starts(tmp_path, spec: str, reason: str):
    model = tmp_path / spec
    if spec == "no-config":
        model.mkdir()
        (model / "tokenizer.json").write_text("{}")
    out = subprocess.run([*TANDEM, "up", "--model", str(model)], env=env_for(tmp_path / "data"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tandem up: --model {model}: "), lines
    assert reason.format(model=model) in lines[0], lines
    assert out.stdout == "" and not (tmp_path / "data" / "run").exists(), "something started before the refusal"


@pytest.mark.parametrize("flag", ["--http-port", "--port", "--nats-monitor-port"])
def test_a_taken_port_is_one_line_naming_its_flag(tmp_path, flag: str):
    sock = listen_on("127.0.0.1", 0)
    port = sock.getsockname()[1]
    others = [] if flag == "--http-port" else ["--http-port", "0"]  # (so 8000 being taken cannot answer instead)
    try:
        out = subprocess.run([*TANDEM, "up", *others, flag, str(port)], env=env_for(tmp_path), capture_output=True,
                             text=True, timeout=60)
    finally:
        sock.close()
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tandem up: {flag} {port}: cannot listen on 127.0.0.1:{port}"), \
        lines
    assert "started" not in out.stdout + out.stderr and not (tmp_path / "run" / "nats").exists()
