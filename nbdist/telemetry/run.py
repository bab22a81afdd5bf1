"""A run's record: one cell or script across its ranks, owned by the Session.

The Session feeds it the event batches its backend drains; the record folds them
(:class:`~.aggregate.RunState`), counts batches per rank so the Session knows when it has seen
everything the run sent, and hands views a :class:`~.snapshot.RunSnapshot` to draw. When the
run is over it stays here for ``Session.last_run`` and ``%nbdist timeline``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Callable, Optional, Union

from .aggregate import RunState
from .events import MAX_FIGURES_INTERVAL, Batch, Event
from .recovery import Lost, Recovery
from .snapshot import RunSnapshot
from .stall.report import StallReport, Stranded
from .trace import write_trace
from .verdicts import NO_CONTEXT, Context, verdicts

#: seconds a batch waits for the one its rank handed its host's relay before it
#: (:meth:`Run.in_order`): two of the longest intervals between a rank's batches
HOLD_S = 2 * MAX_FIGURES_INTERVAL


class Run:
    """One execution of a cell or script on ``ranks``.

    Parameters
    ----------
    what : str
        ``"cell"`` or ``"script NAME"``: how errors and summaries name it.
    ranks : sequence of int
        The ranks that run it.
    world_size : int
        Ranks in the job when it ran.
    generation : int
        The process group's generation when it started.
    name : str, optional
        The label the user gave it (``%%distributed --name``).
    stall_after : float, optional
        Seconds without progress before the hang doctor gives its verdict (0: never);
        default five median steps, at least 10 s.
    trace : bool
        Keep its events for :meth:`write_trace` (False: a job watched from outside, whose
        figures are all the notebook shows of it).
    """

    def __init__(self, what: str, ranks: Sequence[int], *, world_size: int,
                 generation: int = 0, name: Optional[str] = None,
                 stall_after: Optional[float] = None, trace: bool = True) -> None:
        self.what = what
        self.name = name
        #: how error headlines name it: ``In [12]`` for a cell the kernel numbered
        self.label: Optional[str] = None
        self.ranks = tuple(ranks)
        self.world_size = world_size
        self.generation = generation
        self.started = time.time()
        self.ended: Optional[float] = None
        self._state = RunState(self.ranks, started=self.started, stall_after=stall_after,
                               trace=trace)
        self._seq: dict[int, int] = {}  # rank -> highest batch seq received
        #: batches waiting for one their rank sent before them (see :meth:`in_order`), each
        #: with when it came
        self._held: list[tuple[Batch, float]] = []
        #: lines the session added (e.g. what elastic training survived), in order
        self.notes: list[str] = []
        self._stall_key: Optional[tuple] = None  # what the last stall verdict said
        self._stalled = False  # a stall verdict was given at some point
        #: what the run's verdicts may compare it with (other runs, tuning results): asked
        #: once, when the run is over
        self.context: Callable[[], Context] = lambda: NO_CONTEXT
        self._context: Optional[Context] = None
        self._final: Optional[RunSnapshot] = None  # the snapshot once the run is over

    def in_order(self, batches: Iterable[Batch], release: bool = False) -> list[Batch]:
        """``batches`` that may be folded and shown now, with those held before that now may.

        A rank whose host relays its batches (:mod:`nbdist.runtime.node_relay`) sends one
        itself where the relay cannot take it, and says which one it handed the relay
        before it (``after``): that one may reach the notebook later, and is waited for, at
        most :data:`HOLD_S` seconds (a relay that died took it along). ``release``: nothing
        waits (the run is ending).
        """
        batches = list(batches)
        if not self._held and not any("after" in b for b in batches):
            return batches  # as a rule
        now = time.monotonic()
        pending = [*self._held, *((b, now) for b in batches)]
        seen = dict(self._seq)
        out: list[Batch] = []
        while pending:
            rest = []
            for b, since in pending:
                after = b.get("after")
                if (release or not after or seen.get(b["rank"], 0) >= after
                        or now - since >= HOLD_S):
                    out.append(b)
                    seen[b["rank"]] = max(seen.get(b["rank"], 0), b["seq"])
                else:
                    rest.append((b, since))
            if len(rest) == len(pending):
                break
            pending = rest
        self._held = pending
        return out

    def feed(self, batches: Iterable[Batch]) -> bool:
        """Take batches (any ranks, any order); True if any carried telemetry."""
        batches = list(batches)
        self._final = None
        for b in batches:
            self._seq[b["rank"]] = max(self._seq.get(b["rank"], 0), b["seq"])
        return self._state.feed(batches)

    def note_recovery(self, news: Union[Lost, Recovery], line: bool = True) -> None:
        """What the notebook found or decided: a rank found dead (its row says so from now
        on), by elastic training's coordinator or by the cell loop for a worker the engine
        lost; a re-formed group, a replacement that joined (it reports as its rank from now
        on). Kept at the step it happened, and as a line of the run's notes (``line``
        False: the caller writes its own)."""
        self._state.note_recovery(news)
        if line:
            self.notes.append(news.line())

    def failed_on_exit(self, rank: int, error: str, t: float) -> None:
        """``rank``'s process ended with an error its own end did not report (a status the
        script raised itself, which its launcher saw): its row says so from now on."""
        self._final = None
        self._state.failed_on_exit(rank, error, t)

    def stopped(self, by: str) -> None:
        """The notebook is stopping the run (``--timeout 16 s`` or ``interrupt``): ranks the
        interrupt ends are stopped by that, and say where they were, not ``KeyboardInterrupt``."""
        self._state.stopped_by = by

    def has_all(self, wanted: Mapping[int, int]) -> bool:
        """True once every rank's batches up to ``wanted[rank]`` (its last seq) arrived."""
        return all(self._seq.get(r, 0) >= s for r, s in wanted.items())

    def finish(self, unreported: Optional[str] = None) -> None:
        """The run is over: ranks that never reported their end are marked stopped (their
        rows say ``unreported``; default: a cell's words)."""
        if unreported is None:
            self._state.finish()
        else:
            self._state.finish(unreported)
        self.ended = time.time()

    def missed_start(self, rank: int) -> None:
        """``rank``'s first reports went to another notebook: its step count starts from
        the first step it reports here (see :meth:`.RunState.missed_start`)."""
        self._state.missed_start(rank)

    def snapshot(self, now: Optional[float] = None) -> RunSnapshot:
        """The run's numbers now, with its wall-clock time so far, and once it is over what
        they mean (:mod:`.verdicts`, for a run that stepped); views draw this. A finished
        run's snapshot is made once."""
        if self._final is not None and now is None:
            return self._final
        end = self.ended if self.ended is not None else time.time()
        snap = self._state.snapshot(now, at=end)
        # A stopped run says where each rank was, threshold or not (who held the others).
        where = self.where() if snap.stopped_by and snap.stall is None else snap.stall
        snap = replace(snap, wall_s=max(0.0, end - self.started), notes=tuple(self.notes),
                       stall=where)
        if self.ended is None:
            return snap
        if snap.steps or any(r.memory for r in snap.ranks):
            if self._context is None:
                self._context = self.context()
            snap = replace(snap, verdicts=verdicts(snap, self._context))
        if now is None:
            self._final = snap
        return snap

    def stall_news(self) -> bool:
        """True once each time the stall verdict appears, changes or goes (views redraw
        then, without waiting for their next turn)."""
        v = self._state.stall_report(self.ended if self.ended is not None else time.time())
        key = v.key if v is not None else None
        if key == self._stall_key:
            return False
        self._stall_key = key
        self._stalled = self._stalled or key is not None
        return True

    def stranded(self) -> Optional[Stranded]:
        """Ranks that finished the cell while others wait in a collective they will never
        call, once that is certain (a couple of seconds after the last one finished)."""
        return self._state.stranded(time.time())

    def where(self) -> Optional[StallReport]:
        """Where each rank was by its last report (None: none reported): what the errors of
        a timeout or an interrupt say."""
        return self._state.where(self.ended if self.ended is not None else time.time())

    @property
    def recorded(self) -> bool:
        """True when the run recorded telemetry events (steps, collectives, bars, scalars), or
        the hang doctor has something to say about it (a stall, where an interrupt found the
        ranks)."""
        interrupted = any(e.get("reason") == "interrupt"
                          for e in self._state.stall.stacks.values())
        return (bool(self._state.recorded.kept) or self._state.recorded.untraced > 0
                or self._stalled or interrupted)

    @property
    def dropped(self) -> int:
        """Telemetry events dropped because the run recorded more than the cap."""
        return self._state.recorded.dropped

    @property
    def trace_events(self) -> int:
        """Telemetry events the run holds for its trace (0 once let go)."""
        return self._state.recorded.held

    def let_go_trace(self) -> None:
        """Drop the events kept for the trace; the figures (snapshot, compare) stay."""
        self._state.recorded.clear()

    def events(self) -> dict[int, list[Event]]:
        """The recorded telemetry events per rank."""
        return self._state.recorded.events()

    def write_trace(self, path: Union[str, os.PathLike]) -> int:
        """Write the run as a Chrome trace (one track per rank); return its event count."""
        meta = {"world_size": self.world_size, "what": self.what, "name": self.name,
                "dropped_events": self.dropped}
        return write_trace(path, self.events(), meta)

    def __repr__(self) -> str:
        state = "finished" if self.ended is not None else "running"
        label = f" {self.name!r}" if self.name else ""
        return (f"<nbdist.Run{label} {self.what} on ranks {list(self.ranks)}, {state}: "
                f"{self.snapshot()!r}>")
