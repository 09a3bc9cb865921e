"""tandem's wheel built as a release would be, for the tests that check or install it.

``source_files`` lists what ships (what git does not ignore, plus the top-level files the build
reads); ``build_wheel`` copies those into a fresh folder and runs ``pip wheel --no-deps
--no-build-isolation --no-index`` there. The copy matters: an in-tree build reuses ``build/lib``, so
a module deleted since the last build would still be packed, and two builds at once would race on
that folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]
# folder -> package it becomes (setup.py's ROOTS, restated: a test should not trust the code it checks)
ROOTS = {"tandem": "tandem", "shared": "tandem.shared", "services": "tandem.services", "console": "tandem.console"}


def skipped(part: str) -> bool:
    """Not shipped: caches, compiled files, dotfiles (e.g. a .gitkeep), editor backups."""
    return part == "__pycache__" or part.startswith(".") or part.endswith((".pyc", ".pyo", "~", ".egg-info"))


def source_files() -> list[str]:
    """Repo-relative POSIX paths of the files to ship: tracked or new, not git-ignored, present on disk.

    Also the top-level files (pyproject.toml, setup.py, README.md ...), which the build needs.
    Without git, a walk of the four folders and the top-level files.
    """
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True).stdout
        names = [os.fsdecode(n) for n in out.split(b"\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [p.relative_to(REPO).as_posix() for root in ROOTS for p in (REPO / root).rglob("*")]
        names += [p.name for p in REPO.iterdir()]
    keep = []
    for name in names:
        parts = PurePosixPath(name).parts
        if not (REPO / name).is_file() or any(skipped(p) for p in parts):
            continue  # deleted but still tracked, a folder, or a cache
        if len(parts) == 1 or parts[0] in ROOTS:
            keep.append(name)
    return sorted(keep)


def build_wheel(source_copy: Path, out: Path) -> Path:
    """Copy the shipped files into ``source_copy`` (an empty folder), build the wheel into ``out``
    offline, return its path."""
    for name in source_files():
        (source_copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source_copy / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-w", str(out), str(source_copy)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"}, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("tandem-*.whl"))
    assert len(wheels) == 1, (wheels, proc.stdout)
    return wheels[0]
