"""The import rules of the house, checked by reading every import (function-local ones too).

Commands flow down (magics → session → backends → runtime on the workers), events flow up
(runtime → telemetry's run record → display). Imports under ``if TYPE_CHECKING:`` are for type
checkers only and do not count; a display hook (``__repr__``, ``_repr_html_``) may reach the
display layer, which draws for it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "nbdist"
DISPLAY_HOOKS = {"__repr__", "_repr_html_", "_repr_mimebundle_", "_ipython_display_"}

# module prefix -> prefixes it must never import
FORBIDDEN = {
    "nbdist.display": ("nbdist.backends", "nbdist.runtime", "nbdist.session", "nbdist.magics",
                       "torch"),
    "nbdist.runtime": ("IPython", "ipywidgets", "ipyparallel", "distributed", "dask",
                       "nbdist.display", "nbdist.session", "nbdist.magics", "nbdist.backends",
                       "nbdist.telemetry.aggregate", "nbdist.telemetry.run",
                       "nbdist.telemetry.trace", "nbdist.telemetry.stall", "nbdist.errors",
                       "nbdist.options"),
    "nbdist.telemetry": ("nbdist.session", "nbdist.backends", "nbdist.runtime", "nbdist.magics",
                         "IPython", "ipywidgets", "torch"),
    "nbdist.backends": ("nbdist.session", "nbdist.magics", "nbdist.display", "IPython",
                        "ipywidgets"),
    "nbdist.session": ("nbdist.magics", "IPython", "ipywidgets"),
    "nbdist.errors": ("nbdist.session", "nbdist.backends", "nbdist.display", "torch"),
    "nbdist.options": ("nbdist.session", "nbdist.backends", "nbdist.display", "torch"),
    # runs on every cell's text: IPython's hook only, nothing heavy
    "nbdist.automode": ("nbdist.session", "nbdist.backends", "nbdist.runtime", "nbdist.display",
                        "torch", "ipywidgets"),
    # Profiles, the session's record and export are pure: files and text in, text out.
    **{m: ("nbdist.session", "nbdist.backends", "nbdist.display", "nbdist.magics",
           "nbdist.runtime", "IPython", "ipywidgets", "torch")
       for m in ("nbdist.profiles", "nbdist.history", "nbdist.export")},
}
# Leaves: stdlib only, so any layer may use them.
LEAVES = ("nbdist.telemetry.units", "nbdist.telemetry.intervals", "nbdist.telemetry.states",
          "nbdist.telemetry.events", "nbdist.telemetry.stall_rules", "nbdist.runtime.results",
          "nbdist.runtime.env")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports(ast.NodeVisitor):
    """Collects (imported module, enclosing function names) pairs, skipping TYPE_CHECKING."""

    def __init__(self, mod: str, is_pkg: bool, modules: set[str]):
        self.mod, self.is_pkg, self.modules = mod, is_pkg, modules
        self.found: list[tuple[str, tuple[str, ...]]] = []
        self._funcs: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

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
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self.found.append((sub if sub in self.modules else base, tuple(self._funcs)))


def imports_of(mod: str, path: Path, modules: set[str]) -> list[tuple[str, tuple[str, ...]]]:
    visitor = _Imports(mod, path.name == "__init__.py", modules)
    visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return visitor.found


def graph() -> dict[str, set[str]]:
    """nbdist-internal edges, display hooks excluded."""
    modules = all_modules()
    names = set(modules)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for target, funcs in imports_of(mod, path, names):
            if target in names and target != mod and not DISPLAY_HOOKS & set(funcs):
                edges[mod].add(target)
    return edges


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_rules(layer):
    modules = all_modules()
    bad = []
    for mod, path in modules.items():
        if not _matches(mod, layer):
            continue
        for target, funcs in imports_of(mod, path, set(modules)):
            if DISPLAY_HOOKS & set(funcs):
                continue
            for banned in FORBIDDEN[layer]:
                if _matches(target, banned) and not _matches(target, layer):
                    bad.append(f"{mod} imports {target}" + (f" in {funcs[-1]}()" if funcs else ""))
    assert not bad, "\n".join(bad)


def test_leaves_import_no_nbdist_module():
    modules = all_modules()
    for leaf in LEAVES:
        inner = [t for t, _ in imports_of(leaf, modules[leaf], set(modules))
                 if _matches(t, "nbdist") and not t.startswith("nbdist.telemetry.events")]
        assert not inner, f"{leaf} imports {inner}"


def test_no_import_cycles():
    edges = graph()
    # Tarjan's strongly connected components: any with two or more modules is a cycle.
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
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_function_local_imports(tmp_path):
    # The rules are only worth having if a lazy import cannot slip past them.
    src = "def f():\n    from ..session import Session\n"
    path = tmp_path / "mod.py"
    path.write_text(src)
    found = imports_of("nbdist.display.mod", path, {"nbdist.session"})
    assert ("nbdist.session", ("f",)) in found
