"""Which credentials a command takes: the running up's keys for its own URL however it is spelt,
nothing for another server's, an explicit file before either."""

from __future__ import annotations

import os

import pytest

from tandem.client.access import credentials_for, same_server
from tandem.client.runstate import RunState, write_state
from tandem.shared.auth.credentials import RoleKey
from tandem.shared.auth.keyring import Keyring


@pytest.mark.parametrize("a,b,same", [
    ("nats://127.0.0.1:4222", "nats://localhost:4222", True),
    ("nats://127.0.0.1:4222", "127.0.0.1:4222", True),
    ("tls://127.0.0.1", "nats://127.0.0.1:4222", True),
    ("nats://127.0.0.1:4222", "nats://127.0.0.1:4223", False),
    ("nats://10.0.0.2:4222", "nats://127.0.0.1:4222", False),
])
def test_one_server_however_its_url_is_spelt(a: str, b: str, same: bool):
    assert (same_server(a) == same_server(b)) is same, (a, b)


@pytest.fixture
def running_up(tmp_path, monkeypatch):
    """A state file as a running up writes it (this process's pid, so it counts as alive)."""
    ring = Keyring.generate()
    keys = {role: {"role": role, "account": ring.account.public_key, "seed": ring.roles[role].seed}
            for role in ("client", "operator")}
    write_state(tmp_path, RunState(pid=os.getpid(), nats_url="nats://127.0.0.1:45555", keys=keys))
    monkeypatch.delenv("TANDEM_NATS_CREDS", raising=False)
    return tmp_path, ring


def test_the_running_ups_key_for_its_url_only(running_up):
    data_dir, ring = running_up
    assert credentials_for("client", "nats://localhost:45555", data_dir=data_dir) == ring.role_key("client")
    assert credentials_for("operator", None, data_dir=data_dir) == ring.role_key("operator")
    assert credentials_for("client", "nats://127.0.0.1:4222", data_dir=data_dir) is None, "another server's URL"
    assert credentials_for("router", "nats://127.0.0.1:45555", data_dir=data_dir) is None, "not in the state file"


def test_an_explicit_file_comes_first(running_up, tmp_path, monkeypatch):
    data_dir, _ = running_up
    other = Keyring.generate().role_key("client")
    path = tmp_path / "mine.key"
    path.write_text(other.to_text())
    assert credentials_for("client", None, str(path), data_dir=data_dir) == other
    monkeypatch.setenv("TANDEM_NATS_CREDS", str(path))
    assert isinstance(credentials_for("client", None, data_dir=data_dir), RoleKey)
    assert credentials_for("client", None, data_dir=data_dir) == other
