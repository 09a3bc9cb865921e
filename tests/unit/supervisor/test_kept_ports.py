"""Ports a client may hold: the embedded nats-server's monitoring port is off unless asked for (it
has no authentication) and a restart in place keeps whatever it had; a restarted frontend is started
on the port its first instance got with ``--http-port 0``, and waits while that port is still held;
a restarted child keeps its slot's metrics port with ``--metrics-port 0`` unless something else took
it. Real nats-servers and real sockets.

Run: ``python3 -m pytest -q tests/unit/supervisor/test_kept_ports.py``.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tandem.cli.flags import given, settings_from
from tandem.cli.main import parser
from tandem.cli.supervisor import Supervisor, listen_on
from tandem.shared.infra.config import ENV_PREFIX
from tandem.shared.infra.natsserver import NatsServer


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def ports_file(server: NatsServer) -> dict:
    (path,) = server.workdir.glob("*.ports")
    return json.loads(path.read_text())


def monitoring_answers(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as response:
        return response.status == 200


@pytest.fixture
def start_server() -> Iterator[Callable[..., NatsServer]]:
    """``NatsServer.start`` with its arguments; every server started is stopped after the test."""
    started: list[NatsServer] = []

    def start(**options: Any) -> NatsServer:
        started.append(NatsServer.start(**options))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def test_a_server_has_no_monitoring_port_unless_asked_and_keeps_none_through_a_restart(start_server):
    server = start_server()
    assert server.monitor_port is None
    assert "http_port" not in (server.workdir / "nats.conf").read_text()
    assert "monitoring" not in ports_file(server), ports_file(server)
    server.process.kill()
    server.process.wait()
    server.restart()
    assert server.monitor_port is None and "monitoring" not in ports_file(server), ports_file(server)


def test_a_monitoring_port_asked_for_answers_and_a_restart_keeps_it(start_server):
    server = start_server(monitor_port=0)
    port = server.monitor_port
    assert port and monitoring_answers(port)
    assert ports_file(server)["monitoring"] == [f"http://127.0.0.1:{port}"]
    server.process.kill()
    server.process.wait()
    server.restart()
    assert server.monitor_port == port and monitoring_answers(port), "the restart moved the monitoring port"


def supervisor(*flags: str) -> Supervisor:
    args = parser().parse_args(["up", *flags])
    return Supervisor(settings_from(args), overrides=given(args), frontend=True, gpus=[])


def flag_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} given {cmd.count(flag)} times: {cmd}"
    return cmd[cmd.index(flag) + 1]


def test_a_frontend_is_restarted_on_the_port_the_first_one_got():
    sup = supervisor("--http-port", "0")
    assert flag_value(sup.command("frontend", "frontend-a"), "--http-port") == "0", "the first takes a free port"
    sup.http_port = 43123  # as read_urls learns it from the first frontend's $SRV.INFO http_url
    assert flag_value(sup.command("frontend", "frontend-b"), "--http-port") == "43123"
    assert "--http-port" not in sup.command("router", "router-a")


def test_a_replacement_frontend_waits_while_its_port_is_held():
    held = listen_on("127.0.0.1", 0)
    port = held.getsockname()[1]
    sup = supervisor("--http-port", "0", "--http-host", "127.0.0.1")
    sup.http_port = port
    try:
        assert sup.port_in_use("frontend") == port, "a frontend started now could not bind its port"
    finally:
        held.close()
    assert sup.port_in_use("frontend") is None
    assert sup.port_in_use("router") is None, "only the frontend listens on a port a client holds"


def test_with_free_metrics_ports_a_slot_keeps_its_port_unless_another_process_took_it():
    sup = supervisor("--metrics-port", "0")
    assert sup.metrics_port(0) == 0, "nothing learned yet: a free port"
    probe = listen_on("127.0.0.1", 0)
    kept = probe.getsockname()[1]
    sup.slot_ports[0] = kept  # as read_urls learns it from the slot's child's metrics_url
    try:
        assert sup.metrics_port(0) == 0, "a port another process listens on must not be handed out"
        assert 0 not in sup.slot_ports
    finally:
        probe.close()
    sup.slot_ports[0] = kept
    assert sup.metrics_port(0) == kept
    assert supervisor("--metrics-port", "-1").metrics_port(0) == -1


def test_a_monitoring_port_given_with_an_outside_server_is_refused():
    from tandem.cli.up import usage_problem

    problem = usage_problem(supervisor("--nats-url", "nats://127.0.0.1:4222", "--nats-monitor-port", "0").settings)
    assert problem.startswith("--nats-monitor-port 0 and --nats-url nats://127.0.0.1:4222: ") and "\n" not in problem
    assert ("--nats-monitor-port", "127.0.0.1", 8222) in supervisor("--nats-monitor-port", "8222").pinned_ports()
