"""The import rules of the house, checked by reading every import: function-local ones, those
in display hooks (``__repr__``, ``_repr_html_``) and those under ``if TYPE_CHECKING:`` too.

Commands flow down (magics → session → backends → runtime on the workers), events flow up
(runtime → telemetry's run record → display). No module imports one that imports it back,
counted as ``shared/tools/import_cycles.py`` counts: ``from pkg import name`` reads as importing
``pkg`` as well as ``pkg.name``, and a package may import its own submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nbdist"

# module or folder prefix -> prefixes it must never import: one rule per room
UI = ("IPython", "ipywidgets")
FORBIDDEN = {
    "nbdist.display": ("nbdist.backends", "nbdist.runtime", "nbdist.session", "nbdist.magics",
                       "nbdist.group", "nbdist.cell", "nbdist.elastic", "nbdist.debugger",
                       "torch"),
    "nbdist.runtime": (*UI, "ipyparallel", "distributed", "dask", "nbdist.display",
                       "nbdist.session", "nbdist.magics", "nbdist.backends", "nbdist.group",
                       "nbdist.cell", "nbdist.boot", "nbdist.elastic", "nbdist.debugger",
                       "nbdist.exporter", "nbdist.telemetry.aggregate", "nbdist.telemetry.run",
                       "nbdist.telemetry.trace", "nbdist.telemetry.stall.report",
                       "nbdist.errors", "nbdist.options"),
    # the numbers: views draw them, they never draw themselves
    "nbdist.telemetry": ("nbdist.session", "nbdist.backends", "nbdist.runtime", "nbdist.magics",
                         "nbdist.display", "nbdist.records", "nbdist.group", "nbdist.cell",
                         *UI, "torch"),
    # records users hold draw themselves through the leaf nbdist.table_layout, never the views
    "nbdist.records": ("nbdist.display", "nbdist.session", "nbdist.backends", "nbdist.runtime",
                       "nbdist.magics", *UI, "torch"),
    "nbdist.backends": ("nbdist.session", "nbdist.magics", "nbdist.display", "nbdist.group",
                        "nbdist.cell", "nbdist.elastic", "nbdist.debugger", *UI),
    # the processes runtime/boot runs: used by backends and the group alike, so below both
    "nbdist.boot": ("nbdist.session", "nbdist.magics", "nbdist.display", "nbdist.backends",
                    "nbdist.group", "nbdist.cell", *UI, "torch"),
    "nbdist.session": ("nbdist.magics", *UI),
    # The session's rooms: who is in the group, and the cell loop. Views reach the cell loop as
    # objects the session made; neither room draws, nor calls back up into the session.
    "nbdist.group": ("nbdist.session", "nbdist.cell", "nbdist.elastic.coordinator",
                     "nbdist.debugger", "nbdist.display", "nbdist.magics", *UI, "torch"),
    "nbdist.cell": ("nbdist.session", "nbdist.display", "nbdist.magics", *UI, "torch"),
    # Elastic training: the notebook's half, and the workers' half, which never reaches back
    # into the notebook's modules (nbdist.elastic, its user-facing name, included).
    "nbdist.elastic": ("nbdist.session", "nbdist.cell", "nbdist.display", "nbdist.magics", *UI,
                       "torch"),
    "nbdist.runtime.elastic": ("nbdist.elastic",),
    # The debugger's and faults' notebook halves: rooms the session calls, which never call
    # back into it nor draw (their few lines are printed).
    "nbdist.debugger": ("nbdist.session", "nbdist.magics", "nbdist.display", *UI, "torch"),
    "nbdist.errors": ("nbdist.session", "nbdist.backends", "nbdist.display", "torch"),
    "nbdist.options": ("nbdist.session", "nbdist.backends", "nbdist.display", "torch"),
    # runs on every cell's text: IPython's hook only, nothing heavy
    "nbdist.magics.automode": ("nbdist.session", "nbdist.backends", "nbdist.runtime",
                               "nbdist.display", "torch", "ipywidgets"),
    # Profiles and the session's record and its export are pure: files and text in, text out.
    **{m: ("nbdist.session", "nbdist.backends", "nbdist.display", "nbdist.magics",
           "nbdist.runtime", "nbdist.group", "nbdist.cell", *UI, "torch")
       for m in ("nbdist.profiles", "nbdist.exporter")},
    # A job started elsewhere: what runs in it is the workers' kind (stdlib, torch, runtime/),
    # and what it sends up is events, never a call into the notebook's rooms.
    "nbdist.agent": (*UI, "ipyparallel", "distributed", "dask", "nbdist.display",
                     "nbdist.session", "nbdist.magics", "nbdist.backends", "nbdist.group",
                     "nbdist.cell", "nbdist.boot", "nbdist.elastic", "nbdist.debugger",
                     "nbdist.exporter", "nbdist.watch", "nbdist.telemetry.aggregate",
                     "nbdist.telemetry.run", "nbdist.errors", "nbdist.options"),
    # The notebook's half: a room the session's twins call; it folds, never draws nor runs
    # the job's code.
    "nbdist.watch": ("nbdist.session", "nbdist.magics", "nbdist.backends", "nbdist.group",
                     "nbdist.cell", "nbdist.runtime", "nbdist.agent.rank",
                     "nbdist.agent.forwarder", "nbdist.agent.hook", *UI, "torch"),
}
# Leaves: no nbdist module (the standard library; the wire also MessagePack), so any layer
# may use them.
LEAVES = ("nbdist.table_layout", "nbdist.telemetry.units", "nbdist.telemetry.intervals",
          "nbdist.telemetry.states", "nbdist.telemetry.events",
          "nbdist.telemetry.stall.thresholds", "nbdist.runtime.results", "nbdist.runtime.env",
          # the engines by name: the option records and the worker template read it
          "nbdist.backends.registry",
          # the attach line and its frames: the job's agent and the notebook's collector
          "nbdist.agent.wire")
# Packages whose __init__ only documents the room: importing a leaf inside them stays cheap.
EMPTY_PACKAGES = ("nbdist.telemetry", "nbdist.telemetry.stall", "nbdist.runtime",
                  "nbdist.backends.dask", "nbdist.backends.ipyparallel", "nbdist.agent",
                  "nbdist.watch")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in root.rglob("*.py")}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
    """Collects (imported name, enclosing function names) pairs from every import statement.

    ``from pkg import name`` gives both ``pkg`` and ``pkg.name``: importing a name from a
    package runs the package, whether the name is a submodule or not.
    """

    def __init__(self, mod: str, is_pkg: bool):
        self.mod, self.is_pkg = mod, is_pkg
        self.found: list[tuple[str, tuple[str, ...]]] = []
        self._funcs: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._funcs.append(node.name)
        self.generic_visit(node)
        self._funcs.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, tuple(self._funcs)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.mod, self.is_pkg, node)
        self.found.append((base, tuple(self._funcs)))
        for alias in node.names:
            self.found.append((f"{base}.{alias.name}", tuple(self._funcs)))


def imports_of(mod: str, path: Path) -> list[tuple[str, tuple[str, ...]]]:
    visitor = _Imports(mod, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return visitor.found


def _module_of(name: str, modules: set[str]) -> str:
    """The package's module that importing ``name`` runs ("" for none: another package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """The package's modules and, for each, the other modules of the package it imports."""
    modules = all_modules(root)
    names = set(modules)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for target, _funcs in imports_of(mod, path):
            to = _module_of(target, names)
            if to and to != mod:
                edges[mod].add(to)
    return edges


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_rules(layer):
    modules = all_modules()
    bad = set()
    for mod, path in modules.items():
        if not _matches(mod, layer):
            continue
        for target, funcs in imports_of(mod, path):
            target = _module_of(target, set(modules)) or target
            if target in LEAVES:
                continue  # stdlib only: any layer may use them
            for banned in FORBIDDEN[layer]:
                if _matches(target, banned) and not _matches(target, layer):
                    bad.add(f"{mod} imports {target}" + (f" in {funcs[-1]}()" if funcs else ""))
    assert not bad, "\n".join(sorted(bad))


def test_leaves_import_no_nbdist_module():
    modules = all_modules()
    for leaf in LEAVES:
        inner = [t for t, _ in imports_of(leaf, modules[leaf])
                 if _matches(t, "nbdist") and not t.startswith("nbdist.telemetry.events")]
        assert not inner, f"{leaf} imports {inner}"


def import_cycles(edges: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """Every group of modules that import each other, by Tarjan's strongly connected
    components. As ``import_cycles.py`` counts: a group is a cycle when two or more plain
    modules (not ``packages``, the ``__init__`` modules) take part in it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len([m for m in comp if m not in packages]) >= 2:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def _packages(root: Path = ROOT) -> set[str]:
    return {m for m, p in all_modules(root).items() if p.name == "__init__.py"}


def test_no_import_cycles():
    cycles = import_cycles(graph(), _packages())
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_function_local_imports(tmp_path):
    # The rules are only worth having if a lazy import cannot slip past them.
    src = "def f():\n    from ..session import Session\n"
    path = tmp_path / "mod.py"
    path.write_text(src)
    found = imports_of("nbdist.display.mod", path)
    assert ("nbdist.session", ("f",)) in found


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, src in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(src)
    return pkg


def test_the_checker_counts_cycles_through_display_hooks_and_type_checking(tmp_path):
    # A record drawing itself through a view that names it for type checkers is a cycle.
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "record.py": "class R:\n    def _repr_html_(self):\n"
                     "        from .view import draw\n        return draw(self)\n",
        "view.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from .record import R\n",
        "leaf.py": "",
    })
    assert import_cycles(graph(pkg), _packages(pkg)) == [["pkg.record", "pkg.view"]]


def test_the_checker_reads_from_dot_import_as_importing_the_package(tmp_path):
    # `from . import automode` runs the package: here its __init__ imports _extension, which
    # imports magics, which imports the package back.
    pkg = _package(tmp_path, {
        "__init__.py": "from ._extension import load\n",
        "_extension.py": "def load():\n    from .magics import M\n",
        "magics.py": "from . import automode\n",
        "automode.py": "",
    })
    assert import_cycles(graph(pkg), _packages(pkg)) == [
        ["pkg", "pkg._extension", "pkg.magics"]]
    (pkg / "magics.py").write_text("import pkg.automode as automode\n")
    assert import_cycles(graph(pkg), _packages(pkg)) == []


@pytest.mark.parametrize("package", EMPTY_PACKAGES)
def test_packages_over_leaves_import_nothing(package):
    # A worker imports nbdist.telemetry.stall.thresholds or a backend's worker half: the
    # packages on the way must not pull the notebook's side in with them.
    path = all_modules()[package]
    assert imports_of(package, path) == [], f"{package}/__init__.py imports something"
