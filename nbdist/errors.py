"""Errors nbdist raises in the notebook: what went wrong, on which rank and host, what to do.

Each user-facing message is written once, here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .telemetry.stall.words import (
    clash_sentences,
    missing_sentence,
    stranded_sentence,
    where_lines,
)
from .telemetry.units import fmt_ranks

if TYPE_CHECKING:
    from .runtime.results import CellResult
    from .telemetry.stall.report import StallReport, Stranded

#: how to get a cluster, for every "no cluster" message
NO_CLUSTER = ("no nbdist cluster is running. Start one with `%nbdist start -n 2` "
              "(Python: `nbdist.start(2)`), or attach with `%nbdist connect`.")
#: added to NO_CLUSTER when auto mode sent a cell to the ranks
AUTO_NO_CLUSTER = ("Auto mode is on, so this cell was meant for the ranks; `%nbdist auto off` "
                   "runs cells in the kernel again.")
#: nbdist.auto() typed in a cell that auto mode sent to the ranks
AUTO_ON_A_RANK = ("nbdist.auto() ran on a rank, because auto mode sent this cell there: "
                  "`%nbdist auto off` (a magic, so it runs in the kernel) ends auto mode, or "
                  "call nbdist.auto() in a `%%local` cell.")
#: the line each cell shows while auto mode is on
AUTO_ON = ("nbdist auto: this cell runs on ranks {ranks} · a cell starting with %%local (or "
           "any magic) runs in the kernel · %nbdist auto off ends it")
#: what a user must do after the process group was re-formed under their objects
REBUILD_DDP = ("The process group is re-formed for the next cell; re-create "
               "DistributedDataParallel wrappers made before this cell.")
#: why a partial-rank cell that failed in a collective failed
PARTIAL_RANKS = ("This cell ran on rank(s) {ranks} only, but collectives need every rank of "
                 "the group; a cell that runs on every rank re-forms the group if it was lost.")
#: tracebacks drawn in full by a multi-rank error; the rest are listed by headline
MAX_TRACEBACKS = 4
#: %%distributed --tune: why a cell cannot be tuned
TUNE_TOO_FEW = ("--tune needs at least {least} optimizer steps per trial (its first steps are "
                "not timed), got {steps}")
TUNE_NO_DDP = ("--tune: this cell built no DistributedDataParallel model, so there is no DDP "
               "setting to try. Put the model's construction (DDP(...)) in the tuned cell: each "
               "trial runs the whole cell again, with its own setting")
TUNE_TOO_SHORT = ("--tune {steps}: the cell ended after {done} optimizer steps, before the "
                  "{steps} a trial takes; use --tune {done} or fewer, or give it more batches")
TUNE_FLAGS = ("--tune runs the cell on every rank, with telemetry, as trials named by their "
              "setting: leave out {flags}")


class NbdistError(Exception):
    """Base class of every error nbdist raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of nbdist's internal frames: the message is the point."""
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


class OptionError(NbdistError, ValueError):
    """A bad option value (``-n 0``, ``--ranks 5`` on 2 ranks); magics show it as usage.

    ``key`` names the option as a profile spells it (``workers``, ``dist_backend``), so a
    profile's error can point at the line that set it.
    """

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class ProfileError(OptionError):
    """A profile file that cannot be used: missing, not YAML, or not valid. Nothing started.

    ``problems`` holds one ``(line, dotted key, message)`` per problem found.
    """

    def __init__(self, path: str, problems: Sequence[tuple[Optional[int], str, str]]) -> None:
        self.path = path
        self.problems = list(problems)
        lines = [f"{path}{f', line {line}' if line else ''}: {key + ': ' if key else ''}{msg}"
                 for line, key, msg in self.problems]
        if len(lines) == 1:
            text = f"bad profile {lines[0]}"
        else:
            text = f"bad profile {path} ({len(lines)} problems):\n  " + "\n  ".join(lines)
        super().__init__(text + "\nNothing was started.")


class TuneError(NbdistError):
    """A cell ``%%distributed --tune`` cannot tune; no setting changed."""


class ExportError(NbdistError):
    """``%nbdist export`` has nothing to write, or would overwrite a file it did not write."""


class AttachError(NbdistError, ValueError):
    """``%nbdist attach`` (``nbdist.attach``) cannot do what it was asked: a ``--listen``
    that is not ``[HOST:]PORT``, a token file that is a directory, that others may read or
    that holds no attach line, half of TLS, a certificate or key that is missing or not PEM,
    or a collector that already listens elsewhere or with other TLS settings. Nothing was
    started."""

    @classmethod
    def listen(cls, text: str) -> AttachError:
        return cls(f"--listen takes [HOST:]PORT (e.g. 9000 or 0.0.0.0:9000), not {text!r}")

    @classmethod
    def token_file_open(cls, path: str, mode: int) -> AttachError:
        return cls(f"token file {path} may be read by others (mode {mode:o}): chmod 600 "
                   f"{path}, or remove it for a new token")

    @classmethod
    def token_file_empty(cls, path: str, why: object) -> AttachError:
        return cls(f"token file {path} holds no attach line ({why}): remove it, and attach "
                   "writes a new one (a job started with the old line then needs the new)")

    @classmethod
    def half_tls(cls) -> AttachError:
        return cls("TLS needs both --tls-cert and --tls-key: give both, or neither for a "
                   "plain tcp:// line")

    @classmethod
    def token_file_dir(cls, path: str) -> AttachError:
        return cls(f"token file {path} is a directory: give the path of a file in it (e.g. "
                   f"{path.rstrip('/')}/nbdist-token), which attach writes if missing")

    @classmethod
    def listening_elsewhere(cls, host: str, port: int,
                            close: str = "nbdist.attach().close()") -> AttachError:
        return cls(f"the collector already listens at {host}:{port}; close it first "
                   f"({close}), or attach without --listen to keep it")

    @classmethod
    def tls_differs(cls, runs: str, asked: str, keep: str, close: str) -> AttachError:
        return cls(f"the collector already runs with {runs}, and this attach asks for "
                   f"{asked}; attach {keep} to keep it, or close it first ({close}) and "
                   "attach again")

    @classmethod
    def tls_file(cls, what: str, path: str, wrong: str) -> AttachError:
        return cls(f"TLS {what} {path} {wrong}: give --tls-cert a PEM certificate and "
                   "--tls-key its unencrypted PEM key (tls_cert=, tls_key= in Python)")


class ClusterError(NbdistError):
    """Starting, reaching, scaling or stopping workers failed."""


class WorkersDidNotStart(ClusterError):
    """Fewer workers than wanted came up in time. The engine's own error is the ``__cause__``."""

    def __init__(self, engine: str, ready: int, wanted: int, timeout: float,
                 detail: str = "") -> None:
        self.engine, self.ready, self.wanted, self.timeout = engine, ready, wanted, timeout
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"only {ready} of {wanted} {engine} workers started within {timeout:g} s{why}. "
            "Try a longer --timeout, or fewer workers with -n.")


class LaunchFailed(ClusterError):
    """A launcher could not start the workers, for a reason more time would not change (a
    host out of reach, its Python without the packages, a batch job refused); whatever was
    started is stopped."""


class UnguardedScriptError(ClusterError):
    """Dask workers would be started from a script's top level, outside a main guard: they
    import the script again, so none would start. Nothing was started."""

    def __init__(self, script: str, line: int) -> None:
        self.script, self.line = script, line
        super().__init__(
            f"{script}, line {line}, starts Dask workers at the top level of the script, "
            "outside an `if __name__ == \"__main__\":` block. Dask's workers are new Python "
            "processes that import the script again, so each would run this line again and "
            "none would start. Put the script's top-level code under "
            "`if __name__ == \"__main__\":` (a notebook needs no guard). Nothing was started.")


class MissingPackageError(NbdistError, ImportError):
    """A launcher needs a package that is not installed here; nothing was started.

    ``extra`` names nbdist's extra that installs it (``pip install 'nbdist[slurm]'``)."""

    def __init__(self, what: str, package: str, extra: Optional[str] = None) -> None:
        self.package = package
        install = (f"pip install 'nbdist[{extra}]' (or pip install {package})" if extra
                   else f"pip install {package}")
        super().__init__(f"{what} needs the `{package}` package, which is not installed: "
                         f"{install}")


class WorkersGone(ClusterError):
    """Ranks whose worker process is gone (it exited, was killed, or lost the scheduler)."""

    def __init__(self, ranks: Sequence[int], hosts: Sequence[str] = (),
                 owned: bool = True, world_size: Optional[int] = None) -> None:
        self.ranks = sorted(ranks)
        where = f" on {', '.join(sorted(set(hosts)))}" if hosts else ""
        n = world_size if world_size is not None else "N"
        replace = (f"%nbdist scale {n} to start replacements and re-form the group (the "
                   "surviving ranks keep their namespaces)" if owned else
                   "restart the missing workers with the tool that started them, then "
                   "%nbdist restart")
        super().__init__(
            f"rank(s) {fmt_ranks(self.ranks)}{where} are gone: the worker process exited, was "
            f"killed, or lost its connection. Run %nbdist restart for fresh workers (every "
            f"namespace starts empty), or {replace}.")


class WorkerCallFailed(ClusterError):
    """One of nbdist's own calls on the workers (describe them, form the group, open a store)
    failed: ``late`` workers did not answer within ``timeout`` seconds, or the engine failed
    the call on each worker of ``errors`` (worker id -> the engine's text)."""

    def __init__(self, what: str, *, late: Sequence[object] = (),
                 timeout: Optional[float] = None,
                 errors: Optional[dict[object, str]] = None) -> None:
        self.what, self.late, self.timeout = what, list(late), timeout
        self.errors = dict(errors or {})
        if self.errors:
            detail = "\n".join(f"worker {w}: {e}" for w, e in self.errors.items())
            super().__init__(f"could not {what}:\n{detail}")
        else:
            super().__init__(f"workers {self.late} did not {what} within {timeout:g} s")


class NoClusterError(NbdistError):
    """A command that needs workers ran before ``%nbdist start`` / ``connect``."""

    def __init__(self) -> None:
        super().__init__(NO_CLUSTER)


@dataclass(frozen=True)
class RankFailure:
    """One rank's error, as the worker classified it."""

    rank: int
    hostname: str
    ename: str
    evalue: str
    traceback: str = ""
    line: Optional[int] = None
    #: failed in communication (a collective, the group), not in the cell's own code
    communication: bool = False
    #: failed only because a peer died or closed the group under it
    caused_by_peer: bool = False
    #: when the rank recorded its error (a script's ``@record`` error file), seconds since epoch
    timestamp: Optional[float] = None
    #: the cell as the notebook numbers it (``In [12]``), when it does
    cell: Optional[str] = None

    @classmethod
    def from_result(cls, rank: int, hostname: str, result: CellResult,
                    cell: Optional[str] = None) -> RankFailure:
        """The failure a worker's result describes (a cell's error, or a script's exit)."""
        err = result.get("error")
        if err is None:  # a script's non-zero exit
            msg = ("interrupted" if result.get("interrupted")
                   else f"exited with status {result.get('returncode')}")
            return cls(rank, hostname, "ScriptError", msg)
        return cls(rank, hostname, err["ename"], err["evalue"], err["traceback"], err["line"],
                   err["communication"], err["caused_by_peer"], err.get("timestamp"), cell)

    @property
    def where(self) -> str:
        """`` (In [12], line 6)`` or `` (cell line 6)``: the line as the editor numbers it."""
        if not self.line:
            return ""
        return f" ({self.cell}, line {self.line})" if self.cell else f" (cell line {self.line})"

    def headline(self) -> str:
        return f"rank {self.rank} on {self.hostname}: {self.ename}: {self.evalue}{self.where}"


class DistributedError(NbdistError):
    """A ``%%distributed`` cell or ``%nbdist run`` failed on one or more ranks.

    ``failures`` holds every failing rank; ``causes`` those that did not merely lose a peer.
    """

    def __init__(self, failures: Sequence[RankFailure], what: str = "cell",
                 remedy: str = "") -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.what = what
        self.remedy = remedy
        super().__init__(self._summary())

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    @property
    def causes(self) -> list[RankFailure]:
        """Failures that did not merely lose a peer; the first recorded one first (as torchrun
        reports a job's first failure as its root cause), else by rank."""
        primary = [f for f in self.failures if not f.caused_by_peer] or list(self.failures)
        return sorted(primary, key=lambda f: (f.timestamp is None, f.timestamp or 0, f.rank))

    def _summary(self) -> str:
        causes = self.causes
        plural = "s" if len(causes) > 1 else ""
        head = causes[0]
        first = (f"first on rank {head.rank}: " if len(causes) > 1 and head.timestamp is not None
                 else "")
        msg = (f"{self.what} failed on rank{plural} {fmt_ranks(f.rank for f in causes)}: "
               f"{first}{head.ename}: {head.evalue}")
        others = [f.rank for f in self.failures if f not in causes]
        if others:
            msg += f" (rank{'s' if len(others) > 1 else ''} {fmt_ranks(others)} stopped " \
                   "because of it)"
        return msg

    def _render_traceback_(self) -> list[str]:
        """Used by IPython instead of our local frames: the remote tracebacks, grouped.

        Ranks that failed the same way (same exception, message and cell line) share one
        traceback, and at most :data:`MAX_TRACEBACKS` are drawn in full.
        """
        lines = [f"\x1b[31m{type(self).__name__}\x1b[0m: {self._summary()}", ""]
        groups: dict[tuple, list[RankFailure]] = {}
        for f in self.causes:
            groups.setdefault((f.ename, f.evalue, f.line), []).append(f)
        for k, same in enumerate(groups.values()):
            first = same[0]
            if k == MAX_TRACEBACKS:
                rest = [f for g in list(groups.values())[k:] for f in g]
                lines.append(f"... and {len(groups) - k} more distinct error(s) on rank(s) "
                             f"{fmt_ranks(f.rank for f in rest)}; see .failures")
                lines.append("")
                break
            if len(same) > 1:
                hosts = sorted({f.hostname for f in same})
                lines.append(f"\x1b[1m--- ranks {fmt_ranks(f.rank for f in same)} on "
                             f"{', '.join(hosts)}: {first.ename}: {first.evalue}"
                             + first.where
                             + " (same traceback)\x1b[0m")
            else:
                lines.append(f"\x1b[1m--- {first.headline()}\x1b[0m")
            lines.extend(first.traceback.rstrip("\n").splitlines()
                         or [f"{first.ename}: {first.evalue}"])
            lines.append("")
        for f in self.failures:
            if f not in self.causes:
                lines.append(f"--- {f.headline()}")
        if self.remedy:
            lines += ["", self.remedy]
        return lines


class DebuggerQuit(DistributedError):
    """``q`` in a rank's debugger ended its cell; the ranks that waited for it in a collective
    were released, as for any error on a rank. Workers and namespaces stay as they were."""


def cell_error(failures: Sequence[RankFailure], what: str = "cell",
               remedy: str = "") -> DistributedError:
    """The error of a call that failed on ``failures``: :class:`DebuggerQuit` when ``q`` in a
    rank's debugger is what ended it, else a :class:`DistributedError`."""
    err = DistributedError(failures, what, remedy)
    if all(f.ename == "DebuggerQuit" for f in err.causes):
        return DebuggerQuit(failures, what, remedy)
    return err


class DebuggerUnavailable(NbdistError):
    """``%nbdist debug`` cannot open a debugger here; the message says why."""


class NothingToDebug(NbdistError):
    """``%nbdist debug``: no rank (or not the one asked for) kept a failure to inspect."""

    def __init__(self, rank: Optional[int], ranks: Sequence[int]) -> None:
        self.rank, self.ranks = rank, sorted(ranks)
        have = (f"rank{'s' if len(self.ranks) > 1 else ''} with one: {fmt_ranks(self.ranks)} "
                f"(%nbdist debug {self.ranks[0]})" if self.ranks else "no rank has one")
        if rank is None:
            text = ("nothing to debug: no rank's last cell failed (a worker keeps its last "
                    "failure until its next cell)")
        else:
            text = f"rank {rank} has no failure to inspect; {have}"
        super().__init__(text)


def where_section(where: Optional[StallReport], label: Optional[str] = None,
                  blame: bool = True) -> str:
    """The "where was each rank" part of a timeout's or an interrupt's error ("" without
    reports): a line per rank, then (``blame``) the ranks that never reached the collective."""
    if where is None:
        return ""
    lines = ["", "", "Where each rank was when it was interrupted:"]
    lines += [f"  {line}" for line in where_lines(where, label)]
    lines += clash_sentences(where)
    sentence = missing_sentence(where) if blame else ""
    if sentence:
        lines += [sentence + " Look at what those ranks do before it: a collective must be "
                             "called by every rank of its group, in the same order."]
    return "\n".join(lines)


#: names listed when a restart loses a namespace; the rest are counted
MAX_NAMES = 12


@dataclass(frozen=True)
class RanksRestarted:
    """Ranks an interrupt could not stop, whose worker processes the engine replaced (see
    :mod:`nbdist.cell.interrupt`): their namespaces are gone."""

    ranks: tuple[int, ...]
    #: seconds the ranks had to stop after the interrupt
    grace: float
    #: ranks in the job
    world_size: int
    #: the host of each rank
    hosts: Mapping[int, str] = field(default_factory=dict)
    #: the names each rank's namespace held (a rank missing here: not known)
    names: Mapping[int, Sequence[str]] = field(default_factory=dict)
    #: ranks whose worker was stopped but not replaced (a worker without a nanny)
    removed: tuple[int, ...] = ()
    #: why the group could not be formed again with the new processes ("" when it was)
    not_reformed: str = ""
    #: the names each rank's fresh process bound again by importing them (modules, imported
    #: classes and functions): not lost
    restored: Mapping[int, Sequence[str]] = field(default_factory=dict)

    def held(self, rank: int) -> str:
        """`` (it held: model, opt); its imports are restored: np, torch``: what a rank's
        namespace held, as far as known, and what was imported again."""
        again = self.restored.get(rank, ())
        back = f"; its imports are restored: {fmt_names(again)}" if again else ""
        if rank not in self.names:
            return back
        names = self.names[rank]
        if not names:
            return (" (it held no names of its own besides its imports)" if again
                    else " (it held no names of its own)") + back
        return f" (it held: {fmt_names(names)})" + back


def fmt_names(names: Sequence[str]) -> str:
    """``model, opt and 3 more``: names a namespace held, at most :data:`MAX_NAMES` of them."""
    more = len(names) - MAX_NAMES
    return ", ".join(names[:MAX_NAMES]) + (f" and {more} more" if more > 0 else "")


def restarted_section(r: Optional[RanksRestarted]) -> str:
    """What an interrupt's escalation did to ranks that did not stop ("" when none)."""
    if r is None:
        return ""
    replaced = [k for k in r.ranks if k not in r.removed]
    lines = ["", ""]
    if replaced:
        where = ", ".join(f"rank {k} on {r.hosts.get(k, '?')}" for k in replaced)
        lines.append(
            f"{where} did not stop within {r.grace:g} s of the interrupt (blocked in a call no "
            f"interrupt reaches: a long sleep, native code), so the engine restarted "
            f"{'its worker process' if len(replaced) == 1 else 'their worker processes'}. "
            + " ".join(f"Rank {k}'s namespace is lost{r.held(k)}." for k in replaced))
        if r.not_reformed:
            lines.append(f"The process group could not be formed again with the new "
                         f"process{'es' if len(replaced) > 1 else ''} ({r.not_reformed}): run "
                         "%nbdist restart for fresh workers.")
        else:
            others = ("The other ranks keep their namespaces; the"
                      if len(replaced) < r.world_size else "The")
            lines.append(
                f"{others} process group is formed again, rank {fmt_ranks(replaced)} in a fresh "
                f"process. Define what {'it' if len(replaced) == 1 else 'they'} lost again: run "
                f"the cells that made it (`%%distributed --ranks {fmt_ranks(replaced)}` runs a "
                "cell there only), or %nbdist restart for fresh workers everywhere.")
    if r.removed:
        lines.append(
            f"Rank(s) {fmt_ranks(r.removed)} did not stop and their workers were stopped, not "
            "replaced (they run without a Dask nanny): start workers in their place with the "
            "tool that started the cluster, then %nbdist restart.")
    return "\n".join(lines)


class CellTimeoutError(NbdistError):
    """A cell ran past its ``--timeout``. ``where`` says where each rank was (the hang
    doctor's :class:`~nbdist.telemetry.stall.report.StallReport`, None without reports)."""

    def __init__(self, timeout: float, ranks: Sequence[int], hint: str = "",
                 where: Optional[StallReport] = None, label: Optional[str] = None,
                 restarted: Optional[RanksRestarted] = None) -> None:
        self.ranks = list(ranks)
        self.timeout = timeout
        self.where = where
        self.restarted = restarted
        super().__init__(
            f"cell ran past --timeout {timeout:g} s; rank(s) {self.ranks} were still running and "
            f"were interrupted. {REBUILD_DDP}" + (f" {hint}" if hint else "")
            + restarted_section(restarted) + where_section(where, label))


#: the remedy when a DDP model's collectives wait for ranks that ran out of inputs
UNEVEN_DDP = ("The ranks had different numbers of batches (uneven inputs), and every "
              "DistributedDataParallel step all-reduces the gradients with every rank. Wrap the "
              "training loop in `with model.join():` (torch.distributed.algorithms.Join): a rank "
              "that runs out of inputs then joins the others' collectives until all are done. "
              "Or give every rank the same number of batches (DistributedSampler with "
              "drop_last=True).")
#: the remedy when collectives outside DDP wait for a rank that finished
UNEVEN_CALLS = ("The ranks called different numbers of collectives: every rank of a group must "
                "call each collective, in the same order. Look for a collective under "
                "`if rank == ...`, or a loop whose length differs between ranks.")


class RanksFinishedError(NbdistError):
    """Some ranks finished the cell while others waited in a collective that needs every
    rank: no call of it can complete, so the waiting ranks were interrupted at once instead
    of at the group's timeout. ``stranded`` says which ranks finished and where the others
    waited; ``where`` where each rank was when interrupted."""

    def __init__(self, stranded: Stranded, ranks: Sequence[int],
                 where: Optional[StallReport] = None, label: Optional[str] = None,
                 what: str = "cell", restarted: Optional[RanksRestarted] = None) -> None:
        self.finished = list(stranded.finished)
        self.ranks = list(ranks)
        self.stranded = stranded
        self.where = where
        self.restarted = restarted
        remedy = UNEVEN_DDP if stranded.ddp else UNEVEN_CALLS
        super().__init__(
            f"{what} ended: {stranded_sentence(stranded, label)} Rank(s) {self.ranks} were "
            f"interrupted now rather than at the group's timeout. {remedy} {REBUILD_DDP}"
            + restarted_section(restarted) + where_section(where, label, blame=False))


class CellInterrupted(KeyboardInterrupt):
    """The kernel was interrupted (the stop button, Ctrl-C) while a cell ran on the ranks.

    A ``KeyboardInterrupt``, so ``except KeyboardInterrupt`` still catches it; its message
    names the ranks that were interrupted and says where each one was (``where``).
    """

    def __init__(self, ranks: Sequence[int], where: Optional[StallReport] = None,
                 label: Optional[str] = None, what: str = "cell",
                 restarted: Optional[RanksRestarted] = None) -> None:
        self.ranks = list(ranks)
        self.where = where
        self.restarted = restarted
        super().__init__(
            f"{what} interrupted; rank(s) {self.ranks} were still running and were interrupted. "
            f"{REBUILD_DDP}" + restarted_section(restarted) + where_section(where, label))

    def _render_traceback_(self) -> list[str]:
        """IPython shows the message, not the kernel's frames it was raised in."""
        return [f"\x1b[31mKeyboardInterrupt\x1b[0m: {self}"]


class InterruptTimeoutError(ClusterError):
    """Ranks did not stop after an interrupt: they are stuck where Python cannot reach them."""

    def __init__(self, ranks: Sequence[int], grace: float) -> None:
        self.ranks = list(ranks)
        super().__init__(
            f"rank(s) {self.ranks} did not stop after an interrupt within {grace:g} s "
            "(stuck in native code?). Run %nbdist restart to get fresh workers.")
