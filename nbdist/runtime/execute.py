"""Run a cell's source in a persistent namespace, the way a notebook would (no IPython needed)."""

from __future__ import annotations

import ast
import linecache
from typing import Any, Optional

# Rich representations probed on the last expression's value, in IPython's order of preference.
_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
)
_MAX_TEXT = 100_000
#: cells whose source stays registered for tracebacks, the latest ones (a function defined in
#: an older cell shows its frames without their lines)
MAX_SOURCES = 10_000
_sources: dict[str, None] = {}  # the registered cell filenames, oldest first


def compile_cell(source: str, filename: str) -> tuple[Any, Optional[Any]]:
    """Compile ``source`` into (body, last expression or None); register it for tracebacks
    (the latest :data:`MAX_SOURCES` cells stay registered)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    _sources.pop(filename, None)
    _sources[filename] = None
    while len(_sources) > MAX_SOURCES:
        oldest = next(iter(_sources))
        del _sources[oldest]
        linecache.cache.pop(oldest, None)
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, filename, "exec")
    expr = compile(last, filename, "eval") if last is not None else None
    return body, expr


def run_code(source: str, filename: str, namespace: dict) -> Any:
    """Execute ``source`` in ``namespace``; return the value of a trailing expression (or None)."""
    body, expr = compile_cell(source, filename)
    exec(body, namespace)
    if expr is None:
        return None
    value = eval(expr, namespace)
    if value is not None:
        namespace["_"] = value
    return value


def mimebundle(value: Any) -> Optional[dict[str, Any]]:
    """A display bundle for ``value``: text/plain plus every rich repr it offers."""
    if value is None:
        return None
    bundle: dict[str, Any] = {}
    method = getattr(value, "_repr_mimebundle_", None)
    if callable(method):
        try:
            data = method()
            if isinstance(data, tuple):
                data = data[0]
            if isinstance(data, dict):
                bundle.update(data)
        except Exception:  # a broken rich repr falls back to the plain one, as in IPython
            pass
    for mime, name in _REPR_METHODS:
        if mime in bundle or isinstance(value, type):
            continue
        method = getattr(value, name, None)
        if callable(method):
            try:
                data = method()
            except Exception:
                continue
            if data is not None:
                bundle[mime] = data
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<unrepresentable {type(value).__name__}: {exc!r}>"
    if len(text) > _MAX_TEXT:
        text = text[:_MAX_TEXT] + f"... [{len(text) - _MAX_TEXT} more characters]"
    bundle["text/plain"] = text
    return bundle
