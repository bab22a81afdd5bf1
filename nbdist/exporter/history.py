"""What the workers' namespaces were built from since the process group formed.

The session records each ``%%distributed`` cell that succeeded and each push, in order, and
starts a new record when the group is formed again (start, restart, scale). ``%nbdist export``
turns the record into a torchrun script (:mod:`nbdist.exporter.torchrun`). Pure: no torch, no
processes.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import cloudpickle

#: pushed values larger than this (pickled) are not kept: export then says what is missing
MAX_KEPT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class CellEntry:
    """A cell that ran successfully: its source and the ranks it ran on (None: all)."""

    number: int
    source: str
    ranks: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class PushEntry:
    """Values sent to the workers: literals as Python code, the rest pickled.

    ``code`` maps a name to a literal expression that recreates its value; :attr:`blob`
    holds the other values, cloudpickled as one dict, or None when they were too large to
    keep (``dropped`` then names them). They are kept as a copy taken at the push
    (``snapshot``) and pickled when first asked for: a copy of a tensor is a memcpy, its
    pickle several times that, for an export that may never come.
    """

    names: tuple[str, ...]
    code: Mapping[str, str]
    pickle: Optional[bytes] = None
    dropped: tuple[str, ...] = ()
    ranks: Optional[tuple[int, ...]] = None
    snapshot: Optional[dict[str, Any]] = None

    @property
    def blob(self) -> Optional[bytes]:
        """The kept values, cloudpickled as one dict (None: nothing kept)."""
        if self.pickle is None and self.snapshot is not None:
            object.__setattr__(self, "pickle", cloudpickle.dumps(self.snapshot))
        return self.pickle

    @property
    def pickled(self) -> tuple[str, ...]:
        """Names whose value is in :attr:`blob`."""
        return tuple(n for n in self.names if n not in self.code and n not in self.dropped)


Entry = Union[CellEntry, PushEntry]


def literal_code(value: Any) -> Optional[str]:
    """``repr(value)`` when it recreates an equal value of the same type, else None.

    Numbers, strings, booleans, None and containers of them qualify; tensors and objects do
    not (they go to the data file).
    """
    try:
        text = repr(value)
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    try:
        same = type(back) is type(value) and back == value
    except Exception:  # a value whose == is not a plain bool
        return None
    return text if same is True else None


def _copy(values: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A deep copy of ``values`` (what they are now, whatever the notebook does to them
    later), or None for values that cannot be copied."""
    try:
        return copy.deepcopy(values)
    except Exception:
        return None


class History:
    """The ordered record the session keeps; see the module docstring."""

    def __init__(self, max_kept_bytes: int = MAX_KEPT_BYTES) -> None:
        self.entries: list[Entry] = []
        self.max_kept_bytes = max_kept_bytes

    def reset(self) -> None:
        """The group formed again: what ran before does not describe the new job."""
        self.entries = []

    def cell(self, number: int, source: str, ranks: Optional[Sequence[int]] = None) -> None:
        """Record a cell that succeeded on ``ranks`` (None: every rank)."""
        self.entries.append(CellEntry(number, source, tuple(ranks) if ranks is not None
                                      else None))

    def push(self, values: Mapping[str, Any], blob: Optional[bytes] = None,
             ranks: Optional[Sequence[int]] = None, size: Optional[int] = None) -> None:
        """Record a push. ``blob`` is the cloudpickle of ``values`` when the caller has it;
        ``size``, their size sent, when known: values past the limit are then not pickled
        again only to be dropped."""
        code: dict[str, str] = {}
        for name, value in values.items():
            text = literal_code(value)
            if text is not None:
                code[name] = text
        rest = {k: v for k, v in values.items() if k not in code}
        kept: Optional[bytes] = None
        snapshot: Optional[dict[str, Any]] = None
        dropped: tuple[str, ...] = ()
        if rest and size is not None and size > self.max_kept_bytes:
            dropped = tuple(rest)
        elif rest and size is not None and (snapshot := _copy(rest)) is not None:
            pass  # within the limit: a copy now, pickled if an export asks for it
        elif rest:
            kept = blob if (blob is not None and not code) else cloudpickle.dumps(rest)
        if kept is not None and len(kept) > self.max_kept_bytes:
            kept, dropped = None, tuple(rest)
        self.entries.append(PushEntry(tuple(values), code, kept, dropped,
                                      tuple(ranks) if ranks is not None else None, snapshot))

    @property
    def cells(self) -> list[CellEntry]:
        return [e for e in self.entries if isinstance(e, CellEntry)]

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        pushes = len(self.entries) - len(self.cells)
        return f"<nbdist.History: {len(self.cells)} cells, {pushes} pushes>"
