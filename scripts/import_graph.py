"""tandem's import graph, read from the source (no module is imported): which top-level part imports
which, any arrow that runs back up the layers, any import circle between packages, any service that
imports a peer service.

    python3 scripts/import_graph.py            # the summary; exit 1 if the layer rule is broken
    python3 scripts/import_graph.py --edges    # every package-to-package arrow too

The layers, bottom up: ``tandem.shared`` (the wire protocol, engine, model, trainer, transport),
``tandem.client`` (the library an application uses), ``tandem.services`` and ``tandem.console``
(side by side: neither imports the other), ``tandem.cli`` (the command; nothing imports it).
tests/unit/test_layers.py runs the same checks.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package prefix -> folder in the checkout (setup.py maps the same four)
FOLDERS = {"tandem.shared": "shared", "tandem.services": "services", "tandem.console": "console", "tandem": "tandem"}
LAYER = {"tandem.shared": 0, "tandem.client": 1, "tandem.services": 2, "tandem.console": 2, "tandem.cli": 3}


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)  # module name -> file
    imports: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # module -> tandem modules


def module_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for prefix, folder in FOLDERS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if prefix == "tandem" and rel.parts[0] in ("shared", "services", "console"):
                continue  # the links to the other three folders
            parts = rel.with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import in ``module`` names (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build() -> Graph:
    graph = Graph(modules=module_files())
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = absolute(module, is_package, node)
                # ``from pkg import mod`` names a module when pkg.mod is one
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in graph.modules else target for a in node.names]
            else:
                continue
            for name in names:
                if name == "tandem" or name.startswith("tandem."):
                    graph.imports[module].add(_known(name, graph.modules))
    return graph


def _known(name: str, modules: dict[str, Path]) -> str:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def part_of(module: str) -> str:
    for part in sorted(LAYER, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    return "tandem"  # the root package: tandem/__init__.py, tandem/__main__.py


def package_of(module: str, modules: dict[str, Path]) -> str:
    return module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def upward_arrows(graph: Graph) -> list[tuple[str, str]]:
    """(importer, imported) where the imported module's layer is above the importer's."""
    bad = []
    for module, targets in graph.imports.items():
        source = part_of(module)
        for target in targets:
            dest = part_of(target)
            if source in LAYER and dest in LAYER and LAYER[dest] > LAYER[source]:
                bad.append((module, target))
            elif source in LAYER and dest in LAYER and LAYER[dest] == LAYER[source] and dest != source:
                bad.append((module, target))  # services and the console side by side
            elif source != "tandem" and dest == "tandem" and target != "tandem":
                bad.append((module, target))  # only the command is above the root's __main__
    return sorted(bad)


def peer_service_imports(graph: Graph) -> list[tuple[str, str]]:
    bad = []
    for module, targets in graph.imports.items():
        if not module.startswith("tandem.services."):
            continue
        own = module.split(".")[2]
        for target in targets:
            if target.startswith("tandem.services.") and target.split(".")[2] not in (own, "common"):
                bad.append((module, target))
    return sorted(bad)


def package_edges(graph: Graph) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.imports.items():
        source = package_of(module, graph.modules)
        for target in targets:
            dest = package_of(target, graph.modules)
            if dest != source and not source.startswith(dest + "."):  # a package may use its parent's __init__
                edges[source].add(dest)
    return edges


def package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(set(edges) | {d for ds in edges.values() for d in ds}):
        if node not in index:
            visit(node)
    return sorted(found)


def part_arrows(graph: Graph) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for module, targets in graph.imports.items():
        for target in targets:
            source, dest = part_of(module), part_of(target)
            if source != dest:
                counts[(source, dest)] += 1
    return dict(counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edges", action="store_true", help="print every package-to-package arrow too")
    args = ap.parse_args()
    graph = build()
    print(f"{len(graph.modules)} modules, {sum(len(t) for t in graph.imports.values())} imports between them")
    print("arrows between top-level parts (importer -> imported: imports):")
    for (source, dest), count in sorted(part_arrows(graph).items()):
        print(f"  {source:16} -> {dest:16} {count}")
    edges = package_edges(graph)
    if args.edges:
        for source in sorted(edges):
            print(f"  {source} -> {', '.join(sorted(edges[source]))}")
    problems = [("arrows back up the layers", " -> ", upward_arrows(graph)),
                ("service modules importing a peer service", " -> ", peer_service_imports(graph)),
                ("import circles between packages", " <-> ", package_cycles(edges))]
    for title, joiner, found in problems:
        print(f"{title}: {len(found)}")
        for item in found:
            print("  " + joiner.join(item))
    return 1 if any(found for _, _, found in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
