"""The hang doctor's verdict: where every rank is once a run has stopped making progress.

Pure: no clocks (callers pass the time), no processes. Workers send a ``stack`` event
(:func:`nbdist.telemetry.events.stack`) when their cell has made no progress for a while, and
again just before an interrupt unwinds it; :class:`StallWatch` keeps the latest one per rank
and judges them together: which ranks wait in which collective, which ranks are elsewhere (and
so never reached it), with each rank's place in the cell. The same :class:`StallReport` feeds the
dashboard, the text view and the errors a timeout or an interrupt raises; the text of it is
written here, once.

"Progress" is a completed step or collective, or a moved progress bar
(:data:`~nbdist.telemetry.events.PROGRESS_KINDS`). The threshold is
:func:`~.thresholds.stall_threshold`: five times the median step, at least 10 s, or the
user's ``--stall-after``.

A rank in the debugger (or waiting in ``input()``) is not stalled: while one is, the verdict
says so at once ("rank 1 is in the debugger (line 5)") instead of judging a hang, whatever the
threshold, and the time it spent there is not counted as time without progress.

A rank that finished the cell while others wait in a collective of the whole group is not a
stall to wait out: no call of that collective can complete. :meth:`StallWatch.stranded` says
so a couple of seconds after the last rank finished, and the cell loop ends the cell.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..events import Event
from ..states import RankState
from ..stopped import DEBUGGING, Stopped, Stops
from ..units import fmt_bytes
from .thresholds import STALL_WINDOW, quiet_after, stall_threshold

#: above this many ranks, ranks whose places read the same share one line
GROUP_ABOVE = 16
#: seconds a collective must have waited after the last rank finished the cell before the cell
#: is ended as one no call can complete (:meth:`StallWatch.stranded`)
STRANDED_AFTER_S = 2.0
#: how the Flight Recorder names the default group (nbdist's own count names none)
DEFAULT_GROUPS = (None, "default_pg", "0")

# rank states in a verdict
IN_COLLECTIVE = "waiting"  # inside a collective
ELSEWHERE = "elsewhere"  # running, not inside a collective
FINISHED = "finished"  # ended the cell without error
FAILED = "failed"  # ended the cell with an error
UNKNOWN = "unknown"  # running, but no report of where yet


# ----------------------------------------------------------------- records
@dataclass(frozen=True)
class Frame:
    """One frame of a rank's stack: the cell's own (``cell``), or the innermost one."""

    file: str
    line: int
    name: str
    cell: bool
    code: str = ""
    call: Optional[str] = None  # the call expression it is in (innermost frame only)


@dataclass(frozen=True)
class Collective:
    """A collective a rank is in (or last completed).

    From torch's Flight Recorder, ``group`` names the process group and ``seq`` is the
    group's collective number, the same on every rank. From nbdist's own count (no Flight
    Recorder), ``group`` is None and ``seq`` counts calls of ``op`` in the cell from 1.
    """

    op: str
    seq: Optional[int]
    group: Optional[str] = None
    size: str = ""  # ``float32 [4]`` (Flight Recorder) or ``16 B float32`` (nbdist)
    done: bool = False
    p2p: bool = False  # a send or receive (numbered apart from the collectives)

    @property
    def key(self) -> tuple:
        return (self.group, self.op, self.seq)

    def clashes(self, other: Collective) -> bool:
        """Both are the same numbered collective of one group, but different ops: the ranks
        called different collectives in the same place (only the Flight Recorder tells)."""
        return (self.group is not None and not self.p2p and not other.p2p
                and (self.group, self.seq) == (other.group, other.seq) and self.op != other.op)

    def describe(self) -> str:
        """``all_reduce (seq 3, float32 [4])``; the group is named unless it is the default."""
        parts = []
        if self.seq is not None:
            parts.append(f"seq {self.seq}" if self.group is not None
                         else f"call {self.seq} of it in the cell")
        if self.group not in (None, "default_pg", "0"):
            parts.append(f"group {self.group}")
        if self.size:
            parts.append(self.size)
        return self.op + (f" ({', '.join(parts)})" if parts else "")


@dataclass(frozen=True)
class RankWhere:
    """Where one rank is: :data:`IN_COLLECTIVE` in ``collective``, :data:`ELSEWHERE`,
    :data:`FINISHED`, :data:`FAILED`, :data:`UNKNOWN` or :data:`DEBUGGING`."""

    rank: int
    status: str
    collective: Optional[Collective] = None
    #: what its innermost frame is doing: ``time.sleep(0.05)`` (a call in the cell) or the
    #: function it is in (``torch.distributed.distributed_c10d.all_reduce``)
    doing: Optional[str] = None
    #: the innermost line of the cell it is at, and the call it makes there (else the line)
    line: Optional[int] = None
    code: str = ""
    frames: tuple[Frame, ...] = ()
    #: the latest collective it completed in the cell, on the group the others wait in
    last: Optional[Collective] = None
    #: what the rank reported: ``"stall"`` or ``"interrupt"`` ("" when nothing)
    reason: str = ""
    error: Optional[str] = None
    #: calls of each collective op it entered in the cell (nbdist's count)
    calls: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class StallReport:
    """Where every rank is, and which collectives some of them wait in."""

    ranks: tuple[RankWhere, ...]
    #: seconds since the run last made progress (since it started, if it never did)
    idle_s: float
    #: the stall threshold in force (None: off, or a where-report made for an error)
    threshold_s: Optional[float] = None
    #: each collective ranks wait in, with those ranks
    waits: tuple[tuple[Collective, tuple[int, ...]], ...] = ()
    #: ranks that never reached the collective(s) the others wait in
    missing: tuple[int, ...] = ()
    #: collectives of one group and number that ranks called as different ops
    clashes: tuple[tuple[Collective, Collective], ...] = ()
    #: ranks stopped in the debugger or input(): the run waits for the user, not a hang
    stopped: tuple[Stopped, ...] = ()
    #: the script the ranks run, for a job started outside the notebook: places read
    #: ``train.py:27`` (None: a cell's, ``cell line 27``)
    script: Optional[str] = None

    @property
    def hang(self) -> bool:
        """Some ranks wait in a collective that other ranks never reached."""
        return bool(self.waits and self.missing)

    def rank(self, r: int) -> Optional[RankWhere]:
        return next((w for w in self.ranks if w.rank == r), None)

    @property
    def key(self) -> tuple:
        """What the verdict says, without the clock: it changes when a rank moves."""
        return tuple((w.rank, w.status, w.collective.key if w.collective else None, w.doing,
                      w.line) for w in self.ranks) + self.stopped


@dataclass(frozen=True)
class Stranded:
    """Ranks that finished the cell while others wait in a collective of the whole group:
    one they will never call, so no call of it can complete."""

    #: the ranks that ended the cell without error
    finished: tuple[int, ...]
    #: the ranks still running that wait in such a collective
    waiting: tuple[RankWhere, ...]
    #: where every rank is (the verdict the decision read)
    report: StallReport
    #: a waiting rank is inside a DistributedDataParallel model's forward or backward
    ddp: bool


# ----------------------------------------------------------------- the judgement
def _frames(event: Event) -> tuple[Frame, ...]:
    return tuple(Frame(f.get("file", "?"), int(f.get("line") or 0), f.get("name", "?"),
                       bool(f.get("cell")), f.get("code", ""), f.get("call"))
                 for f in event.get("frames") or ())


# The Flight Recorder names dtypes as c10 does; people know torch's names.
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


def _size_fr(entry: Mapping[str, Any]) -> str:
    sizes = entry.get("sizes") or []
    dtypes = sorted({_DTYPES.get(str(d), str(d)) for d in entry.get("dtypes") or []})
    shapes = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in sizes[:4])
    if len(sizes) > 4:
        shapes += f", ... ({len(sizes)} tensors)"
    return " ".join(x for x in ("/".join(dtypes), shapes) if x)


def _from_fr(entry: Mapping[str, Any]) -> Collective:
    return Collective(str(entry.get("op", "?")), entry.get("seq"), str(entry.get("group", "?")),
                      _size_fr(entry), bool(entry.get("done")), bool(entry.get("p2p")))


def _from_nbdist(c: Mapping[str, Any]) -> Collective:
    size = " ".join(x for x in (fmt_bytes(c["bytes"]) if c.get("bytes") else "",
                                str(c.get("dtype") or "")) if x)
    return Collective(str(c.get("op", "?")), c.get("seq"), None, size)


def _where(rank: int, event: Event) -> RankWhere:
    """Classify one rank from its stack report."""
    frames = _frames(event)
    inner = frames[-1] if frames else None
    cell = [f for f in frames if f.cell]
    doing = None
    if inner is not None:
        doing = (inner.call or inner.code or inner.name) if inner.cell else inner.name
    line = cell[-1].line if cell else None
    code = (cell[-1].call or cell[-1].code) if cell else ""
    flight = event.get("flight")
    open_fr = [e for e in flight or () if not e.get("done")]
    mine = event.get("collective")
    in_torch = inner is not None and not inner.cell and inner.name.startswith("torch.")
    collective = None
    if mine or (open_fr and in_torch):
        if open_fr:  # the oldest unfinished one: collectives of a group complete in order
            first = min(open_fr, key=lambda e: (e.get("seq") is None, e.get("seq") or 0))
            collective = _from_fr(first)
        else:
            collective = _from_nbdist(mine)
    last = None
    if flight:
        done = [e for e in flight if e.get("done")]
        if done:
            last = _from_fr(max(done, key=lambda e: e.get("seq") or 0))
    calls = tuple(sorted((event.get("calls") or {}).items()))
    status = IN_COLLECTIVE if collective else ELSEWHERE
    return RankWhere(rank, status, collective, doing, line, code, frames, last,
                     event.get("reason", ""), calls=calls)


def _passed(w: RankWhere, c: Collective) -> bool:
    """True when ``w`` is known to have got past (or into) collective ``c``."""
    if w.collective is not None and w.collective.key == c.key:
        return True
    if c.group is not None:
        return w.last is not None and w.last.group == c.group and (w.last.seq or 0) >= (c.seq or 0)
    return dict(w.calls).get(c.op, 0) >= (c.seq or 0) and w.status != IN_COLLECTIVE


def judge(ranks: Sequence[RankWhere], idle_s: float,
          threshold_s: Optional[float] = None) -> StallReport:
    """Group ``ranks`` by the collective they wait in and name those that never reached it."""
    groups: dict[tuple, tuple[Collective, list[int]]] = {}
    for w in ranks:
        if w.status == IN_COLLECTIVE and w.collective is not None:
            groups.setdefault(w.collective.key, (w.collective, []))[1].append(w.rank)
    waits = tuple((c, tuple(sorted(rs))) for c, rs in
                  sorted(groups.values(), key=lambda g: min(g[1])))
    missing: set[int] = set()
    for c, waiting in waits:
        for w in ranks:
            if w.rank in waiting or w.status in (UNKNOWN, DEBUGGING) or _passed(w, c):
                continue
            if w.collective is not None and w.collective.clashes(c):
                continue  # it got there, but called another collective: a clash, not absence
            missing.add(w.rank)
    clashes = tuple((a, b) for i, (a, _) in enumerate(waits) for b, _ in waits[i + 1:]
                    if a.clashes(b))
    return StallReport(tuple(sorted(ranks, key=lambda w: w.rank)), idle_s, threshold_s, waits,
                   tuple(sorted(missing)), clashes)


class StallWatch:
    """The part of a run's fold the hang doctor reads: progress, step times, stack reports.

    Times are the workers' ``time.time()`` (events carry them) and the caller's ``at``, the
    notebook's ``time.time()``: the same clock on one host, and synchronized across hosts
    well enough for thresholds of seconds.
    """

    def __init__(self, started: Optional[float] = None, override: Optional[float] = None):
        self.started = started
        self.override = override
        self.progress_t: Optional[float] = None
        self.step_s: deque[float] = deque(maxlen=STALL_WINDOW)
        self.stacks: dict[int, Event] = {}
        self.ended: dict[int, tuple[float, bool, Optional[str]]] = {}
        #: ranks stopped in the debugger (or input()) now
        self.debugging = Stops()

    def progress(self, t: float, rank: Optional[int] = None) -> None:
        """``rank`` made progress at ``t`` (a step or collective completed, a bar moved).

        Not after the rank reported an interrupt: what it sends while unwinding (the step the
        interrupt cut short) is not progress.
        """
        if self._unwinding(rank, t):
            return
        self.progress_t = t if self.progress_t is None else max(self.progress_t, t)

    def step(self, seconds: float, t: Optional[float] = None, rank: Optional[int] = None
             ) -> None:
        """A step of ``seconds`` ended at ``t`` on ``rank`` (its length sets the threshold)."""
        if t is None or not self._unwinding(rank, t):
            self.step_s.append(seconds)

    def progress_all(self, ts: Sequence[float], rank: int) -> None:
        """:meth:`progress` at each of ``ts`` (a table's events), in one call."""
        if self.interrupted(rank):
            ts = [t for t in ts if t < self.stacks[rank].get("t", 0)]
        if ts:
            self.progress(max(ts), rank)

    def steps_all(self, seconds: Sequence[float], ts: Sequence[float], rank: int) -> None:
        """:meth:`step` for each step of ``seconds`` ending at ``ts`` (a table's steps)."""
        if self.interrupted(rank):
            for s, t in zip(seconds, ts):
                self.step(s, t, rank)
        else:
            self.step_s.extend(seconds)

    def interrupted(self, rank: int) -> bool:
        """``rank`` reported an interrupt (what it sends after that is not progress)."""
        e = self.stacks.get(rank)
        return e is not None and e.get("reason") == "interrupt"

    def _unwinding(self, rank: Optional[int], t: float) -> bool:
        e = self.stacks.get(rank) if rank is not None else None
        return e is not None and e.get("reason") == "interrupt" and t >= e.get("t", 0)

    def stack(self, rank: int, event: Event) -> None:
        old = self.stacks.get(rank)
        if old is None or event.get("t", 0) >= old.get("t", 0):
            self.stacks[rank] = event

    def end(self, rank: int, t: float, ok: bool, error: Optional[str]) -> None:
        self.ended[rank] = (t, ok, error)
        self.debugging.end(rank)

    def debugger(self, rank: int, event: Event) -> None:
        """``rank`` stopped for the notebook, or went on (a ``debugger`` event). Going on
        counts as progress: the time it waited for the user is not time without progress."""
        went_on = self.debugging.feed(rank, event)
        if went_on is not None:
            self.progress_t = max(self.progress_t or 0.0, went_on)

    @property
    def threshold(self) -> Optional[float]:
        return stall_threshold(self.step_s, self.override)

    def idle(self, at: float) -> float:
        since = self.progress_t if self.progress_t is not None else self.started
        return max(0.0, at - since) if since is not None else 0.0

    def quiet(self, at: Optional[float], running: bool) -> Optional[float]:
        """Seconds a running run went without progress, once past :func:`quiet_after`."""
        if at is None or not running:
            return None
        idle = self.idle(at)
        return idle if idle >= quiet_after(self.step_s) else None

    def _fresh(self, rank: int) -> Optional[Event]:
        """The rank's report, unless progress or the rank's normal end came after it."""
        e = self.stacks.get(rank)
        if e is None:
            return None
        if self.progress_t is not None and e.get("t", 0) < self.progress_t:
            return None
        end = self.ended.get(rank)
        if end is not None and e.get("reason") != "interrupt" and end[0] >= e.get("t", 0):
            return None  # a stall report from before the rank finished or failed
        return e

    def where(self, ranks: Iterable[int], states: Mapping[int, RankState], at: float,
              threshold: Optional[float] = None) -> Optional[StallReport]:
        """Where each of ``ranks`` is now; None when no rank reported anything."""
        out = []
        reported = False
        for r in sorted(ranks):
            e = self._fresh(r)
            end = self.ended.get(r)
            s = self.debugging.of(r)
            if s is not None:
                out.append(RankWhere(r, DEBUGGING, line=s.line, reason=s.mode, doing=s.doing))
                reported = True
            elif e is not None:
                out.append(_where(r, e))
                reported = True
            elif end is not None:
                out.append(RankWhere(r, FINISHED if end[1] else FAILED, error=end[2]))
            elif states.get(r) == RankState.DONE:
                out.append(RankWhere(r, FINISHED))
            else:
                out.append(RankWhere(r, UNKNOWN))
        if not reported:
            return None
        v = judge(out, self.idle(at), threshold)
        return replace(v, stopped=self.debugging.now()) if self.debugging else v

    def stranded(self, ranks: Iterable[int], states: Mapping[int, RankState], at: float,
                 after: float = STRANDED_AFTER_S) -> Optional[Stranded]:
        """Ranks that finished the cell while others wait in a collective they will never
        call; None while there is none, or it is not yet certain.

        Certain ``after`` seconds past the last rank's end, when some rank that still runs
        has reported (since the last progress of any rank) that it waits in a collective of
        the default group, which needs every rank: a rank that ended its cell runs no code,
        so that collective can never complete. Not for a rank that computes (it may still
        reach a collective the others wait in), a send or receive, or a collective of
        another group (their peers may all be running), nor while a rank is in the debugger
        or the hang doctor is off (``--stall-after 0``).
        """
        if self.debugging or self.override == 0:
            return None
        ranks = sorted(ranks)
        finished = {r: t for r, (t, ok, _) in self.ended.items() if ok and r in ranks}
        running = [r for r in ranks if r not in self.ended]
        if not finished or not running or at - max(finished.values()) < after:
            return None
        v = self.where(ranks, states, at)
        if v is None:
            return None
        waiting = tuple(w for w in v.ranks if w.rank in running and w.status == IN_COLLECTIVE
                        and w.collective is not None and not w.collective.p2p
                        and w.collective.group in DEFAULT_GROUPS)
        if not waiting:
            return None
        ddp = any(w.frames and not w.frames[-1].cell
                  and w.frames[-1].name.startswith(("torch.autograd", "torch.nn.parallel"))
                  for w in waiting)
        return Stranded(tuple(sorted(finished)), waiting, v, ddp)

    def stall_report(self, ranks: Iterable[int], states: Callable[[], Mapping[int, RankState]],
                at: float) -> Optional[StallReport]:
        """The stall verdict at ``at``, or None while there is none to give.

        There is one when the threshold is on and has passed, some rank is still running
        (or was interrupted where it stood), and either some rank waits in a collective or
        the run had made progress before: a cell that never steps or communicates is
        not hung by being slow. ``states`` is asked only then: the usual answer, asked ten
        times a second, is None without gathering them.
        """
        if self.debugging:  # the run waits for the user: say so, whatever the threshold
            return self.where(ranks, states(), at)
        threshold = self.threshold
        if threshold is None or self.idle(at) < threshold:
            return None
        ranks, states_now = list(ranks), states()
        running = any(states_now.get(r, RankState.WAITING).active for r in ranks)
        stopped_here = any(e.get("reason") == "interrupt" for e in self.stacks.values())
        if not (running or stopped_here):
            return None
        v = self.where(ranks, states_now, at, threshold)
        if v is None or not (v.waits or self.progress_t is not None):
            return None
        return v
