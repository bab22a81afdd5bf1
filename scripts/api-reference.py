"""Write ``docs/reference.md``, the magics' and the Python API's reference, from the code.

Plain Markdown (tables, headings, code blocks), so the page reads the same on the repository's
web view as on the docs site. The magics come from their own parsers, the functions, records and
errors from their signatures and docstrings. ``--check`` writes nothing and exits 1 when the
page is not what the code says (a unit test runs it).

    python scripts/api-reference.py          # write docs/reference.md
    python scripts/api-reference.py --check  # is it current?
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference.md"


def md(doc: str | None) -> str:
    """A docstring (reST-flavoured) as Markdown: ``x`` and :role:`~a.b.x` as `x`, a
    paragraph ending in ``::`` followed by an indented block as a code block."""
    text = inspect.cleandoc(doc or "")
    text = re.sub(r":\w+:`(~?)([^`]+)`",
                  lambda m: f"`{m.group(2).split('.')[-1] if m.group(1) else m.group(2)}`", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S)
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    section = ""
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and re.fullmatch(r"-{3,}", lines[i + 1].strip()):
            section = line.strip()
            out.append(f"**{section}**")
            out.append("")
            i += 2
            continue
        if line.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(re.sub(r"\s*# doctest:.*$", "", lines[i]))
                i += 1
            out += ["```pycon", *block, "```"]
            continue
        param = re.fullmatch(r"(\w+) : (.+)", line)
        if section in ("Parameters", "Returns", "Raises", "Attributes") and param:
            i += 1
            body = []
            while i < len(lines) and lines[i].startswith("    "):
                body.append(lines[i].strip())
                i += 1
            out.append(f"* `{param.group(1)}` ({param.group(2)}): {' '.join(body)}")
            continue
        # numpydoc's "Raises" (and a bare "Returns" type): the types alone, their text below
        types = re.fullmatch(r"[\w.]+(?:, [\w.]+)*", line)
        if (section in ("Returns", "Raises") and types and i + 1 < len(lines)
                and lines[i + 1].startswith("    ")):
            i += 1
            body = []
            while i < len(lines) and lines[i].startswith("    "):
                body.append(lines[i].strip())
                i += 1
            names = ", ".join(f"`{t}`" for t in line.split(", "))
            out.append(f"* {names}: {' '.join(body)}")
            continue
        if line.rstrip().endswith("::") and i + 1 < len(lines):
            head = line.rstrip()[:-2].rstrip()
            out.append(head + ":" if head else "")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                block.append(lines[i][4:])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            out += ["", "```python", *block, "```", ""]
            continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


def cell(text: str) -> str:
    """``text`` inside a Markdown table cell."""
    return text.replace("|", "\\|")


def anchor(name: str) -> str:
    return f'<a id="{name}"></a>'


def signature(obj: Any, name: str) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        sig = "(...)"
    sig = re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)  # postponed annotations, unquoted
    sig = re.sub(r"<(?:function|class) '?([\w.]+)'?(?: at 0x[0-9a-f]+)?>", r"\1", sig)
    return f"{name}{sig}"


def entry(obj: Any, qualname: str, shown: str, level: str = "###") -> list[str]:
    """Heading, signature and docstring of one function or class."""
    out = [anchor(qualname), f"{level} `{shown}`", ""]
    if not (isinstance(obj, type) and issubclass(obj, BaseException)
            and "__init__" not in vars(obj)):  # an error made from its message alone
        out += ["```text", signature(obj, shown), "```", ""]  # a signature, not code to run
    doc = md(obj.__doc__)
    return out + ([doc, ""] if doc else [])


def methods(cls: type, prefix: str, names: list[str] | None = None) -> list[str]:
    """A table of ``cls``'s public methods and properties (first docstring line each), and
    an anchor per method; inherited ones first, in the order their classes define them (a
    Session's lifecycle comes from its base, the Cluster)."""
    rows = []
    anchors = []
    members: dict[str, object] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object last, and left out
        members.update(vars(klass))
    for name, member in members.items():
        if name.startswith("_") or (names is not None and name not in names):
            continue
        if isinstance(member, property):
            spelled, doc = f"{name}", member.__doc__
        elif callable(member) or isinstance(member, (staticmethod, classmethod)):
            fn = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            doc = fn.__doc__ or next((getattr(k, name).__doc__ for k in cls.__mro__
                                      if name in vars(k) and getattr(k, name).__doc__), None)
            spelled = signature(fn, name).replace("(self, ", "(").replace("(self)", "()")
        else:
            continue
        first = " ".join(md(doc).split("\n\n")[0].split()) if doc else ""
        anchors.append(anchor(f"{prefix}.{name}"))
        rows.append(f"| `{spelled}` | {cell(first)} |")
    if not rows:
        return []
    return ["".join(anchors), "", "| method or property | what it does |", "|---|---|", *rows, ""]


def fields(cls: type) -> list[str]:
    """A table of a dataclass's fields: name, type, default."""
    if not dataclasses.is_dataclass(cls):
        return []
    rows = []
    for f in dataclasses.fields(cls):
        value: Any = f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        default = "" if value is dataclasses.MISSING else repr(value)
        if len(default) > 40:  # a record of records: its own defaults
            default = f"{type(value).__name__}()"
        rows.append(f"| `{f.name}` | `{f.type}` | {f'`{default}`' if default else ''} |")
    return ["| field | type | default |", "|---|---|---|", *rows, ""]


# ---------------------------------------------------------------------------- the magics

def magics() -> list[str]:
    from nbdist.magics import _PARSER, _VERBS, NbdistMagics

    helps = {c.dest: c.help or "" for a in _PARSER._actions
             if isinstance(a, argparse._SubParsersAction) for c in a._choices_actions}
    out = ["## Magics", "",
           "`%load_ext nbdist` registers the line magic `%nbdist VERB` and the cell magics "
           "`%%distributed` and `%%local`. In a notebook, `%nbdist -h`, `%nbdist VERB -h` and "
           "`%%distributed?` show the same text: it is read from the magics' own parsers.", "",
           "| verb | what it does |", "|---|---|"]
    out += [f"| [`%nbdist {n}`](#nbdist-{n}) | {p.description or helps.get(n, '')} |"
            for n, p in _VERBS.items()]
    out.append("")
    for name, parser in _VERBS.items():
        out += _magic(f"%nbdist {name}", f"nbdist-{name}", helps.get(name, ""), parser)
    dist = NbdistMagics.distributed.parser
    out += _magic("%%distributed", "distributed", dist.description or "", dist)
    out += _magic("%%local", "local", NbdistMagics.local.__doc__ or "", None)
    return out


def _magic(name: str, target: str, doc: str, parser: Any) -> list[str]:
    out = [anchor(target), f"### `{name}`", "", md(doc), ""]
    if parser is None:
        return out
    usage = " ".join(parser.format_usage().split())
    usage = re.sub(r"^(usage:|::)\s*%?", "", usage)
    prog = parser.prog.lstrip("%")
    usage = usage[len(prog):] if usage.startswith(prog) else usage
    usage = usage.replace(" [-h]", "")
    out += ["```text", f"{name}{usage}", "```", ""]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) \
                or action.help == argparse.SUPPRESS:
            continue
        choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else None
        value = action.metavar or choices or action.dest.upper()
        if action.option_strings:
            spelled = ", ".join(action.option_strings) + (f" {value}" if action.nargs != 0
                                                            else "")
        else:
            spelled = action.metavar or choices or action.dest
            spelled = f"[{spelled}]" if action.nargs == "?" else spelled
            spelled += " ..." if action.nargs in ("+", "*", argparse.REMAINDER) else ""
        text = " ".join((action.help or "").split()) % {"default": action.default,
                                                          "prog": parser.prog}
        if (action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0
                and action.option_strings and "default" not in text):
            text += f" (default {action.default})"
        out.append(f"* `{spelled}` — {text}" if text else f"* `{spelled}`")
    return out + [""]


# ---------------------------------------------------------------------------- the Python API

def python_api() -> list[str]:
    import nbdist
    from nbdist.session import Session

    inside = {"progress", "log", "mesh", "ParameterServer", "elastic"}
    skip = {"unload_ipython_extension", "__version__"}
    out = ["## Python API", "",
           "Every magic has a twin in the `nbdist` module; they all act on one shared "
           "`nbdist.session.Session` (below). `nbdist.__version__` is the package's version.", ""]
    for name in nbdist.__all__:
        if name in inside or name in skip:
            continue
        out += entry(getattr(nbdist, name), f"nbdist.{name}", f"nbdist.{name}")
    out += entry(Session, "nbdist.session.Session", "nbdist.session.Session")
    out += methods(Session, "nbdist.session.Session")
    from nbdist.display import set_display

    out += entry(set_display, "nbdist.display.set_display", "nbdist.display.set_display")
    out += ["## Inside a `%%distributed` cell", "",
            "These run on the ranks (their worker half needs torch).", ""]
    for name in ("progress", "log", "mesh"):
        out += entry(getattr(nbdist, name), f"nbdist.{name}", f"nbdist.{name}")
    ps = nbdist.ParameterServer
    out += entry(ps, "nbdist.ParameterServer", "nbdist.ParameterServer")
    out += methods(ps, "nbdist.ParameterServer")
    out += ["### Elastic training: `nbdist.elastic`", "", anchor("module-nbdist.elastic"),
            md(nbdist.elastic.__doc__).split("\n\n")[0], "",
            "See [fault tolerance](fault-tolerance.md).", ""]
    el = nbdist.elastic
    out += entry(el.State, "nbdist.elastic.State", "nbdist.elastic.State", "####")
    out += methods(el.State, "nbdist.elastic.State")
    out += entry(el.run, "nbdist.elastic.run", "nbdist.elastic.run", "####")
    out += entry(el.ElasticFunction, "nbdist.elastic.ElasticFunction",
                 "nbdist.elastic.ElasticFunction", "####")
    out += entry(el.ElasticError, "nbdist.elastic.ElasticError", "nbdist.elastic.ElasticError",
                 "####")
    return out


def records() -> list[str]:
    from nbdist.exporter.torchrun import Export
    from nbdist.profiles import Profile
    from nbdist.records import ClusterStatus, Comparison, RemoteValue, WorkerRow
    from nbdist.telemetry.compare import RunFigures
    from nbdist.telemetry.snapshot import RunSnapshot

    out = ["## Records", "", "What the functions above return; plain values to read.", ""]
    for cls, module in ((ClusterStatus, "records"), (WorkerRow, "records"),
                        (RemoteValue, "records"), (Comparison, "records"),
                        (RunFigures, "telemetry.compare"), (RunSnapshot, "telemetry.snapshot"),
                        (Export, "exporter.torchrun"), (Profile, "profiles")):
        qual = f"nbdist.{module}.{cls.__name__}"
        out += [anchor(qual), f"### `{qual}`", "", md(cls.__doc__), ""]
        out += fields(cls) + methods(cls, qual)
    return out


def errors() -> list[str]:
    from nbdist import errors as e

    classes = [c for c in vars(e).values() if isinstance(c, type) and c.__module__ == e.__name__
               and issubclass(c, BaseException)]
    records_ = [c for c in vars(e).values() if isinstance(c, type)
                and c.__module__ == e.__name__ and dataclasses.is_dataclass(c)]
    out = ["## Errors", "",
           "Every error nbdist raises is one of these (`nbdist.errors`); each message says what "
           "went wrong, where, and what to do. The tree:", "", "```text"]

    def tree(cls: type, depth: int) -> None:
        bases = [b.__name__ for b in cls.__bases__ if b.__module__ != e.__name__]
        extra = f" (also {', '.join(bases)})" if bases and depth else ""
        out.append("    " * depth + cls.__name__ + extra)
        for sub in classes:
            if cls in sub.__bases__ and sub is not cls:
                tree(sub, depth + 1)

    roots = [c for c in classes if not any(b in classes for b in c.__bases__)]
    for root in roots:
        if root is not e.NbdistError:
            bases = ", ".join(b.__name__ for b in root.__bases__)
            out.append(f"{root.__name__} ({bases})")
            continue
        tree(root, 0)
    out += ["```", ""]
    for cls in classes:
        out += entry(cls, f"nbdist.errors.{cls.__name__}", f"nbdist.errors.{cls.__name__}")
    for cls in records_:
        qual = f"nbdist.errors.{cls.__name__}"
        out += [anchor(qual), f"### `{qual}`", "", md(cls.__doc__), ""] + fields(cls)
    return out


def page() -> str:
    parts: list[Callable[[], list[str]]] = [magics, python_api, records, errors]
    lines = ["# Reference", "",
             "Generated from the code by `python scripts/api-reference.py` (a unit test checks "
             "that it is current): the magics from their parsers, the functions, records and "
             "errors from their signatures and docstrings.", ""]
    for part in parts:
        lines += part()
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip() + "\n"


def main() -> int:
    sys.path.insert(0, str(ROOT))
    text = page()
    if "--check" in sys.argv[1:]:
        if PAGE.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{PAGE} is not what the code says: "
                             "run python scripts/api-reference.py\n")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
