"""What the notebook knows of each job that reports to its collector: the fold of the frames
its node forwarders send (:mod:`nbdist.agent.wire`) into a job's record.

A job's events are folded by the same record a ``%%distributed`` cell's are
(:class:`~nbdist.telemetry.run.Run`: the whole job is one run), so the same views draw it.
What the run does not know is kept here: the hosts, each rank's process and how it ended, the
events dropped on the way, the connections that carry the job. Pure: frames in, records out;
the collector calls :meth:`Jobs.fold` from its connections' threads, under one lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..telemetry.events import flush_interval
from ..telemetry.recovery import Lost, Recovery, RecoveryKind
from ..telemetry.run import Run
from ..telemetry.snapshot import RunSnapshot
from .stalls import in_script, verdict

RUNNING, FINISHED, FAILED, LOST = "running", "finished", "failed", "lost"
STATES = (RUNNING, FINISHED, FAILED, LOST)
#: what a rank's row says when its job ended before the rank reported its end
UNREPORTED = ("ended without reporting its end (its launcher stopped it, or it was killed "
              "before it could say)")


@dataclass(frozen=True)
class JobRecord:
    """One job as ``nbdist.jobs()`` lists it.

    Attributes
    ----------
    id : str
        The job's number in this notebook (``%nbdist job ID show``).
    key : str
        What the job's ranks share: ``torchrun-<run id>``, ``slurm-<job id>``, or the
        rendezvous address.
    world_size : int
        Ranks in the job.
    hosts : tuple of str
        The hosts its ranks run on, sorted.
    state : str
        ``running``, ``finished`` (every rank ended well), ``failed`` (a rank's error ended
        it: ``error``) or ``lost`` (a rank, or its node's connection, vanished unsaid).
    steps : dict of int to int
        Optimizer steps seen per rank.
    started : float
        When the notebook heard of it first (``time.time()`` seconds).
    dropped : int
        Event batches dropped on the way because the notebook was not keeping up.
    error : str or None
        The error raised first among the ranks that ended with one (its root cause).
    restarts : int
        How often the launcher started the ranks again (``torchrun --max-restarts``); the
        attempts share one run (its chart goes on at the step the restart began, earlier
        attempts' rows kept as died), the steps are the latest attempt's.
    stall : str or None
        The hang doctor's verdict while the job makes no progress past its threshold (five
        median steps, at least 10 s), as a cell's dashboard says it: a headline (which ranks
        wait in which collective, which never reached it), then a line per rank with the
        script's line it stands at (``rank 1: in time.sleep(300) at train.py:27``). None
        while there is none (a rank moved again, or the job ended).
    """

    id: str
    key: str
    world_size: int
    hosts: tuple[str, ...]
    state: str
    steps: dict[int, int]
    started: float
    dropped: int = 0
    error: Optional[str] = None
    restarts: int = 0
    stall: Optional[str] = None

    def line(self) -> str:
        """The record as one line of text."""
        steps = ", ".join(f"{r}: {n}" for r, n in sorted(self.steps.items())) or "none"
        extra = f", {self.dropped} batches dropped" if self.dropped else ""
        extra += f", restarted {self.restarts}x" if self.restarts else ""
        extra += ", stalled (the hang doctor's verdict: show)" if self.stall else ""
        extra += f": {self.error}" if self.error else ""
        return (f"job {self.id} ({self.key}) {self.state}, {self.world_size} ranks on "
                f"{', '.join(self.hosts) or 'no host yet'}, steps {{{steps}}}{extra}")


@dataclass
class Restarted(Recovery):
    """A rank's process of the launcher's next attempt began (a mark on the job's chart)."""

    attempt: int = 0

    def line(self) -> str:
        return (f"launcher {time.strftime('%H:%M:%S', time.localtime(self.t))}: rank "
                f"{self.rank} started again (restart {self.attempt})")


@dataclass
class RankProcess:
    """One process of a rank (a restart is a new one)."""

    rank: int
    host: str
    pid: int
    restart: int = 0
    ended: Optional[str] = None  # None: running; else FINISHED, FAILED or LOST
    error: Optional[str] = None
    failed_at: float = float("inf")  # when its error was raised
    seq: int = 0  # its last batch folded


@dataclass
class Job:
    """What the notebook folded of one job so far."""

    id: str
    key: str
    world_size: int
    started: float = field(default_factory=time.time)
    run: Optional[Run] = None
    ranks: dict[int, RankProcess] = field(default_factory=dict)
    dropped: dict[tuple[str, int], int] = field(default_factory=dict)
    connections: set[int] = field(default_factory=set)
    #: a connection that carried this job ended (or its forwarder said bye)
    cut: bool = False
    ended: bool = False
    attempt: int = 0  # the launcher's restarts so far
    restart_step: int = 0  # the job's step the latest attempt began at
    notes: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        """Running while a connection carries the job (its launcher may yet restart ranks
        that ended); once none does, how its ranks ended."""
        if self.connections or not self.cut:
            return RUNNING
        ends = [p.ended for p in self.ranks.values()]
        if FAILED in ends:
            return FAILED
        if LOST in ends or None in ends or len(self.ranks) < self.world_size:
            return LOST
        return FINISHED

    def note(self, line: str) -> None:
        """A line of what happened to the job, kept with its run (the summary shows it)."""
        self.notes.append(line)
        if self.run is not None:
            self.run.notes.append(line)

    def restarted(self, attempt: int) -> None:
        """The launcher started the ranks again (torchrun's ``--max-restarts``): the ranks of
        the earlier attempt are gone, and the new ones report into the same run, each as a
        replacement of its rank from the job's next step on (:meth:`rejoined`)."""
        self.note(f"the launcher restarted the ranks (restart {attempt})")
        if self.run is not None:
            snap = self.run.snapshot()
            self.restart_step = max((r.steps for r in snap.ranks), default=0)
        self.attempt = attempt
        self.ranks = {}

    def began(self, t: float) -> None:
        """A rank of the job began at ``t``: the job began no later (a notebook that learns
        of a running job, restarted or attached late, counts its time from its ranks')."""
        if t < self.started:
            self.started = t
            if self.run is not None:
                self.run.started = t

    def rejoined(self, rank: int, t: float) -> None:
        """``rank``'s process of the launcher's latest attempt began: its steps go on in the
        run's row of its rank (the attempt's first step is the job's :attr:`restart_step`),
        and the chart marks where."""
        if self.run is not None and self.attempt:
            self.run.note_recovery(Restarted(t, RecoveryKind.JOINED, rank=rank,
                                             step=self.restart_step, attempt=self.attempt),
                                   line=False)

    def died(self, proc: RankProcess, t: float) -> None:
        """``proc`` vanished without saying how it ended: its row says it died."""
        if self.run is not None:
            self.run.note_recovery(Lost(t, proc.rank, proc.host, proc.pid, by="nbdist"),
                                   line=False)

    def record(self, snap: Any = None) -> JobRecord:
        """The job now; ``snap``: its run's snapshot just taken (None: take one)."""
        snap = self.snapshot() if snap is None else snap
        steps = {r.rank: r.steps for r in snap.ranks} if snap is not None else {}
        # the root cause, as torchrun names it: the error raised first (its peers' errors
        # follow from it: a collective that lost its peer)
        failed = sorted((p.failed_at, p.rank) for p in self.ranks.values() if p.error)
        error = self.ranks[failed[0][1]].error if failed else None
        return JobRecord(id=self.id, key=self.key, world_size=self.world_size,
                         hosts=tuple(sorted({p.host for p in self.ranks.values()})),
                         state=self.state, steps=steps, started=self.started,
                         dropped=sum(self.dropped.values()), error=error,
                         restarts=self.attempt, stall=verdict(snap))

    def snapshot(self) -> Optional[RunSnapshot]:
        return in_script(self.run.snapshot()) if self.run is not None else None


class Jobs:
    """Every job this notebook's collector heard of, by key, numbered in the order seen."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._detached: set[str] = set()  # keys whose frames are no longer folded
        self._count = 0
        self.lock = threading.Lock()

    def _job(self, key: str, world_size: int = 0) -> Job:
        job = self._jobs.get(key)
        if job is None:
            self._count += 1
            job = self._jobs[key] = Job(id=str(self._count), key=key, world_size=world_size)
        if world_size and job.run is None:
            job.world_size = world_size
            # no trace: nothing writes one for a watched job, and a week-long job would
            # fill the run's trace store for nothing
            job.run = Run(f"job {job.id}", range(world_size), world_size=world_size,
                          trace=False)
            job.run.started = job.started
        return job

    def fold(self, message: dict[str, Any], connection: int = 0) -> None:
        """Take one frame's message from ``connection``."""
        with self.lock:
            self._fold(message, connection)

    def fold_all(self, messages: list[tuple[dict[str, Any], int]]) -> None:
        """Take many frames' messages, each with its connection, in their order: what
        :meth:`fold` would make of them one by one, but each run of batches of one job is
        fed to its run at once (a run settles what its batches changed once per feed: at a
        thousand ranks, once per batch was most of the fold's cost)."""
        with self.lock:
            batches: list[dict[str, Any]] = []
            into: Optional[Job] = None
            for m, connection in messages:
                if m.get("type") == "batch":
                    job = self._batched(m, connection)
                    if job is None:
                        continue
                    if into is not None and job is not into:
                        into.run.feed(batches)  # type: ignore[union-attr]
                        batches = []
                    into = job
                    batches.append(m["batch"])
                    continue
                if into is not None:
                    into.run.feed(batches)  # type: ignore[union-attr]
                    batches, into = [], None
                self._fold(m, connection)
            if into is not None:
                into.run.feed(batches)  # type: ignore[union-attr]
                self._settle()

    def _batched(self, m: dict[str, Any], connection: int) -> Optional[Job]:
        """The job whose run takes batch message ``m`` (None: none does: an unknown or
        detached job, or a batch already folded)."""
        key = m.get("job")
        job = self._jobs.get(key) if isinstance(key, str) else None
        if job is None or job.run is None or key in self._detached:
            return None
        job.connections.add(connection)
        proc = job.ranks.get(int(m["batch"].get("rank", -1)))
        seq = int(m["batch"].get("seq", 0))
        if proc is not None and seq:
            if seq <= proc.seq:  # sent again by a forwarder that took over the node
                return None
            if proc.seq == 0 and seq > 1 and job.run is not None:
                # its first batches went to the notebook this one replaced (a restarted
                # kernel listening again with the token file): its steps count from its
                # own step numbers, not from what arrived here
                job.run.missed_start(proc.rank)
                job.note(f"rank {proc.rank}: its first {seq - 1} batches did not reach this "
                         "notebook (they went to one before it, or were dropped on the way); "
                         "its step count goes on from its own numbers")
            proc.seq = seq
        return job

    def _fold(self, m: dict[str, Any], connection: int) -> None:
        kind = m.get("type")
        if kind == "bye":  # the node's forwarder ended: what it did not report is lost ...
            if not self._awaited(connection):
                self._closed(connection)
            # ... unless a rank it carried has not said its end: a rank that forwarded for
            # its node ended first, and another takes over; the connection's close, which
            # follows, gives that one the collector's TAKE_OVER seconds
            return
        key = m.get("job")
        if not isinstance(key, str) or key in self._detached:
            return
        if kind == "rank":
            job = self._job(key, int(m["world_size"]))
            job.connections.add(connection)
            rank, restart = int(m["rank"]), int(m.get("restart", 0))
            if restart > job.attempt:
                job.restarted(restart)
            elif restart < job.attempt:
                return  # an earlier attempt's rank, sent again by a reconnecting forwarder
            pid = int(m.get("pid", 0))
            known = job.ranks.get(rank)
            if known is not None and known.pid == pid:
                return  # said again: a forwarder that reconnected, or took over the node
            job.ranks[rank] = RankProcess(rank, str(m.get("host", "")), pid, restart)
            t = float(m.get("t") or time.time())
            job.began(t)
            job.rejoined(rank, t)
        elif kind == "batch":
            batched = self._batched(m, connection)
            if batched is not None:
                batched.run.feed([m["batch"]])  # type: ignore[union-attr]
        elif kind == "dropped":
            job = self._job(key)
            job.dropped[(str(m.get("where", "node")), int(m["rank"]))] = int(m["count"])
        elif kind == "exit" and key in self._jobs:
            proc = self._jobs[key].ranks.get(int(m["rank"]))
            if proc is not None and proc.pid == int(m.get("pid", proc.pid)) and not proc.ended:
                proc.ended = (LOST if m.get("lost") else FINISHED if m.get("ok")
                              else FAILED)
                proc.error = m.get("error") or (None if proc.ended != FAILED
                                                else "ended with an error")
                if proc.error is not None:
                    proc.failed_at = float(m.get("failed_at") or m.get("t") or float("inf"))
                if proc.ended == LOST:
                    self._jobs[key].died(proc, float(m.get("t") or time.time()))
                    self._jobs[key].note(f"rank {proc.rank} (pid {proc.pid} on {proc.host}) "
                                         "ended without saying how: killed, or lost")
                elif proc.ended == FAILED:
                    job = self._jobs[key]
                    job.note(f"rank {proc.rank} (pid {proc.pid} on {proc.host}) failed: "
                             f"{proc.error}")
                    if job.run is not None and proc.error is not None:
                        # its end may have said it ended well: a status the script raised
                        # itself is known to its launcher only
                        t = proc.failed_at if proc.failed_at < float("inf") else time.time()
                        job.run.failed_on_exit(proc.rank, proc.error, t)
        self._settle()

    def _awaited(self, connection: int) -> bool:
        """A job ``connection`` carries has a rank whose end is not known yet."""
        return any(connection in job.connections
                   and (len(job.ranks) < job.world_size
                        or any(p.ended is None for p in job.ranks.values()))
                   for job in self._jobs.values())

    def closed(self, connection: int) -> None:
        """``connection`` ended: once no connection carries a job, its ranks that did not
        report their end are lost."""
        with self.lock:
            self._closed(connection)

    def _closed(self, connection: int) -> None:
        for job in self._jobs.values():
            if connection in job.connections:
                job.connections.discard(connection)
                job.cut = True
        self._settle()

    def _settle(self) -> None:
        """A job that ended stops its run (ranks that never said their end are stopped)."""
        for job in self._jobs.values():
            if not job.ended and job.run is not None and job.state != RUNNING:
                job.ended = True
                job.run.finish(UNREPORTED)

    def records(self) -> list[JobRecord]:
        with self.lock:
            return [job.record() for job in self._jobs.values()]

    def get(self, ident: str) -> Optional[Job]:
        """A job by its number or its key."""
        with self.lock:
            for job in self._jobs.values():
                if ident in (job.id, job.key):
                    return job
            return None

    def detach(self, ident: str) -> Optional[Job]:
        """Stop watching a job (by number or key): its record goes and its frames are
        ignored from now on. Returns the job (None: no such job)."""
        with self.lock:
            for key, job in list(self._jobs.items()):
                if ident in (job.id, job.key):
                    del self._jobs[key]
                    self._detached.add(key)
                    return job
            return None


class WatchedJob:
    """A handle on one watched job (``nbdist.job(ID)``), read from the kernel's collector."""

    def __init__(self, jobs: Jobs, job: Job,
                 ask_stacks: Optional[Callable[..., dict[int, str]]] = None,
                 tell_detach: Optional[Callable[[str], Any]] = None):
        self._jobs = jobs
        self._job = job
        self._ask_stacks = ask_stacks
        self._tell_detach = tell_detach

    @property
    def id(self) -> str:
        return self._job.id

    @property
    def record(self) -> JobRecord:
        """The job now, as ``nbdist.jobs()`` lists it."""
        with self._jobs.lock:
            return self._job.record()

    def snapshot(self) -> Optional[RunSnapshot]:
        """The job's numbers now, as a cell's dashboard draws them (None: no rank seen yet)."""
        with self._jobs.lock:
            return self._job.snapshot()

    def summary(self) -> str:
        """The job as text: its record's line, then the run's table (steps, time split,
        memory per rank, verdicts once it ended)."""
        from ..display.text import format_summary

        snap = self.snapshot()
        line = self.record.line()
        return line if snap is None else f"{line}\n{format_summary(snap)}"

    def show(self) -> Any:
        """Show the job (``%nbdist job ID show``): in a notebook with widgets, a panel of its
        record and its run's dashboard that refreshes itself while shown and the kernel is
        idle; elsewhere :meth:`summary` printed. Returns the panel (None: printed)."""
        from ..display import show_job

        # A refresh asks for the state, the snapshot, then the header: one snapshot serves
        # both of the latter (at thousands of ranks, a snapshot is most of a refresh's cost).
        drawn: list[Optional[RunSnapshot]] = [None]

        def ended() -> bool:  # or detached: no more news comes
            with self._jobs.lock:
                return self._job.state != RUNNING or self._job.key in self._jobs._detached

        def snapshot() -> Optional[RunSnapshot]:
            drawn[0] = self.snapshot()
            return drawn[0]

        def header() -> str:
            with self._jobs.lock:
                line = self._job.record(drawn[0]).line()
                detached = self._job.key in self._jobs._detached
            return f"{line}; detached: no longer watched" if detached else line

        # No more often than a rank's news comes (every 4 s at a thousand ranks: see
        # flush_interval), and at least every second.
        every = max(1.0, flush_interval(self._job.world_size))
        return show_job(header, snapshot, ended, range(self._job.world_size), self.summary,
                        interval=every)

    def stacks(self, rank: Optional[int] = None, timeout: float = 10.0) -> dict[int, str]:
        """Each running rank's Python stack, taken now (``%nbdist job ID stacks``), also
        where a rank waits in a collective or a sleep: {rank: the stack as a traceback prints
        it, outermost first}. ``rank``: that rank only. A rank that does not answer within
        ``timeout`` seconds has a line that says so. Only running ranks are asked: a job that
        is not running (finished, failed, lost) or whose ranks all ended has no stacks ({}),
        at once.

        Raises
        ------
        LookupError
            ``rank`` is not one of the job's ranks (0 to its world size - 1).
        """
        with self._jobs.lock:
            world = self._job.world_size
            running = self._job.state == RUNNING and any(
                p.ended is None and rank in (None, r) for r, p in self._job.ranks.items())
        if rank is not None and world and not 0 <= rank < world:
            raise LookupError(f"rank {rank} is not in job {self._job.id} ({self._job.key}): "
                              f"its ranks are 0..{world - 1} (world size {world})")
        if self._ask_stacks is None or not running:
            return {}
        return self._ask_stacks(self._job.key, rank, timeout)

    def detach(self) -> str:
        """Stop watching the job (``%nbdist job ID detach``): its forwarders are told to send
        nothing more of it (the job runs on unreported) and the notebook forgets it; says
        what was detached."""
        if self._tell_detach is not None:
            self._tell_detach(self._job.key)
        self._jobs.detach(self._job.key)
        return (f"job {self._job.id} ({self._job.key}) detached: its forwarders send nothing "
                "more of it")

    def __repr__(self) -> str:
        return f"<nbdist watched {self.record.line()}>"
