"""``display()`` on a rank: rich outputs become the rank's events, for the notebook to show.

A rank is a launched process to its libraries (:mod:`.launched`): IPython has no shell there,
so its ``display()`` would print a repr, and matplotlib draws with its default, non-interactive
backend. Inside a cell, :func:`capturing` makes what code displays on purpose reach the
notebook instead, as :func:`~nbdist.telemetry.events.display` events of the rank:

* IPython's ``display()``, ``update_display()`` and ``DisplayHandle.update()``: the objects'
  MIME bundles (:func:`~.execute.mimebundle`), with their ``display_id``;
* ``matplotlib.pyplot.show()``: each open figure as a PNG, then closed (as the inline backend
  does); a figure as a cell's last value is a PNG too (:func:`figure_png`).

IPython and matplotlib are never imported here: their functions are wrapped where the process
has the modules already, or when a cell imports them (an import hook). Outside cells, the
wrapped functions are the libraries' own.
"""

from __future__ import annotations

import base64
import builtins
import importlib.abc
import importlib.machinery
import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

from ..telemetry.events import display as display_event
from .capture import EventSink
from .execute import mimebundle

#: bytes of one display's bundle past which it is replaced by a line saying so
MAX_BYTES = 8 << 20

_sink: Optional[EventSink] = None  # the running cell's


@contextmanager
def capturing(sink: EventSink) -> Iterator[None]:
    """Send what the cell displays as ``sink``'s events for the cell's time."""
    global _sink
    install()
    _sink = sink
    try:
        yield
    finally:
        _sink = None


def figure_png(value: Any) -> Optional[str]:
    """A matplotlib figure as base64 PNG text; None for anything else."""
    if not any(c.__module__ == "matplotlib.figure" and c.__name__ == "Figure"
               for c in type(value).__mro__):
        return None
    buf = io.BytesIO()
    value.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def bundle_of(value: Any) -> dict[str, Any]:
    """What ``display(value)`` shows: its MIME bundle, a figure as its PNG."""
    bundle = mimebundle(value) or {"text/plain": repr(value)}
    png = figure_png(value)
    if png is not None:
        bundle["image/png"] = png
    for mime, data in list(bundle.items()):
        if isinstance(data, bytes):  # images travel as base64 text, as in a kernel's messages
            bundle[mime] = base64.b64encode(data).decode("ascii")
    return bundle


def _size(bundle: dict[str, Any]) -> int:
    return sum(len(v) if isinstance(v, (str, bytes)) else len(repr(v)) for v in bundle.values())


def send(data: dict[str, Any], metadata: Optional[dict[str, Any]] = None,
         display_id: Optional[str] = None, update: bool = False) -> None:
    """One display (or ``update`` of ``display_id``) from this rank."""
    sink = _sink
    if sink is None:
        return
    if _size(data) > MAX_BYTES:
        data = {"text/plain": f"[nbdist: a display of {_size(data):,} bytes was not sent to the "
                              f"notebook (more than {MAX_BYTES:,})]"}
    sink.emit(display_event(data, metadata, display_id, update))


# ----------------------------------------------------------------- IPython's display()
def _wrap_display(original: Callable[..., Any], handle: Callable[[str], Any]) -> Callable:
    def display(*objs: Any, include: Any = None, exclude: Any = None, metadata: Any = None,
                transient: Any = None, display_id: Any = None, raw: bool = False,
                clear: bool = False, **kwargs: Any) -> Any:
        if _sink is None:
            return original(*objs, include=include, exclude=exclude, metadata=metadata,
                            transient=transient, display_id=display_id, raw=raw, clear=clear,
                            **kwargs)
        if display_id is True:
            display_id = os.urandom(16).hex()
        for obj in objs:
            if not raw and callable(getattr(obj, "_ipython_display_", None)) \
                    and not isinstance(obj, type):
                obj._ipython_display_()  # draws itself through display() again
                continue
            data = dict(obj) if raw and isinstance(obj, dict) else bundle_of(obj)
            if include:
                data = {k: v for k, v in data.items() if k in include}
            if exclude:
                data = {k: v for k, v in data.items() if k not in exclude}
            send(data, metadata, str(display_id) if display_id else None,
                 bool(kwargs.get("update")))
        return handle(display_id) if display_id else None

    display.__wrapped__ = original  # type: ignore[attr-defined]
    display.__doc__ = original.__doc__
    return display


def _patch_ipython(module: Any) -> None:
    """Wrap ``display`` in IPython's ``display_functions`` and where it is re-exported."""
    original = module.display
    if hasattr(original, "__wrapped__"):
        return
    wrapped = _wrap_display(original, module.DisplayHandle)
    module.display = wrapped  # update_display() and DisplayHandle call it by this name
    for name in ("IPython.display", "IPython.core.display"):
        other = sys.modules.get(name)
        if other is not None and getattr(other, "display", None) is original:
            other.display = wrapped
    if vars(builtins).get("display") is original:  # an IPython kernel's builtin
        builtins.display = wrapped  # type: ignore[attr-defined]


# ----------------------------------------------------------------- matplotlib
def _patch_pyplot(pyplot: Any) -> None:
    """``plt.show()`` in a cell displays each open figure and closes it, as inline does."""
    original = pyplot.show
    if hasattr(original, "__wrapped__"):
        return

    def show(*args: Any, **kwargs: Any) -> Any:
        if _sink is None:
            return original(*args, **kwargs)
        for num in pyplot.get_fignums():
            fig = pyplot.figure(num)
            send(bundle_of(fig))
        pyplot.close("all")
        return None

    show.__wrapped__ = original  # type: ignore[attr-defined]
    show.__doc__ = original.__doc__
    pyplot.show = show


PATCHES: dict[str, Callable[[Any], None]] = {
    "IPython.core.display_functions": _patch_ipython,
    "matplotlib.pyplot": _patch_pyplot,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module of :data:`PATCHES` as soon as it is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        class Patching(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                run(module)
                try:
                    patch(module)
                except Exception as exc:  # never fail the user's import
                    sys.__stderr__.write(f"nbdist: could not hook {fullname}: {exc!r}\n")

        spec.loader = Patching()
        return spec


_hook = _AfterImport()


def install() -> None:
    """Patch the modules already imported, and the others when they are. Idempotent."""
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            try:
                patch(module)
            except Exception as exc:  # an unexpected version: its display stays its own
                sys.__stderr__.write(f"nbdist: could not hook {name}: {exc!r}\n")
