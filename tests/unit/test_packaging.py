"""The wheel holds the whole package: every file of the four source folders, every module importable from it.

The editable install maps whole folders (``tandem.shared`` → ``shared/`` ...), so a package left out
of the wheel still imports in development. Here the wheel is built the way a release would be
(``pip wheel --no-deps --no-build-isolation``, offline) and checked against the source tree:

* every file under tandem/, shared/, services/, console/ that git does not ignore (tracked or new),
  at its namespaced path (``shared/kvtransfer/ring.py`` → ``tandem/shared/infra/shmring.py``), and
  nothing else (no stale or stray files);
* every module imports from the unpacked wheel, in a fresh interpreter with the editable finder
  and the repository taken off the import path, and its ``__file__`` lies in the unpacked wheel;
* ``python -m tandem --help`` runs from it;
* its metadata splits the requirements by role: the base install has no torch, the ``serve`` and
  ``train`` extras bring it, ``all`` names both (tests/unit/test_dependencies.py checks the groups
  against the imports; tests/e2e/test_client_only_install.py installs the base alone).

The wheel is built from a copy of the source (the same files), not in the working tree: an
in-tree build reuses ``build/lib``, so a module deleted since the last build would still be
packed, and two engineers building at once would race on that folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path, PurePosixPath

import pytest
from wheel_support import REPO, ROOTS, build_wheel
from wheel_support import source_files as _source_files

pytestmark = pytest.mark.slow  # builds a wheel: ~10 s on 2 cores


def _wheel_path(repo_path: str) -> str:
    """Where a file of a source folder lies in the wheel: ``shared/x/y.py`` → ``tandem/shared/x/y.py``."""
    root, *rest = PurePosixPath(repo_path).parts
    return "/".join((*ROOTS[root].split("."), *rest))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_every_source_file(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")), "")
    shipped = {n for n in names if ".dist-info/" not in n}
    expected = {_wheel_path(n): n for n in _source_files() if PurePosixPath(n).parts[0] in ROOTS}

    missing = sorted(f"{expected[w]} (as {w})" for w in expected.keys() - shipped)
    assert not missing, "source files missing from the wheel:\n  " + "\n  ".join(missing)
    extra = sorted(shipped - expected.keys())
    assert not extra, "files in the wheel that are not in the source tree:\n  " + "\n  ".join(extra)
    # the data files this project reads at run time, named so a broken rule reads plainly
    for data in ("tandem/console/app.tcss", "tandem/shared/train/host_adam.c"):
        assert data in shipped
    if (REPO / "shared/model/weights/tiny/model.safetensors").is_file():
        assert "tandem/shared/model/weights/tiny/model.safetensors" in shipped
        assert "tandem/shared/model/weights/tiny/config.json" in shipped
    assert "tandem = tandem.cli.main:main" in entry_points


def _requirement(line: str) -> tuple[str, str | None]:
    """(normalized project name with its extras, the extra its marker names or None) of one Requires-Dist."""
    spec, _, marker = line.partition(";")
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?)", spec).group(1)
    extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
    return re.sub(r"[-_.]+", "-", name).lower(), extra.group(1) if extra else None


def test_wheel_metadata_splits_the_requirements_by_role(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        metadata = Parser().parsestr(next(zf.read(n).decode() for n in zf.namelist()
                                          if n.endswith(".dist-info/METADATA")))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(metadata.get_all("Provides-Extra")) == set(project["optional-dependencies"])
    by_extra: dict[str | None, set[str]] = {}
    for line in metadata.get_all("Requires-Dist"):
        name, extra = _requirement(line)
        by_extra.setdefault(extra, set()).add(name)
    base = by_extra[None]
    assert "torch" not in base and "numpy" not in base, f"`pip install tandem` would pull the engine: {sorted(base)}"
    assert {"nats-py", "pydantic", "textual", "cryptography", "httpx"} <= base, sorted(base)
    for extra in ("serve", "train"):
        assert "torch" in by_extra[extra], f"the {extra} extra has no torch: {sorted(by_extra[extra])}"
    assert by_extra["all"] == {"tandem[serve,train]"}, by_extra["all"]


_IMPORT_ALL = textwrap.dedent(r'''
    import contextlib, importlib, io, json, os, pkgutil, runpy, sys, traceback

    site, repo, report_path = (os.path.realpath(a) for a in sys.argv[1:4])
    source_dirs = [os.path.join(repo, d) for d in sys.argv[4:]]

    def inside(path, root):
        try:
            return os.path.commonpath([os.path.realpath(path or os.getcwd()), root]) == root
        except ValueError:
            return False

    def editable(obj):
        """setuptools' editable finder (a class put on sys.meta_path) and its path hook."""
        names = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None),
                 type(obj).__module__, type(obj).__qualname__)
        return any("editable" in (n or "").lower() for n in names)

    removed = [repr(f) for f in sys.meta_path + sys.path_hooks if editable(f)]
    sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
    # the repository root (it would expose tandem/ itself) and anything inside the source folders;
    # not all of the repo: a .venv/ in it may hold torch
    dropped = [p for p in sys.path
               if os.path.realpath(p or os.getcwd()) == repo or any(inside(p, d) for d in source_dirs)]
    sys.path[:] = [site] + [p for p in sys.path if p not in dropped]
    sys.path_importer_cache.clear()
    report = {"removed": removed, "dropped_paths": dropped,
              "preloaded": sorted(m for m in sys.modules if m.split(".")[0] == "tandem"),
              "errors": {}, "imported": [], "outside": {}}

    def where(mod):
        return getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", None) or []), None)

    def onerror(name):
        report["errors"][name] = traceback.format_exc()

    import tandem
    names = ["tandem"] + [m.name for m in pkgutil.walk_packages(tandem.__path__, "tandem.", onerror=onerror)]
    for name in names:
        if name.rsplit(".", 1)[-1] == "__main__":
            continue  # a script: importing it runs the CLI (checked below with --help)
        try:
            importlib.import_module(name)
        except BaseException:
            report["errors"][name] = traceback.format_exc()
        else:
            report["imported"].append(name)

    out = io.StringIO()
    sys.argv = ["tandem", "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module("tandem", run_name="__main__", alter_sys=True)
        report["help_exit"] = 0
    except SystemExit as exc:
        report["help_exit"] = exc.code
    except BaseException:
        report["help_exit"] = traceback.format_exc()
    report["help_out"] = out.getvalue()[:4000]

    # every tandem module loaded, including those imported lazily along the way
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] == "tandem" and not inside(where(mod), site):
            report["outside"][name] = where(mod)
    with open(report_path, "w") as f:
        json.dump(report, f)
''')


def _wheel_modules(names: list[str]) -> set[str]:
    """Importable module names in the wheel: .py files of folders that hold an __init__.py, less __main__."""
    files = {n for n in names if n.startswith("tandem/") and n.endswith(".py")}
    packages = {str(PurePosixPath(n).parent) for n in files if n.endswith("/__init__.py")}
    modules = set()
    for n in files:
        path = PurePosixPath(n)
        if str(path.parent) not in packages or path.stem == "__main__":
            continue  # a .py file in a folder without __init__.py is data, not a module
        parts = path.parent.parts if path.stem == "__init__" else (*path.parent.parts, path.stem)
        modules.add(".".join(parts))
    return modules


def test_every_module_imports_from_the_wheel(wheel: Path, tmp_path: Path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        expected = _wheel_modules(zf.namelist())
    report_path = tmp_path / "report.json"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(site), str(REPO), str(report_path), *ROOTS],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and report_path.is_file(), f"import run failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(report_path.read_text())

    assert not report["preloaded"], f"tandem was imported before the finder was removed: {report['preloaded']}"
    # the child found the editable finder exactly when this process has one (else the filter is blind)
    here_editable = [f for f in sys.meta_path if "editable" in (getattr(f, "__module__", "") or "").lower()]
    assert bool(report["removed"]) == bool(here_editable), (report["removed"], here_editable)
    errors = "\n".join(f"--- {name}\n{tb}" for name, tb in sorted(report["errors"].items()))
    assert not report["errors"], f"modules that do not import from the wheel (on this machine's CPU/GPU):\n{errors}"
    assert not report["outside"], f"modules loaded from outside the unpacked wheel: {report['outside']}"
    assert set(report["imported"]) == expected, {
        "in the wheel, not found by walk_packages": sorted(expected - set(report["imported"])),
        "found, but no such file in the wheel": sorted(set(report["imported"]) - expected)}
    assert report["help_exit"] == 0 and "usage: tandem" in report["help_out"], report


def test_the_checkout_root_does_not_shadow_the_installed_package(wheel: Path, tmp_path: Path):
    """From the checkout's root the current folder comes first on the path, so its ``tandem/`` is
    found before any installed one: it links the other mapped folders (tandem/shared -> ../shared ...),
    so ``python -m tandem`` and every part import there as they do from the wheel, and tools that
    read imports from the files can follow them."""
    for folder, package in ROOTS.items():
        if package == "tandem":
            continue
        link = REPO / "tandem" / package.split(".", 1)[1]
        assert link.is_symlink() and link.resolve() == REPO / folder, f"{link} should link to ../{folder}"
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
    probe = ("import tandem.cli.main, tandem.client, tandem.shared.engine.engine, tandem.services.router.service, "
             "tandem.console.app; print(tandem.shared.engine.engine.__file__)")
    found = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    assert found.returncode == 0, f"importing from the checkout's root failed:\n{found.stderr}"
    helped = subprocess.run([sys.executable, "-m", "tandem", "--help"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "usage: tandem" in helped.stdout, helped.stderr
