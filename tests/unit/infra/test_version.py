"""tandem's version, installed or run from a checkout: pyproject.toml's, and one the NATS micro
framework takes (every service registers with it, and an invalid one stops the service at start)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.shared.infra import version

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# nats-py's micro validates service versions with the semantic-versioning pattern
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def test_the_installed_version_is_pyprojects():
    assert version.VERSION == PYPROJECT_VERSION


def test_a_checkout_never_installed_reads_pyproject():
    assert version._checkout_version() == PYPROJECT_VERSION


@pytest.mark.parametrize("found", [PYPROJECT_VERSION, version.UNKNOWN])
def test_the_version_is_one_micro_accepts(found):
    assert SEMVER.match(found), f"{found!r} is no semantic version: nats micro would refuse to register a service"


def test_a_service_registers_without_the_package_metadata(tmp_path):
    """The checkout on the path and no tandem distribution: the version still registers (services
    failed to start this way when it fell back to a PEP 440 local version)."""
    probe = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "def version(name):\n"
        "    if name == 'tandem':\n"
        "        raise md.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "md.version = version\n"
        "from nats.micro.service import ServiceConfig\n"
        "from tandem.shared.infra.version import VERSION\n"
        "ServiceConfig(name='tandem-probe', version=VERSION)\n"
        "print(VERSION)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == PYPROJECT_VERSION
