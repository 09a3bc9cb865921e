"""Which packages and files go into the wheel: found by walking the source folders, never listed by hand.

All metadata (name, version, dependencies, scripts) lives in pyproject.toml; this file only adds
``packages``, ``package_dir`` and ``package_data``, which pyproject.toml cannot express here:
``[tool.setuptools.packages.find]`` names a package after its path below ``where`` and has no
prefix option, so it cannot put four folders (``shared/`` → ``tandem.shared`` and so on) under one
namespace.

The rule, for each of the four folders in ``ROOTS``:

* every directory holding an ``__init__.py`` is a package, named after its path;
* every other file (``.tcss``, ``.c``, checkpoints under ``shared/model/weights/``, even a ``.py``
  script in a folder that is not a package) is package data of the nearest package above it;
* left out: ``__pycache__``/compiled files, dotfiles, and, in a git checkout, whatever .gitignore
  ignores (tracked and untracked-but-not-ignored files go in, the same set ``git add -A`` would
  take). Outside git (an sdist) every file found is used; the sdist holds exactly the files that
  were picked when it was made.

Do not add ``packages``, ``package-dir`` or ``[tool.setuptools.package-data]`` to pyproject.toml:
setuptools lets pyproject.toml replace these lists wholesale, silently.
tests/unit/test_packaging.py builds the wheel and checks every file and module is in it.
"""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent

# package name -> folder (relative to this file); every package below is named from these.
ROOTS = {
    "tandem": "tandem",
    "tandem.shared": "shared",
    "tandem.services": "services",
    "tandem.console": "console",
}

_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo", "~")


def _not_ignored_files() -> set[Path] | None:
    """Tracked and untracked-but-not-ignored files under ROOTS, per git; None outside a git checkout."""
    if not (HERE / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *ROOTS.values()],
            cwd=HERE, capture_output=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None  # no git binary, or git refuses this checkout (e.g. "dubious ownership")
    return {HERE / os.fsdecode(name) for name in out.split(b"\0") if name}


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in _SKIP_DIRS or name.endswith(_SKIP_SUFFIXES) or name.endswith(".egg-info")


def discover(listed: set[Path] | None = None) -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """(packages, package_dir, package_data) for setup(); ``listed`` limits the files considered."""
    packages: list[str] = []
    package_data: dict[str, list[str]] = {}
    for root_name, folder in ROOTS.items():
        base = HERE / folder
        if not (base / "__init__.py").is_file():
            raise RuntimeError(f"{folder}/ must be a package (it maps to {root_name}) but has no __init__.py")
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
            here = Path(dirpath)
            rel = here.relative_to(base)
            is_package = "__init__.py" in filenames
            if is_package:
                packages.append(".".join((root_name, *rel.parts)))
            # nearest package at or above this folder (the root itself is one)
            owner = rel
            while owner.parts and not (base / owner / "__init__.py").is_file():
                owner = owner.parent
            owner_name = ".".join((root_name, *owner.parts))
            for filename in sorted(filenames):
                path = here / filename
                if _skipped(filename) or not path.is_file() or (listed is not None and path not in listed):
                    continue
                if is_package and filename.endswith(".py"):
                    continue  # a module: build_py takes it with its package
                # package_data entries are glob patterns: escape, so a name with [*? stays literal
                pattern = glob.escape(path.relative_to(base / owner).as_posix())
                package_data.setdefault(owner_name, []).append(pattern)
    return packages, dict(ROOTS), package_data


if __name__ == "__main__":
    _packages, _package_dir, _package_data = discover(_not_ignored_files())
    setup(packages=_packages, package_dir=_package_dir, package_data=_package_data)
