"""The public API says what it raises: every public function of the user's API (the
:class:`~nbdist.session.Session`'s methods, the job's :class:`~nbdist.group.membership.Membership`,
:mod:`nbdist.options`, and the functions in ``nbdist.__all__``) that raises, or whose docstring
says it raises, has a numpydoc ``Raises`` section, and that section names each exception its
body raises (or a base class of it). A Python twin in ``nbdist/__init__.py`` says what its
session method raises, too.

Read from the source (AST): what a body raises is its ``raise X`` statements, plus the job's
guard (``.require()`` raises :class:`~nbdist.errors.NoClusterError`) and the option checks
(``parse_ranks``, ``check_*`` raise :class:`~nbdist.errors.OptionError`).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Callable, Optional

import pytest

import nbdist
from nbdist import errors, options
from nbdist.group import membership
from nbdist.group.cluster import Cluster
from nbdist.runtime import packing
from nbdist.session import Session

#: calls that raise on their caller's behalf, and what they raise
GUARDS = {"require": "NoClusterError", "parse_ranks": "OptionError",
          "check_choice": "OptionError", "check_positive": "OptionError",
          "check_at_least": "OptionError"}
SECTION = re.compile(r"^(\s*)Raises\n\1-{6}\n(.*?)(?=^\1\S[^\n]*\n\1-{3,}\n|\Z)", re.S | re.M)


def raises_section(doc: str) -> Optional[list[str]]:
    """The exception names a numpydoc ``Raises`` section lists (None: no section)."""
    m = SECTION.search(doc)
    if m is None:
        return None
    indent, body = m.group(1), m.group(2)
    names = []
    for line in body.splitlines():
        if line.startswith(indent) and line[len(indent):][:1].strip():  # an entry, not its text
            names += [n.strip().split(".")[-1] for n in line.split(",") if n.strip()]
    return names


def raised_names(fn: ast.FunctionDef) -> set[str]:
    """What ``fn``'s body raises by name, and what the guards it calls raise."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name):
                out.add(exc.id)
            elif isinstance(exc, ast.Attribute):
                out.add(exc.attr)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in GUARDS:
                out.add(GUARDS[name])
    return out


def says_it_raises(doc: str) -> bool:
    prose = SECTION.sub("", doc)
    return re.search(r"\braise[sd]?\b", prose, re.I) is not None


def exception(name: str, module: ModuleType) -> Optional[type]:
    for where in (module, errors, builtins):
        found = getattr(where, name, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    return None


class Api:
    """One public function or method of the API: its source, docstring and module."""

    def __init__(self, qualname: str, fn: Callable[..., Any], doc: Optional[str] = None
                 ) -> None:
        self.qualname = qualname
        self.module = importlib.import_module(fn.__module__)
        self.node: ast.FunctionDef = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        self.doc = inspect.getdoc(fn) or "" if doc is None else inspect.cleandoc(doc)


def public_methods(cls: type) -> Iterator[Api]:
    """The public methods ``cls`` defines; an override without a docstring of its own is its
    base's method to a reader (``help()`` and the reference show the base's docstring)."""
    for name, member in vars(cls).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        if member.__doc__ is None and any(name in vars(b) for b in cls.__mro__[1:]):
            continue
        yield Api(f"{cls.__name__}.{name}", member)


def the_api() -> list[Api]:
    found = [*public_methods(Session), *public_methods(Cluster),
             *public_methods(membership.Membership),
             Api("packing.pack", packing.pack)]
    for name, obj in vars(options).items():
        if (not name.startswith("_") and inspect.isfunction(obj)
                and obj.__module__ == options.__name__):
            found.append(Api(f"options.{name}", obj))
        elif inspect.isclass(obj) and obj.__module__ == options.__name__:
            found += public_methods(obj)
            if "__post_init__" in vars(obj):  # a record's checks: its class says what they raise
                found.append(Api(f"options.{name}", obj.__post_init__, obj.__doc__ or ""))
    for name in nbdist.__all__:
        obj = getattr(nbdist, name)
        if inspect.isfunction(obj):
            found.append(Api(f"nbdist.{name}", obj))
    return found


API = the_api()


def test_the_api_is_found():
    names = {a.qualname for a in API}
    assert {"Session.run_cell", "Cluster.scale", "Session.kill", "Membership.call",
            "options.parse_ranks", "nbdist.start", "nbdist.mesh"} <= names
    assert {"options.ClusterOptions", "options.CellOptions"} <= names
    assert len(API) > 70


@pytest.mark.parametrize("api", API, ids=lambda a: a.qualname)
def test_what_raises_says_so_in_a_raises_section(api: Api):
    raised = raised_names(api.node)
    listed = raises_section(api.doc)
    if not raised and not says_it_raises(api.doc):
        return
    assert listed, (f"{api.qualname} raises {sorted(raised) or '(its docstring says so)'} "
                    "but has no numpydoc Raises section")
    documented = [c for c in (exception(n, api.module) for n in listed) if c is not None]
    for name in raised:
        cls = exception(name, api.module)
        if cls is None:
            continue  # not an exception class (a re-raised variable)
        assert name in listed or any(issubclass(cls, d) for d in documented), \
            f"{api.qualname} raises {name}, which its Raises section does not name"


def twins() -> list[tuple[str, str]]:
    """(``nbdist.<name>``, the Session method it calls) for each Python twin."""
    out = []
    for name in nbdist.__all__:
        obj = getattr(nbdist, name)
        if not inspect.isfunction(obj) or obj.__module__ != "nbdist":
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(obj)))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Call)
                    and getattr(node.func.value.func, "id", "") == "current_session"):
                out.append((name, node.func.attr))
    return out


@pytest.mark.parametrize(("twin", "method"), twins())
def test_a_python_twin_says_what_its_session_method_raises(twin: str, method: str):
    session_side = raises_section(inspect.getdoc(getattr(Session, method)) or "")
    twin_side = raises_section(inspect.getdoc(getattr(nbdist, twin)) or "")
    if session_side is None:
        return
    assert twin_side, f"nbdist.{twin} has no Raises section; Session.{method} has one"
    assert ("NoClusterError" in twin_side) == ("NoClusterError" in session_side), twin


def test_the_reader_of_raises_sections():
    doc = inspect.cleandoc('''Do it.

        Parameters
        ----------
        x : int
            A number; raises nothing by itself.

        Raises
        ------
        OptionError
            Bad.
        TypeError, pickle.PicklingError
            Cannot be pickled.

        Examples
        --------
        >>> f()
        ''')
    assert raises_section(doc) == ["OptionError", "TypeError", "PicklingError"]
    assert raises_section("Do it; raises OptionError.") is None
    assert says_it_raises("Do it; raises OptionError.")
    assert not says_it_raises("Do it, fast.\n\nRaises\n------\nOptionError\n    Bad.")

    def guarded(m: Any, spec: str) -> None:
        m.require()
        if spec == "x":
            raise errors.ExportError("x")

    node = ast.parse(textwrap.dedent(inspect.getsource(guarded))).body[0]
    assert raised_names(node) == {"NoClusterError", "ExportError"}
