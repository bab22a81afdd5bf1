"""What the workers' namespaces were built from since the process group formed.

The session records each ``%%distributed`` cell that succeeded and each push, in order, and
starts a new record when the group is formed again (start, restart, scale). ``%nbdist export``
turns the record into a torchrun script (:mod:`nbdist.exporter.torchrun`). Pure: no torch, no
processes.

The record is bounded, as everything the notebook keeps across cells (``docs/limits.md``,
"What the notebook keeps"): the copies of pushed values share one budget
(:data:`PUSH_BUDGET_BYTES`, ``NBDIST_PUSH_BUDGET_MIB``), the oldest copies giving way first; a
push of a name replaces the copy an earlier push kept of it; and the latest :data:`MAX_CELLS`
cells are kept. What gave way is named in the export.
"""

from __future__ import annotations

import ast
import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import cloudpickle

#: pushed values larger than this (pickled) are not kept: export then says what is missing
MAX_KEPT_BYTES = 256 * 2**20
#: the copies of pushed values kept for export share this many bytes (256 MiB; the
#: environment's ``NBDIST_PUSH_BUDGET_MIB`` changes it): past it, the oldest copies are dropped
PUSH_BUDGET_BYTES = 256 * 2**20
#: cells kept for export, the latest ones (with the pushes among them)
MAX_CELLS = 5000

#: why a pushed value is not in the record (:attr:`PushEntry.why`), in the export's words
TOO_LARGE = "too large to keep"
OVER_BUDGET = "its copy gave way to later pushes (push copies share {budget})"
REPLACED = "a later push of the same name replaced its copy"


def push_budget() -> int:
    """The push copies' budget in bytes: ``NBDIST_PUSH_BUDGET_MIB`` MiB, else
    :data:`PUSH_BUDGET_BYTES`.

    Raises
    ------
    ValueError
        ``NBDIST_PUSH_BUDGET_MIB`` is not a number of MiB at least 0.
    """
    text = os.environ.get("NBDIST_PUSH_BUDGET_MIB", "").strip()
    if not text:
        return PUSH_BUDGET_BYTES
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not mib >= 0:
        raise ValueError(f"NBDIST_PUSH_BUDGET_MIB must be a number of MiB (0 or more), got "
                         f"{text!r}")
    return int(mib * 2**20)


def covers(later: Optional[Sequence[int]], earlier: Optional[Sequence[int]]) -> bool:
    """Whether a push to ranks ``later`` reaches every rank a push to ``earlier`` reached
    (None: every rank), so that it replaces what that push sent of the same names."""
    return later is None or (earlier is not None and set(earlier) <= set(later))


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB, for people: ``"32.0 MiB"``."""
    return f"{nbytes / 2**20:.1f} MiB"


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
    pickle several times that, for an export that may never come. ``nbytes`` is what the
    kept copy holds (bytes, the push's size); ``why`` says, for each dropped name, why it is
    not kept (:data:`TOO_LARGE` when not said).
    """

    names: tuple[str, ...]
    code: Mapping[str, str]
    pickle: Optional[bytes] = None
    dropped: tuple[str, ...] = ()
    ranks: Optional[tuple[int, ...]] = None
    snapshot: Optional[dict[str, Any]] = None
    nbytes: int = 0
    why: Mapping[str, str] = field(default_factory=dict)

    @property
    def kept(self) -> bool:
        """Whether a copy of some value is held (in :attr:`snapshot` or :attr:`pickle`)."""
        return self.pickle is not None or self.snapshot is not None

    def without(self, names: Sequence[str], why: str) -> PushEntry:
        """This push with the copies of ``names`` let go (each then dropped for ``why``); the
        bytes still held shrink in proportion to the names left."""
        gone = [n for n in self.pickled if n in names]
        if not gone:
            return self
        left = [n for n in self.pickled if n not in gone]
        snapshot = pickled = None
        if left and self.snapshot is not None:
            snapshot = {n: self.snapshot[n] for n in left}
        elif left and self.pickle is not None:  # one pickle of them all: unpickled, re-pickled
            values = cloudpickle.loads(self.pickle)
            pickled = cloudpickle.dumps({n: values[n] for n in left})
        nbytes = (len(pickled) if pickled is not None
                  else self.nbytes * len(left) // (len(left) + len(gone)))
        return replace(self, pickle=pickled, snapshot=snapshot, nbytes=nbytes,
                       dropped=self.dropped + tuple(gone),
                       why={**self.why, **dict.fromkeys(gone, why)})

    def reason(self, name: str) -> str:
        """Why ``name``'s value is not kept, in words."""
        return self.why.get(name, TOO_LARGE)

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
    """The ordered record the session keeps; see the module docstring.

    Parameters
    ----------
    max_kept_bytes : int
        A push larger than this (bytes) keeps no copy.
    budget : int, optional
        Bytes all kept push copies share (default :func:`push_budget`).
    max_cells : int
        Cells kept, the latest ones.
    """

    def __init__(self, max_kept_bytes: int = MAX_KEPT_BYTES, budget: Optional[int] = None,
                 max_cells: int = MAX_CELLS) -> None:
        self.entries: list[Entry] = []
        self.max_kept_bytes = max_kept_bytes
        self.budget = push_budget() if budget is None else budget
        self.max_cells = max_cells
        #: cells (and the pushes before them) no longer kept, the oldest ones
        self.forgotten = 0
        self._ncells = 0

    def reset(self) -> None:
        """The group formed again, or stopped: what ran before does not describe the new
        job (and its push copies are let go)."""
        self.entries = []
        self.forgotten = self._ncells = 0

    def cell(self, number: int, source: str, ranks: Optional[Sequence[int]] = None) -> None:
        """Record a cell that succeeded on ``ranks`` (None: every rank); past
        :attr:`max_cells`, the oldest cell (and the pushes before it) goes."""
        self.entries.append(CellEntry(number, source, tuple(ranks) if ranks is not None
                                      else None))
        self._ncells += 1
        while self._ncells > self.max_cells:
            gone = self.entries.pop(0)
            if isinstance(gone, CellEntry):
                self._ncells -= 1
                self.forgotten += 1

    def push(self, values: Mapping[str, Any], blob: Optional[bytes] = None,
             ranks: Optional[Sequence[int]] = None, size: Optional[int] = None) -> None:
        """Record a push. ``blob`` is the cloudpickle of ``values`` when the caller has it;
        ``size``, their size sent, when known: values past the limit are then not pickled
        again only to be dropped. The copies earlier pushes kept of these names are let go,
        then the oldest copies until all fit the budget."""
        code: dict[str, str] = {}
        for name, value in values.items():
            text = literal_code(value)
            if text is not None:
                code[name] = text
        sent = tuple(ranks) if ranks is not None else None
        self.entries = [e.without(tuple(values), REPLACED)
                        if isinstance(e, PushEntry) and covers(sent, e.ranks) else e
                        for e in self.entries]
        rest = {k: v for k, v in values.items() if k not in code}
        kept: Optional[bytes] = None
        snapshot: Optional[dict[str, Any]] = None
        dropped: tuple[str, ...] = ()
        limit = min(self.max_kept_bytes, self.budget)
        if rest and size is not None and size > limit:
            dropped = tuple(rest)
        elif rest and size is not None and (snapshot := _copy(rest)) is not None:
            pass  # within the limit: a copy now, pickled if an export asks for it
        elif rest:
            kept = blob if (blob is not None and not code) else cloudpickle.dumps(rest)
        if kept is not None and len(kept) > limit:
            kept, dropped = None, tuple(rest)
        nbytes = len(kept) if kept is not None else (size or 0) if snapshot is not None else 0
        why = dict.fromkeys(dropped, TOO_LARGE if size is None or size > self.max_kept_bytes
                            else OVER_BUDGET.format(budget=mib(self.budget)))
        self.entries.append(PushEntry(tuple(values), code, kept, dropped,
                                      tuple(ranks) if ranks is not None else None, snapshot,
                                      nbytes, why))
        self._fit()

    def _fit(self) -> None:
        """Drop the oldest push copies until the kept ones fit :attr:`budget`."""
        total = self.kept_bytes
        for i, e in enumerate(self.entries):
            if total <= self.budget:
                return
            if isinstance(e, PushEntry) and e.kept:
                total -= e.nbytes
                self.entries[i] = e.without(e.pickled, OVER_BUDGET.format(budget=mib(self.budget)))

    @property
    def kept_bytes(self) -> int:
        """Bytes the kept push copies hold (each push's size when it was sent)."""
        return sum(e.nbytes for e in self.entries if isinstance(e, PushEntry) and e.kept)

    @property
    def cells(self) -> list[CellEntry]:
        return [e for e in self.entries if isinstance(e, CellEntry)]

    def describe(self) -> str:
        """What the record holds, in words: ``"12 cells, push copies 32.0 MiB of 256.0 MiB"``."""
        pushes = [e for e in self.entries if isinstance(e, PushEntry)]
        return (f"{self._ncells} cell{'s' * (self._ncells != 1)}"
                + (f" (and {self.forgotten} older ones let go)" if self.forgotten else "")
                + f", {len(pushes)} push{'es' * (len(pushes) != 1)}, push copies "
                  f"{mib(self.kept_bytes)} of {mib(self.budget)}")

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"<nbdist.History: {self.describe()}>"
