"""What ``tandem up`` hands each child: the frontend gets the HTTP flags given to ``up``, every child
the log level as given, and a fixed ``--metrics-port N`` becomes one port per child (N + its slot,
the lowest slot free, so a restarted child gets its predecessor's port back).

Run: ``python3 -m pytest -q tests/unit/supervisor/test_commands.py``.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tandem.cli.flags import given, settings_from
from tandem.cli.main import parser
from tandem.cli.supervisor import START_ORDER, Child, Supervisor
from tandem.shared.infra.config import ENV_PREFIX

URL = "nats://127.0.0.1:4222"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def supervisor(*flags: str) -> Supervisor:
    args = parser().parse_args(["up", *flags])
    sup = Supervisor(settings_from(args), overrides=given(args), frontend=True, gpus=[])
    sup.url = URL
    return sup


def child_settings(cmd: list[str]):
    """The settings a child parses from its command line (``python -m tandem serve X ...``)."""
    child = parser().parse_args(cmd[3:])
    return child.service, settings_from(child)


@pytest.fixture
def sleepers():
    """Real processes standing in for children (their pids are all a Child's process is read for)."""
    started: list[subprocess.Popen] = []

    def make(n: int) -> list[subprocess.Popen]:
        started.extend(subprocess.Popen(["sleep", "60"]) for _ in range(n))
        return started[-n:]

    yield make
    for proc in started:
        proc.kill()
        proc.wait()


def test_the_frontend_gets_the_http_flags_given_to_up_and_the_workers_do_not():
    sup = supervisor("--http-host", "0.0.0.0", "--http-port", "8123", "--api-key", "sk-test", "--served-model-name",
                     "tiny-chat", "--max-concurrent-requests", "7", "--log-level", "DEBUG")
    service, settings = child_settings(sup.command("frontend", "frontend-x"))
    assert service == "frontend"
    got = (settings.frontend.host, settings.frontend.port, settings.frontend.api_key,
           settings.frontend.served_model_name, settings.frontend.max_concurrent_requests)
    assert got == ("0.0.0.0", 8123, "sk-test", "tiny-chat", 7), f"the frontend's settings: {got}"
    assert settings.bus.nats_url == URL and settings.instance_id == "frontend-x"
    for other in ("router", "decode", "prefill", "kvstore", "planner"):
        cmd = sup.command(other, f"{other}-x")
        assert not any(a.startswith("--http-") or a == "--api-key" for a in cmd), f"{other} got HTTP flags: {cmd}"
        assert child_settings(cmd)[1].log_level == "DEBUG", f"{other} lost --log-level DEBUG: {cmd}"


@pytest.mark.parametrize(("base", "slot", "port"), [(-1, 3, -1), (0, 3, 0), (9100, 0, 9100), (9100, 3, 9103)],
                         ids=["none", "free", "base", "base+3"])
def test_a_metrics_port_is_the_base_plus_the_slot(base: int, slot: int, port: int):
    sup = supervisor("--metrics-port", str(base))
    for service in ("router", "decode", "frontend"):
        settings = child_settings(sup.command(service, f"{service}-x", slot))[1]
        assert settings.metrics.port == port, f"{service} in slot {slot} with base {base}"


def test_slots_go_in_start_order_and_a_freed_one_is_taken_again(sleepers):
    sup = supervisor("--metrics-port", "9100")
    procs = sleepers(4)
    for i, (service, proc) in enumerate(zip(["decode", "prefill", "router", "frontend"], procs)):
        assert sup.free_slot() == i, f"child {i} in start order ({service})"
        sup.children.append(Child(service, proc, f"{service}-x", metrics_slot=sup.free_slot()))
    sup.children.pop(1)  # the prefill worker crashed: its replacement reuses port 9101
    assert sup.free_slot() == 1
    sup.children.append(Child("prefill", procs[1], "prefill-y", metrics_slot=sup.free_slot()))
    assert sup.free_slot() == 4


def test_the_frontend_starts_after_the_router_and_stops_first():
    from tandem.cli.supervisor import SERVICE_ORDER

    assert START_ORDER.index("frontend") == START_ORDER.index("router") + 1
    assert SERVICE_ORDER[0] == "frontend", "it must stop taking HTTP requests before the router goes"
    assert set(START_ORDER) == set(SERVICE_ORDER)


def test_the_most_children_count_every_service_at_its_limit():
    sup = Supervisor(settings_from(parser().parse_args(["up"])), num_kvstore=2, planner=True, max_prefill=3,
                     max_decode=2, frontend=True, gpus=[])
    assert sup.most_children() == 2 + 3 + 2 + 1 + 1 + 1, "kvstores, prefill, decode, router, frontend, planner"
