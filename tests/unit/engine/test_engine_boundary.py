"""The engine's boundary: outside ``shared/engine`` (and ``shared/parallel``, which extends its model
runner) code uses an engine only through what ``shared/engine/engine_view.py`` names. This reads the
services, the console and the ``tandem`` package (client, command line) and fails on any reach into
an engine's parts: ``<engine>.scheduler``, ``.block_manager``, ``.runner`` and the like, a
leading-underscore attribute of an engine, or ``getattr(..., "scheduler")`` and its kind.

"Engine" means an expression whose last name says so: ``engine``, ``self.engine``,
``worker.engine``, ``decode_engine``. A checker that found nothing to read would pass by itself, so
the scan must reach the engine thread, and each rule is shown to catch what it is meant to.

Run: ``python3 -m pytest -q tests/unit/engine/test_engine_boundary.py``.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# tandem/ holds symlinks to shared/, services/ and console/: the walk does not follow them, so shared/
# (the engine's own side) is never read and the others are read once, from their own folders.
CHECKED = ("services", "console", "tandem")
# The engine's parts: the services get what they need of these from EngineView.
ENGINE_PARTS = frozenset({"scheduler", "block_manager", "runner", "model_runner", "swap_space", "swapper"})


def names_an_engine(node: ast.expr) -> bool:
    """Whether ``node`` (``engine``, ``self.engine``, ``make_engine()``...) is by its name an engine."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "engine" in name.lower()


def is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def reaches(source: str, filename: str = "<snippet>") -> list[str]:
    """``line: what`` for each reach past the engine's view in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and names_an_engine(node.value):
            if node.attr in ENGINE_PARTS or is_private(node.attr):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            attr = node.args[1].value
            if attr in ENGINE_PARTS or (is_private(attr) and names_an_engine(node.args[0])):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def checked_files() -> list[Path]:
    files = []
    for top in CHECKED:
        for folder, _, names in os.walk(ROOT / top):  # followlinks=False: tandem/shared is not entered
            files += [Path(folder) / name for name in names if name.endswith(".py")]
    return sorted(files)


def test_nothing_outside_the_engine_reads_its_parts() -> None:
    files = checked_files()
    assert ROOT / "services" / "common" / "engine_thread.py" in files, "the scan must reach the engine thread"
    assert not any("shared" in path.relative_to(ROOT).parts for path in files), "shared/ is the engine's side"
    offences = [f"{path.relative_to(ROOT)}:{reach}"
                for path in files for reach in reaches(path.read_text(encoding="utf-8"), str(path))]
    assert not offences, ("these read an engine's parts; use (or add) an accessor of "
                          "shared/engine/engine_view.py instead:\n  " + "\n  ".join(offences))


@pytest.mark.parametrize("source", [
    "self.engine.scheduler.running",
    "len(engine.scheduler.waiting)",
    "worker.engine.block_manager.num_free_blocks",
    "decode_engine.runner.kv_layout",
    "self.thread.engine.model_runner",
    "engine._in_flight",
    "make_engine()._postprocess",
    'getattr(getattr(self.engine, "scheduler", None), "running", ())',
    'getattr(e, "block_manager")',
    'hasattr(engine, "_text_pending")',
])
def test_a_reach_into_the_engine_is_caught(source: str) -> None:
    assert reaches(source), f"{source!r} reads an engine's parts and was not caught"


@pytest.mark.parametrize("source", [
    "self.engine.stats()['running']",
    "engine.running_request_ids()",
    "self.engine.kv_layout",
    "settings.engine.block_size",
    "self.engine.__class__.__name__",
    "self._scheduler.pick()",
    'getattr(settings, "_env_prefix")',
    'getattr(engine, "config")',
])
def test_the_view_and_unrelated_names_pass(source: str) -> None:
    assert not reaches(source), f"{source!r} stays within the engine's view but was flagged"
