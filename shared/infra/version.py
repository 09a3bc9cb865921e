"""tandem's version: read from the installed package's metadata, so pyproject.toml is its one source."""

from importlib.metadata import PackageNotFoundError, version


def _installed_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


VERSION = _installed_version()
