"""The ipyparallel engine's worker half: how a worker's event batches reach the notebook.

Workers import this module, not :mod:`.ipyparallel` (the notebook's side of the adapter):
the event channel is passed to them by reference, and importing the adapter there would cost
each new worker the notebook's modules.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..telemetry.events import Batch

#: the prefix of nbdist's keys among an engine's data messages
KEY = "nbdist:"


def publish(batch: Batch) -> None:
    """Send one event batch over the engine's IOPub channel."""
    from ipyparallel.datapub import publish_data

    # Unique keys, because the client merges data messages into one dict per request.
    publish_data({f"{KEY}{batch['rank']}:{batch['seq']}": batch})


class ByName:
    """A module-level function that travels by its name: ipyparallel sends a function's code
    with every call (8 kB and about 0.1 ms for ``run_cell``, packed in the notebook and
    rebuilt on each engine); this travels as its module and name, as pickle sends one."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` by name where it is its module's attribute of that name, else ``fn``."""
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module is None or "." in name or getattr(sys.modules.get(module), name, None) is not fn:
            return fn
        return cls(module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)

    def __getstate__(self) -> tuple[str, str]:
        return self.module, self.name

    def __setstate__(self, state: tuple[str, str]) -> None:
        self.module, self.name = state

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"
