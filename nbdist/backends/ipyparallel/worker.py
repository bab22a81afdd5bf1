"""The ipyparallel engine's worker half: how a worker's event batches reach the notebook.

Workers import this module, not :mod:`.adapter` (the notebook's side of the adapter):
the event channel is passed to them by reference, and importing the adapter there would cost
each new worker the notebook's modules.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    from ...telemetry.events import Batch

#: the prefix of nbdist's keys among an engine's data messages
KEY = "nbdist:"


def publish(batch: Union[Batch, list[Batch]]) -> None:
    """Send one event batch over the engine's IOPub channel (a list of them: one message, a
    node relay's, :mod:`nbdist.runtime.node_relay`)."""
    from ...runtime.launched import shell

    data = {f"{KEY}{b['rank']}:{b['seq']}": b
            for b in (batch if isinstance(batch, list) else [batch])}
    # Unique keys, because the client merges data messages into one dict per request. The
    # engine's shell, found while a cell hides it: ipyparallel's publish_data would ask
    # ZMQInteractiveShell.instance(), which makes a second shell where the first is hidden.
    engine = shell()
    if engine is None:
        from ipyparallel.datapub import publish_data

        publish_data(data)
        return
    engine.data_pub.publish_data(data)


class ByName:
    """A module-level function that travels by its name: ipyparallel sends a function's code
    with every call (8 kB and about 0.1 ms for ``run_cell``, packed in the notebook and
    rebuilt on each engine); this travels as its module and name, as pickle sends one.

    It may carry a call's arguments too (:meth:`bind`): the call is then one small pickle,
    where ipyparallel packs and unpacks each argument on its own (about 35 µs on each side
    for a cell's ten)."""

    __slots__ = ("module", "name", "args", "kwargs")

    def __init__(self, module: str, name: str, args: tuple = (),
                 kwargs: Optional[dict[str, Any]] = None) -> None:
        self.module, self.name = module, name
        self.args, self.kwargs = args, kwargs or {}

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` by name where it is its module's attribute of that name, else ``fn``."""
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module is None or "." in name or getattr(sys.modules.get(module), name, None) is not fn:
            return fn
        return cls(module, name)

    @classmethod
    def bind(cls, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
             ) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
        """What to hand ipyparallel's apply for ``fn(*args, **kwargs)``: the call as one
        object, or (``fn`` without a name, or buffers among the arguments, which ipyparallel
        sends without copying only as arguments of their own) ``fn`` by name and the
        arguments as they are."""
        by_name = cls.of(fn)
        if isinstance(by_name, cls) and all(map(_inline, args)) and \
                all(map(_inline, kwargs.values())):
            return cls(by_name.module, by_name.name, tuple(args), kwargs), (), {}
        return by_name, tuple(args), kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(importlib.import_module(self.module), self.name)
        return fn(*self.args, *args, **self.kwargs, **kwargs)

    def __getstate__(self) -> tuple[str, str, tuple, dict[str, Any]]:
        return self.module, self.name, self.args, self.kwargs

    def __setstate__(self, state: tuple[str, str, tuple, dict[str, Any]]) -> None:
        self.module, self.name, self.args, self.kwargs = state

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


#: what ipyparallel sends as separate, uncopied buffers when an argument is one (or holds
#: them one level down, in a list, tuple or dict)
_BUFFERS = (bytes, bytearray, memoryview)


def _inline(value: Any) -> bool:
    """True where ipyparallel would pickle ``value`` whole anyway (no buffers of its own)."""
    if isinstance(value, (list, tuple)):
        return not any(_buffer(v) for v in value)
    if isinstance(value, dict):
        return not any(_buffer(v) for v in value.values())
    return not _buffer(value)


def _buffer(value: Any) -> bool:
    return isinstance(value, _BUFFERS) or type(value).__module__ == "numpy"
