"""The layer rule (docs/architecture.md), checked two ways.

From the source (``scripts/import_graph.py`` reads every import, lazy ones included): no arrow runs
back up the layers (shared < client < services, console < cli), no service imports a peer service,
no two packages import each other through any path, and the wire protocol and the client library
import no torch and nothing of tandem's beside what the rule lets them.

In fresh interpreters: what runs no model loads no torch. The router, the KV-store's service side,
the HTTP frontend and ``tandem.client`` need no torch. Each case imports its modules in a new Python
process (this one has torch loaded already) and lists what it pulled in.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from import_graph_support import import_graph

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph():
    return import_graph.build()


def test_the_graph_sees_every_part(graph):
    """The checks below can fail: the graph holds modules of every part and arrows between them."""
    parts = {import_graph.part_of(m) for m in graph.modules}
    assert {"tandem.shared", "tandem.client", "tandem.services", "tandem.console", "tandem.cli"} <= parts, parts
    arrows = import_graph.part_arrows(graph)
    assert arrows.get(("tandem.services", "tandem.shared"), 0) > 10, arrows


def test_no_arrow_runs_back_up_the_layers(graph):
    bad = import_graph.upward_arrows(graph)
    assert not bad, "imports against the layers: " + "; ".join(f"{a} imports {b}" for a, b in bad)


def test_no_service_imports_a_peer_service(graph):
    bad = import_graph.peer_service_imports(graph)
    assert not bad, "a service imports another: " + "; ".join(f"{a} imports {b}" for a, b in bad)


def test_no_import_circle_between_packages(graph):
    cycles = import_graph.package_cycles(import_graph.package_edges(graph))
    assert not cycles, "packages that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


# tandem modules each low layer may import (beside its own package)
MAY_IMPORT = {
    "tandem.shared.protocol": ("tandem.shared.protocol",),
    "tandem.client": ("tandem.client", "tandem.shared.protocol", "tandem.shared.infra.config",
                      "tandem.shared.infra.liveness", "tandem.shared.infra.metrics", "tandem.shared.auth"),
}
COMPUTE_LIBRARIES = ("torch", "triton", "numpy", "safetensors")


@pytest.mark.parametrize("layer", MAY_IMPORT)
def test_low_layers_import_only_what_the_rule_allows(graph, layer):
    bad = sorted((m, t) for m, targets in graph.imports.items() if m == layer or m.startswith(layer + ".")
                 for t in targets if not t.startswith(MAY_IMPORT[layer]))
    assert not bad, f"{layer} reaches beyond its layer: " + "; ".join(f"{a} imports {b}" for a, b in bad)


@pytest.mark.parametrize("layer", MAY_IMPORT)
def test_low_layers_name_no_compute_library(graph, layer):
    """Even a lazy import counts: a torch import inside a function still needs torch installed."""
    found = []
    for module, path in graph.modules.items():
        if not (module == layer or module.startswith(layer + ".")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{module}: {n}" for n in names if n.split(".")[0] in COMPUTE_LIBRARIES]
    assert not found, f"{layer} imports compute libraries: " + "; ".join(found)

# The model package's ``config`` and ``meta`` are plain data (the router reads a model's shape and
# tokenizer); every other compute module is forbidden.
FORBIDDEN = ("torch", "triton", "numpy", "safetensors", "tandem.shared.engine", "tandem.shared.kvcache",
             "tandem.shared.train", "tandem.shared.model.llama", "tandem.shared.model.loader",
             "tandem.shared.model.presets", "tandem.shared.model.reference", "tandem.shared.model.triton_ops")

CASES = {
    "protocol": ["tandem.shared.protocol.codec", "tandem.shared.kvtransfer.frames", "tandem.shared.protocol.subjects",
                 "tandem.shared.protocol.block_hashes"],
    "client": ["tandem.client"],
    "router": ["tandem.services.router.service"],
    "kvstore service side": ["tandem.services.kvstore.service"],
    "frontend": ["tandem.services.frontend.service"],
    "text": ["tandem.shared.text.tokenizer", "tandem.shared.text.chat_template"],
}
# What the text layer may load of tandem's own packages: itself and the wire protocol below it.
TEXT_LAYER_MAY_LOAD = ("tandem.shared.text", "tandem.shared.protocol")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(modules: list[str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing {modules} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", CASES)
def test_imports_no_torch_and_no_compute_layer(case):
    loaded = loaded_modules(CASES[case])
    bad = sorted({f for f in FORBIDDEN for m in loaded if m == f or m.startswith(f + ".")})
    assert not bad, f"{case} ({', '.join(CASES[case])}) loads {', '.join(bad)}"


def test_text_layer_imports_only_the_layers_below_it():
    """The chat template is shared by the front end and the trainer: it must stay in the text layer."""
    loaded = loaded_modules(CASES["text"])
    ours = [m for m in loaded if m.startswith("tandem.") and m != "tandem.shared"]
    above = sorted(m for m in ours if not m.startswith(TEXT_LAYER_MAY_LOAD))
    assert not above, f"the text layer ({', '.join(CASES['text'])}) loads {', '.join(above)}"


def test_the_probe_sees_torch_where_it_is_used():
    """The check above can fail: a worker's module does load torch."""
    assert "torch" in loaded_modules(["tandem.services.common.worker"])
