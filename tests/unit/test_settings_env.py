"""Every ``TANDEM_*`` variable is a setting: only ``shared/infra/config.py`` reads them, and library
code that runs without a whole ``Settings`` (the client's ``connect()``, the host AdamW kernel) gets
its part through ``config.from_env``, its own arguments first, then the variable, then the default."""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

import pytest

from tandem.client.access import credentials_for
from tandem.client.connect import resolve_url
from tandem.client.errors import TandemError
from tandem.client.runstate import RunState, data_dir_in_use, write_state
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra.config import (
    BY_FLAT,
    ENV_ONLY_SECTIONS,
    ENV_PREFIX,
    EnvSettingsError,
    HostAdamSettings,
    default_data_dir,
    from_env,
)

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("shared", "services", "tandem", "console")  # the package; tests and benchmarks set variables for it
SETTINGS_MODULE = ROOT / "shared" / "infra" / "config.py"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


# -- no variable read outside the settings ------------------------------------------------------------
def _is_tandem_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(ENV_PREFIX)


def _mentions_env(node: ast.AST) -> bool:
    """``os.environ``, ``os.getenv``, ``environ.get``, or a name bound to one (``env = os.environ.get``)."""
    return "env" in ast.unparse(node).lower()


def env_reads(source: str) -> list[tuple[int, str]]:
    """(line, variable) of every read of a ``TANDEM_*`` variable in ``source``: ``os.environ.get(N)``,
    ``os.getenv(N)``, ``os.environ[N]``, ``N in os.environ``, through an alias of ``environ.get``, or
    through a module constant holding the name. Writes (a child's environment) are no reads."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and _is_tandem_name(node.value) for target in node.targets if isinstance(target, ast.Name)}

    def name_of(node: ast.AST) -> str | None:
        if _is_tandem_name(node):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args and _mentions_env(node.func) and not (
                isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "setdefault")):
            name = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _mentions_env(node.value):
            name = name_of(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(
                _mentions_env(c) for c in node.comparators):
            name = name_of(node.left)
        if name is not None:
            found.append((node.lineno, name))
    return found


def package_files() -> list[Path]:
    seen: dict[Path, Path] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            real = path.resolve()
            # tandem/shared, tandem/services, tandem/console are links to the folders beside: once each
            if real.is_relative_to(ROOT) and real not in seen:
                seen[real] = real
    return sorted(seen)


@pytest.mark.parametrize(("code", "reads"), [
    ('os.environ.get("TANDEM_X")', ["TANDEM_X"]),
    ('os.environ.get("TANDEM_X", "1")', ["TANDEM_X"]),
    ('os.getenv("TANDEM_X")', ["TANDEM_X"]),
    ('os.environ["TANDEM_X"]', ["TANDEM_X"]),
    ('"TANDEM_X" in os.environ', ["TANDEM_X"]),
    ('env = os.environ.get\nenv("TANDEM_X")', ["TANDEM_X"]),
    ('NAME = "TANDEM_X"\nos.environ.get(NAME)', ["TANDEM_X"]),
    ('def f(environ=os.environ):\n    return environ.get("TANDEM_X")', ["TANDEM_X"]),
    ('dict(os.environ, TANDEM_X="1")', []),  # a child's environment
    ('env = dict(os.environ)\nenv.pop("TANDEM_X", None)', []),
    ('os.environ["TANDEM_X"] = "1"', []),
    ('"""Set TANDEM_X to turn it on."""', []),
    ('STREAM = "TANDEM_X"\nconfig(name=STREAM)', []),  # a JetStream stream's name
])
def test_the_scan_finds_every_way_of_reading_a_variable(code, reads):
    assert [name for _, name in env_reads(textwrap.dedent(code))] == reads


def test_no_tandem_variable_is_read_outside_the_settings():
    files = package_files()
    assert SETTINGS_MODULE in files and len(files) > 100, "the scan must see the whole package"
    outside = [f"{path.relative_to(ROOT)}:{line} reads {name}" for path in files if path != SETTINGS_MODULE
               for line, name in env_reads(path.read_text())]
    assert not outside, ("TANDEM_* variables read outside shared/infra/config.py (make each a settings field and "
                         "read it through the settings or config.from_env): " + "; ".join(outside))


# -- from_env: one part of the settings, from the variables alone -------------------------------------
def test_a_section_from_its_variables_then_its_defaults(monkeypatch):
    assert from_env("host_adam") == HostAdamSettings()
    monkeypatch.setenv("TANDEM_ADAM_THREADS", "3")
    monkeypatch.setenv("tandem_host_kernel", "torch")  # any case, as Settings reads them
    assert from_env("host_adam") == HostAdamSettings(adam_threads=3, host_kernel="torch")


def test_an_empty_variable_is_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_DATA_DIR", "")
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", "")
    monkeypatch.setenv("TANDEM_NATS_URL", "")
    assert from_env("data_dir") == default_data_dir()
    assert from_env("host_adam").kernel_cache is None and from_env("bus").nats_url is None
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    assert from_env("data_dir") == tmp_path == data_dir_in_use()


@pytest.mark.parametrize(("variable", "value", "part", "said"), [
    ("TANDEM_ADAM_THREADS", "-1", "host_adam", "TANDEM_ADAM_THREADS '-1': Input should be greater than or equal to 0"),
    ("TANDEM_HOST_KERNEL", "c", "host_adam", "TANDEM_HOST_KERNEL 'c': Input should be 'auto' or 'torch'"),
    ("TANDEM_LOG_LEVEL", "loud", "log_level", "TANDEM_LOG_LEVEL 'loud': must be one of DEBUG, INFO, WARNING"),
])
def test_a_bad_value_is_one_line_naming_its_variable(monkeypatch, variable, value, part, said):
    monkeypatch.setenv(variable, value)
    with pytest.raises(EnvSettingsError) as caught:
        from_env(part)
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value), str(caught.value)


def test_a_bad_value_elsewhere_is_not_read(monkeypatch):
    monkeypatch.setenv("TANDEM_NUM_BLOCKS", "-5")
    monkeypatch.setenv("TANDEM_NATS_URL", "nats://elsewhere:4222")
    assert from_env("bus").nats_url == "nats://elsewhere:4222"


def test_variables_only_sections_are_settings_fields():
    knobs = [k for k in BY_FLAT.values() if k.section in ENV_ONLY_SECTIONS]
    assert {k.env for k in knobs} == {"TANDEM_ADAM_CHUNK", "TANDEM_ADAM_THREADS", "TANDEM_HOST_KERNEL",
                                      "TANDEM_KERNEL_CACHE"}
    assert all(k.description for k in knobs)


# -- the library code that reads them ----------------------------------------------------------------
def test_the_host_kernel_follows_its_variables(monkeypatch, tmp_path):
    from tandem.shared.train import host_kernel

    monkeypatch.setenv("TANDEM_HOST_KERNEL", "torch")
    assert host_kernel.load.__wrapped__() is None, "TANDEM_HOST_KERNEL=torch keeps torch's path"
    monkeypatch.setenv("TANDEM_HOST_KERNEL", "auto")
    monkeypatch.setenv("TANDEM_ADAM_THREADS", "3")
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    kernel = host_kernel.load.__wrapped__()
    if kernel is None:
        pytest.skip("no C compiler builds the host AdamW kernel here")
    assert kernel.threads == 3
    assert list((tmp_path / "tandem" / "kernels").glob("host_adam-*.so")), "built outside TANDEM_KERNEL_CACHE"


def test_the_client_takes_its_argument_then_the_variable_then_the_running_up(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    with pytest.raises(TandemError, match="no running tandem found"):
        resolve_url(None)
    write_state(tmp_path, RunState(pid=os.getpid(), nats_url="nats://127.0.0.1:45555"))
    assert resolve_url(None) == "nats://127.0.0.1:45555"
    monkeypatch.setenv("TANDEM_NATS_URL", "nats://from-env:4222")
    assert resolve_url(None) == "nats://from-env:4222"
    assert resolve_url("nats://given:4222") == "nats://given:4222"
    monkeypatch.setenv("TANDEM_WORKER_TIMEOUT_S", "soon")
    with pytest.raises(TandemError, match="TANDEM_WORKER_TIMEOUT_S 'soon'"):
        resolve_url(None)


def test_the_client_credentials_come_from_the_argument_then_the_variable(monkeypatch, tmp_path):
    given, from_variable = Keyring.generate().role_key("client"), Keyring.generate().role_key("client")
    (tmp_path / "given.key").write_text(given.to_text())
    (tmp_path / "env.key").write_text(from_variable.to_text())
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "none"))
    assert credentials_for("client", None) is None
    monkeypatch.setenv("TANDEM_NATS_CREDS", str(tmp_path / "env.key"))
    assert credentials_for("client", None) == from_variable
    assert credentials_for("client", None, str(tmp_path / "given.key")) == given
