"""``scripts/import_graph.py`` loaded as a module, for the tests that read tandem's imports from the
source (test_layers, test_dependencies): one reading of which file is which module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _load():
    if "import_graph" in sys.modules:
        return sys.modules["import_graph"]
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


import_graph = _load()
