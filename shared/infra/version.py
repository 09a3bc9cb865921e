"""tandem's version: read from the installed package's metadata, so pyproject.toml is its one source.

Run from a checkout that was never installed (a benchmark script on a machine with the
dependencies but no ``pip install``), there is no metadata: the checkout's pyproject.toml says it.
The NATS micro framework takes only semantic versions (``X.Y.Z``), so the fallback is one too.
"""

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

UNKNOWN = "0.0.0"


def _checkout_version() -> str:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"  # <checkout>/shared/infra/version.py
    try:
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return UNKNOWN


def _installed_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return _checkout_version()


VERSION = _installed_version()
