"""Fixed ports are checked before anything starts: a port something already listens on, or two
fixed ports that collide, is refused in one line naming the flag (a child that cannot bind would
only crash and be restarted forever); free ones pass, and the check leaves them free.

Run: ``python3 -m pytest -q tests/unit/supervisor/test_ports.py``.
"""

from __future__ import annotations

import os
import socket

import pytest

from tandem.cli.flags import given, settings_from
from tandem.cli.main import parser
from tandem.cli.supervisor import Supervisor, UsageError, listen_on
from tandem.shared.infra.config import ENV_PREFIX


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def supervisor(*flags: str, kvstore: int = 0) -> Supervisor:
    args = parser().parse_args(["up", *flags])
    return Supervisor(settings_from(args), num_kvstore=kvstore, overrides=given(args), frontend=True, gpus=[])


def free_block(n: int) -> int:
    """A base port with ``n`` free ports from it on (checked by listening on each, then closed)."""
    for base in range(23000 + os.getpid() % 1000 * 20, 60000, 97):
        held = []
        try:
            held = [listen_on("127.0.0.1", base + i) for i in range(n)]
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError(f"no {n} free consecutive ports")


@pytest.fixture
def taken():
    """A port something listens on for the test's length."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_taken_port_is_refused_in_one_line_naming_its_flag(taken: int, flag: str):
    # --metrics-port: the taken port is the third child's (base + 2), not the base itself
    given_port = taken - 2 if flag == "--metrics-port" else taken
    sup = supervisor("--http-port", "0", flag, str(given_port))
    with pytest.raises(UsageError) as refused:
        sup.check_ports()
    message = str(refused.value)
    assert message.startswith(f"{flag} {given_port}: cannot listen on 127.0.0.1:{taken}"), message
    assert "\n" not in message, f"one line: {message!r}"
    if flag == "--metrics-port":
        assert "(child 2 in start order)" in message, message


def test_fixed_ports_that_collide_are_refused():
    base = free_block(6)
    sup = supervisor("--port", str(base + 1), "--http-port", str(base + 1))
    with pytest.raises(UsageError, match=rf"^--http-port {base + 1}: cannot listen"):
        sup.check_ports()
    sup = supervisor("--http-port", str(base + 2), "--metrics-port", str(base))  # 4 children: base..base+3
    with pytest.raises(UsageError, match=rf"^--metrics-port {base}: cannot listen on 127.0.0.1:{base + 2}"):
        sup.check_ports()


def test_free_fixed_ports_pass_and_stay_free():
    base = free_block(8)
    sup = supervisor("--port", str(base), "--http-port", str(base + 1), "--metrics-port", str(base + 2), kvstore=1)
    pinned = sup.pinned_ports()
    assert [p for _, _, p in pinned] == [base, base + 1, *range(base + 2, base + 2 + 5)], pinned
    sup.check_ports()
    for _, host, port in pinned:
        listen_on(host, port).close()  # the check let go of every port it tried


def test_free_ports_are_not_checked_and_a_base_too_high_is_refused():
    assert supervisor("--http-port", "0", "--metrics-port", "0").pinned_ports() == []
    assert supervisor("--http-port", "0", "--metrics-port", "-1").pinned_ports() == []
    with pytest.raises(UsageError, match=r"^--metrics-port 65534: the children take ports 65534\.\.65537"):
        supervisor("--metrics-port", "65534").check_ports()


def test_with_an_external_server_port_is_not_ours_to_check(taken: int):
    sup = supervisor("--nats-url", "nats://127.0.0.1:4222", "--http-port", "0")
    sup.settings = sup.settings.updated(nats_port=taken)
    assert sup.pinned_ports() == [], "--nats-url: no embedded server, so no NATS port of ours"
