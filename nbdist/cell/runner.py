"""The session's cells: each one numbered, prepared as one call per rank, run by a
:class:`~nbdist.cell.loop.CellRun`, and kept.

:class:`Cells` is the room between the session's verbs (``run_cell``, ``tune``,
``run_script``, ``compare``) and the cell loop. It owns what a cell needs before it is
submitted (its number and name, the code shipped with the editor's line numbers, one
:class:`~nbdist.backends.base.Call` per selected rank, the run's record, the companions that
work beside it) and what the session keeps after it (the latest runs, every named run, the
history :mod:`nbdist.exporter` reads). Views reach it as a factory the session hands in: this
room never draws.
"""

from __future__ import annotations

import ast
import os
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..backends.base import Call
from ..elastic.coordinator import Coordinator
from ..errors import PARTIAL_RANKS, NbdistError, OptionError
from ..options import CellDefaults, CellOptions, parse_ranks
from ..records import Comparison, RemoteValue
from ..runtime import worker as rt
from ..runtime.measure.spec import Measure
from ..telemetry.compare import compare
from ..telemetry.run import Run
from ..telemetry.snapshot import RunSnapshot
from .end_marks import EndMarks
from .loop import CellRun, RunView, cell_name

if TYPE_CHECKING:
    from ..debugger.faults import Faults
    from ..exporter.history import History
    from ..group.membership import Membership
    from ..tuning import Tuning

#: ``make_view(output, shown_rank, world_size, ranks=...)``: the view of one run
ViewFactory = Callable[..., RunView]
#: the debugger's link and console for one call: ``(link, console)`` (``debugger.console``)
ConsoleFactory = Callable[["Membership", str], tuple[Any, Any]]

#: how many of the latest runs are kept (their records hold every rank's events)
KEPT_RUNS = 3
#: how many named runs are kept for compare (the oldest name goes first); those that are not
#: among the latest :data:`KEPT_RUNS` keep their figures, not their trace events
MAX_NAMED = 50


class Cells:
    """The cells of one session: their numbers, their runs, what is kept of them.

    Parameters
    ----------
    membership
        Who is in the job; every cell's calls go through it.
    history
        The cells and pushes since the group formed, for ``export``; a cell that succeeds is
        added, a group formed again inside a cell resets it.
    tuning
        What ``--tune`` chose: its context is a run's comparison, its note goes under a cell.
    faults
        Faults due in the next cell (``%nbdist kill --after``), worked beside it.
    defaults
        The session's cell defaults now (a profile's ``training`` section).
    make_view
        Makes the view of one run (``nbdist.display.make_run_view``).
    console
        The debugger's link and console for a cell (``nbdist.debugger.console.for_call``).
    """

    def __init__(self, membership: Membership, history: History, tuning: Tuning,
                 faults: Faults, defaults: Callable[[], CellDefaults],
                 make_view: ViewFactory, console: ConsoleFactory) -> None:
        self.membership, self.history, self.tuning = membership, history, tuning
        self.faults, self._defaults = faults, defaults
        self._make_view, self._console = make_view, console
        self.count = 0  #: cells numbered so far (trials and scripts included)
        self._id = uuid.uuid4().hex  # cells are named by it and their number, uniquely
        self._lock = threading.Lock()
        #: records of the latest runs that recorded telemetry, newest last
        self.runs: deque[Run] = deque(maxlen=KEPT_RUNS)
        #: every run labelled with ``name=`` (``%%distributed --name``), kept for compare()
        self.named: dict[str, Run] = {}

    def run(self, code: str, opts: CellOptions, measure: Measure, first_line: int,
            execution_count: Optional[int], trial: bool = False
            ) -> tuple[Optional[RemoteValue], Run]:
        """Run ``code`` as one cell on the ranks ``opts`` selects: the lowest rank's value
        (None when the last line is not an expression) and the run's record. A ``trial``
        (one of ``--tune``'s) is neither history nor compared as its own run.

        Raises
        ------
        NoClusterError
            No job is running.
        OptionError
            ``opts.ranks`` names a rank the job does not have.
        SyntaxError
            ``code`` does not parse; raised before anything is sent.
        DistributedError, CellTimeoutError, CellInterrupted, ClusterError
            As :class:`~nbdist.cell.loop.CellRun` raises them (see ``Session.run_cell``).
        """
        m = self.membership
        m.require()
        world = len(m.plans)
        selected = parse_ranks(opts.ranks, world)
        with self._lock:
            self.count += 1
            number = self.count
            cell = cell_name(number, execution_count)
        # Blank lines in place of the lines before the code (the magic's own line): every line
        # number Python reports, in tracebacks and syntax errors alike, is then the editor's.
        shipped = "\n" * max(0, first_line - 1) + code
        ast.parse(shipped, cell.filename, "exec")  # a syntax error is raised here, before shipping
        cell_id = f"{self._id}-{number}"
        # The cell loop's companions: the debugger's console, which answers the ranks' prompts
        # (breakpoint(), input()) through the notebook's stdin, and the kills due in this cell
        link, console = self._console(m, cell_id)
        beside: list[Any] = [console, *self.faults.for_call(m)]
        elastic = m.store is not None and len(selected) == world
        if m.store is not None and len(selected) > 1:  # the notebook marks ranks that end
            beside.append(EndMarks(m.store, cell_id, selected))
        # One call for every rank (the lowest one returns the value): the engine packs it once
        args = (shipped, cell.filename, cell_id, m.generation, list(selected), None)
        kwargs = {"measure": measure, "coordinated": elastic, "link": link,
                  "mark_end": m.store is None}
        calls = [Call(m.plans[r].worker_id, rt.run_cell, args, kwargs) for r in selected]
        run = Run("cell", selected, world_size=world, generation=m.generation,
                  name=opts.name, stall_after=measure.stall_after)
        run.label = cell.label
        if not trial:  # what its verdicts may compare it with, once it is over
            run.context = lambda: self.tuning.context(self.named, opts.name)
        view = self._make_view(opts.output, selected[0], world, ranks=selected)
        hint = ""
        if len(selected) < world:
            hint = PARTIAL_RANKS.format(ranks=", ".join(map(str, selected)))
        defaults = self._defaults()
        coordinator = (Coordinator(m, measure, default_max_failures=defaults.elastic_max_failures)
                       if elastic else None)
        cell_run = CellRun(m, calls, run, view, coordinator=coordinator, hint=hint,
                           companions=beside)
        try:
            outcomes = cell_run.wait(opts.timeout)
        finally:
            if cell_run.reformed:
                self.history.reset()  # a new group: the exported script starts after it
            if run.recorded:
                self._keep(run)
            if opts.name is not None:
                self.named.pop(opts.name, None)  # a re-run goes to the end, in run order
                self.named[opts.name] = run
                while len(self.named) > MAX_NAMED:
                    self.named.pop(next(iter(self.named)))
        if not trial:  # a tuning's trials are one cell of the script: tune() adds it
            self.history.cell(number, code, None if len(selected) == world else selected)
        self.tuning.say_note(run.snapshot(), defaults, opts.output)  # under the cell
        value = outcomes[0]["value"]
        return (RemoteValue(selected[0], value) if value else None), run

    def run_script(self, path: str, argv: Sequence[str], timeout: Optional[float],
                   output: str) -> None:
        """Run the torchrun script at ``path`` on every rank in fresh processes, with its own
        rendezvous store (``timeout`` in seconds; None: none). Raises as
        ``Session.run_script`` says."""
        m = self.membership
        m.require()
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read script {path!r}: {exc.strerror}") from exc
        port = m.open_store("run", "the script's rendezvous store")
        try:
            run_id = uuid.uuid4().hex[:12]  # fresh per launch, as torchrun --standalone does
            calls = [Call(p.worker_id, rt.run_script,
                          (os.path.abspath(path), source, list(argv), port, os.getcwd(),
                           run_id))
                     for p in m.plans]
            world = len(m.plans)
            run = Run(f"script {os.path.basename(path)}", range(world), world_size=world,
                      generation=m.generation)
            try:
                CellRun(m, calls, run, self._make_view(output, 0, world)).wait(timeout)
            finally:  # what its ranks reported is the latest run's, as a cell's is
                if run.recorded:
                    self._keep(run)
        finally:
            m.close_store("run")

    def _keep(self, run: Run) -> None:
        """Keep ``run`` among the latest; a named run that leaves them keeps only its figures
        (what compare shows): its trace events are no longer reachable by ``timeline``."""
        if len(self.runs) == self.runs.maxlen:
            leaving = self.runs[0]
            if any(leaving is r for r in self.named.values()):
                leaving.let_go_trace()
        self.runs.append(run)

    def release(self) -> None:
        """Let go of every kept run and named run (the session stopped)."""
        self.runs.clear()
        self.named.clear()

    def held(self) -> tuple[int, int, int]:
        """``(runs kept, named runs, trace events they hold)``."""
        ids = {id(r): r for r in (*self.runs, *self.named.values())}
        return len(self.runs), len(self.named), sum(r.trace_events for r in ids.values())

    def last(self) -> Optional[RunSnapshot]:
        """Summary of the latest run that recorded telemetry (None before any)."""
        return self.runs[-1].snapshot() if self.runs else None

    def trace(self, path: str, run: int = -1) -> int:
        """Write the kept run ``run`` (an index of :attr:`runs`) as a Chrome trace at
        ``path``; returns its event count.

        Raises
        ------
        NbdistError
            No run has recorded telemetry yet.
        IndexError
            ``run`` is not the index of a kept run.
        OSError
            The file cannot be written.
        """
        if not self.runs:
            raise NbdistError("no telemetry recorded yet: run a %%distributed cell (without "
                              "--no-telemetry) first, then %nbdist timeline FILE.json")
        return self.runs[run].write_trace(path)

    def compare(self, names: Sequence[str]) -> Comparison:
        """The named runs ``names`` (all of them when empty) side by side, in that order.

        Raises
        ------
        NbdistError
            No run has a name yet.
        OptionError
            A name labels no run (the message lists those that do).
        """
        if not self.named:
            raise NbdistError("no named runs yet: label runs with %%distributed --name LABEL "
                              "(Python: run_cell(code, name=...)), then compare them")
        unknown = [n for n in names if n not in self.named]
        if unknown:
            raise OptionError(f"no run named {', '.join(map(repr, unknown))}; named runs: "
                              f"{', '.join(self.named)}")
        chosen = {n: self.named[n].snapshot() for n in (names or self.named)}
        return Comparison(compare(chosen, self.tuning.known()))
