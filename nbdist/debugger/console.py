"""The debugger's notebook half: the ranks' prompts answered through the kernel's stdin, and
``%nbdist debug`` (post-mortem on a rank). The workers' half is :mod:`nbdist.runtime.debugger`.

Each call the session sends to the ranks carries a :class:`~nbdist.runtime.debugger.Link`
(:func:`link`): where the answers go in the job's store, and whether anyone can answer. A rank
that stops (``breakpoint()``, ``pdb.set_trace()``, ``input()``) sends its prompt as an
``input`` event; the cell loop hands the events to a :class:`Console`, which asks the user
through ``input()`` (ipykernel's input box, the same one ``input()`` uses in a notebook; the
terminal elsewhere) and writes the answer to the store, where the rank waits for it.

Several ranks may wait at once. The console asks for one prompt at a time and stays with a rank
while it keeps prompting (its next prompt follows an answer within :data:`STICKY_S`), so one
rank's session is not interleaved with another's; each prompt names its rank, and the console
says which other ranks wait. The time prompts are open is given back to the cell's
``--timeout`` (:meth:`Console.paused`).

The answers travel through the store the notebook hosts: where rank 0's worker hosts it (the
workers cannot reach the notebook's address), no one can answer, and a rank passes its
``breakpoint()`` with one line saying so, as it does where the kernel has no stdin (a notebook
run by nbclient or papermill).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..backends.base import Call
from ..cell.loop import CellRun, cell_label
from ..errors import DebuggerUnavailable, NothingToDebug
from ..options import parse_ranks
from ..runtime import worker as rt
from ..runtime.debugger import Link, failure
from ..telemetry.events import DEBUGGER, INPUT, Batch, answer_key
from ..telemetry.run import Run
from ..telemetry.units import fmt_ranks

if TYPE_CHECKING:
    from ..group.membership import Membership
    from ..telemetry.snapshot import RunSnapshot

#: after answering a rank, how long its next prompt may take to come before another rank's
#: prompt is asked (a rank running ``n`` prompts again within milliseconds)
STICKY_S = 1.0

NO_STORE = ("the debugger's answers travel through the job's rendezvous store, and rank 0's "
            "worker hosts it here, because the workers cannot reach this notebook's address")
NO_KERNEL_STDIN = ("this notebook runs without a front end to type in (nbclient, papermill, "
                   "nbconvert --execute): its kernel takes no input")
NO_TERMINAL = "this Python process has no terminal to read from"


def stdin_state() -> tuple[bool, str]:
    """Whether the user can be asked for a line now; if not, why."""
    ipython = sys.modules.get("IPython")  # no shell if IPython was never imported
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:  # ipykernel knows whether this request's front end takes input
        return (True, "") if getattr(kernel, "_allow_stdin", False) else (False, NO_KERNEL_STDIN)
    if _is_tty(sys.stdin):
        return True, ""
    return False, NO_TERMINAL


_tty: tuple[Any, bool] = (None, False)  # the last stdin asked, and whether it is a terminal


def _is_tty(stdin: Any) -> bool:
    """``stdin.isatty()``, asked once per stdin (a system call on every cell otherwise)."""
    global _tty
    try:
        if stdin is None or stdin.closed:
            return False
        if _tty[0] is not stdin:
            _tty = (stdin, stdin.isatty())
    except (ValueError, AttributeError):  # closed, or not a file
        return False
    return _tty[1]


def ask_user(prompt: str) -> Optional[str]:
    """A line typed by the user after ``prompt``: ipykernel's input box in a notebook, the
    terminal elsewhere. None when no one can answer."""
    try:
        return input(prompt)
    except (EOFError, NotImplementedError, OSError):  # IPython's StdinNotImplementedError too
        return None


def _say(text: str, end: str = "\n") -> None:
    print(text, end=end, flush=True)


def link(m: Membership, key: str) -> Link:
    """How a call's ranks reach the notebook's stdin; ``key`` prefixes its answers' keys."""
    stdin, why = stdin_state()
    if stdin and m.store is None:
        stdin, why = False, NO_STORE
    return Link(key, stdin, why, os.environ.get("PYTHONBREAKPOINT"))


def where(file: str, line: Optional[int], func: str = "") -> str:
    """``In [5], line 3``, ``cell line 3``, with ``, in train`` inside a function ("" when
    the rank did not say)."""
    if not file:
        return ""
    label = cell_label(file)
    text = (f"{label}, line {line}" if label else
            f"cell line {line}" if file.startswith("<") else f"{file}, line {line}")
    return text + (f", in {func}" if func and not func.startswith("<") else "")


@dataclass
class Prompt:
    """A rank waiting for a line: its ``n``-th prompt in the call."""

    rank: int
    n: int
    text: str
    before: str  # what the debugger printed since its last prompt
    mode: str  # "pdb" or "input"
    place: str  # where the rank stands, in words
    order: int  # prompts of the call that arrived before it


class Console:
    """The prompts of one call's ranks, answered one at a time (see the module docstring).

    ``answer(key, value)`` writes to the job's store; ``ask`` asks the user (None: no one can
    answer); ``say`` prints a line; ``why`` is why no one can answer, for ranks that passed a
    breakpoint; ``group_timeout`` is the process group's collective timeout, which the first
    debugger session mentions.
    """

    def __init__(self, key: str, answer: Callable[[str, bytes], None], *,
                 ask: Optional[Callable[[str], Optional[str]]] = None,
                 say: Callable[..., None] = _say, clock: Callable[[], float] = time.monotonic,
                 why: str = "", group_timeout: Optional[float] = None) -> None:
        self.key, self.answer, self.say, self.clock = key, answer, say, clock
        self.ask = ask if ask is not None else (lambda prompt: ask_user(prompt))
        self.why, self.group_timeout = why, group_timeout
        self.open: dict[int, Prompt] = {}  # rank -> its open prompt
        self.current: Optional[int] = None  # the rank answered last
        self.answered_at = float("-inf")
        self.stdin = True  # False once asking failed: every later prompt gets no answer
        self._paused = 0.0
        self._open_since: Optional[float] = None
        self._arrived = 0
        self._told: tuple[int, ...] = ()  # the waiting ranks the console named last
        self._warned = False  # the group's timeout was mentioned

    # ------------------------------------------------------------- what the ranks send
    def feed(self, batches: Sequence[Batch]) -> None:
        for b in batches:
            for e in b["events"]:
                kind = e.get("kind")
                if kind == INPUT:
                    self._opened(b["rank"], e)
                elif kind == DEBUGGER and e.get("state") == "skip":
                    self.say(f"nbdist: rank {b['rank']} passed {e.get('text') or 'breakpoint()'}"
                             f" at {where(e['file'], e['line'], e['func'])}: no one can answer"
                             f" ({self.why or 'no stdin'}); it carries on, as with "
                             "PYTHONBREAKPOINT=0")
                elif kind == DEBUGGER and e.get("state") == "leave" and e.get("text"):
                    self.say(e["text"], end="")  # what the debugger printed as it left

    def _opened(self, rank: int, e: dict[str, Any]) -> None:
        if not self.open:
            self._open_since = self.clock()
        self._arrived += 1
        self.open[rank] = Prompt(rank, e["n"], e["prompt"], e.get("text", ""), e["mode"],
                                 where(e["file"], e["line"], e["func"]), self._arrived)

    def _closed(self, rank: int) -> None:
        if self.open.pop(rank, None) is not None and not self.open \
                and self._open_since is not None:
            self._paused += self.clock() - self._open_since
            self._open_since = None

    # ------------------------------------------------------------- the loop's pass
    def tick(self, running: Optional[Collection[int]] = None) -> None:
        """Ask the user for the next prompt's answer, if one is due (blocks until typed)."""
        if running is not None:
            for rank in [r for r in self.open if r not in running]:
                self._closed(rank)  # its call ended without an answer (its worker died)
        p = self.next()
        if p is None:
            return
        self._announce(p)
        if p.before:
            self.say(p.before, end="")
        line = self.ask(p.text) if self.stdin else None
        if line is None:
            self.stdin = False
        self.answer(answer_key(self.key, p.rank, p.n), json.dumps({"line": line}).encode())
        self.current, self.answered_at = p.rank, self.clock()
        self._closed(p.rank)

    def next(self) -> Optional[Prompt]:
        """The prompt to ask now: the rank answered last while it keeps prompting, else the
        oldest; None while that rank's next prompt may still be on its way."""
        if not self.open:
            return None
        if self.current in self.open:
            return self.open[self.current]
        if self.stdin and self.current is not None and \
                self.clock() - self.answered_at < STICKY_S:
            return None
        return min(self.open.values(), key=lambda p: p.order)

    def _announce(self, p: Prompt) -> None:
        if p.mode == "pdb" and p.rank != self.current:
            line = f"nbdist: rank {p.rank} is in the debugger" + (f" at {p.place}" if p.place
                                                                  else "")
            if not self._warned and self.group_timeout:
                self._warned = True
                line += (f". Ranks that wait for it in a collective give up after the process "
                         f"group's timeout ({self.group_timeout:g} s, set by "
                         "%nbdist start --timeout)")
            self.say(line)
        others = tuple(sorted(r for r in self.open if r != p.rank))
        if others and others != self._told:
            self.say(f"nbdist: {'ranks' if len(others) > 1 else 'rank'} {fmt_ranks(others)} "
                     f"also wait{'' if len(others) > 1 else 's'} for the debugger; each gets "
                     f"its turn when rank {p.rank} carries on")
        self._told = others

    def waiting(self) -> list[int]:
        """The ranks waiting for an answer now."""
        return sorted(self.open)

    def paused(self) -> float:
        """Seconds so far during which some rank waited for an answer."""
        if self._open_since is None:
            return self._paused
        return self._paused + self.clock() - self._open_since

    def close(self) -> None:
        self.open.clear()
        self._open_since = None


def for_call(m: Membership, call_id: str) -> tuple[Link, Console]:
    """The debugger's link and console for one call to the ranks."""
    key = f"nbdist/debug/{call_id}"
    lk = link(m, key)
    store = m.store
    return lk, Console(key, store.set if store is not None else (lambda _k, _v: None),
                       why=lk.why, group_timeout=m.options.timeout if m.world_size > 1 else None)


class _NoView:
    """A post-mortem shows nothing but its prompts."""

    def output(self, batches: Any) -> None:
        pass

    def refresh(self, snapshot: Callable[[], RunSnapshot], force: bool = False) -> None:
        pass

    def close(self, snap: RunSnapshot) -> None:
        pass


def failures(m: Membership) -> dict[int, dict[str, Any]]:
    """The failure each rank keeps for ``%nbdist debug`` (ranks without one are left out;
    so are workers that do not answer)."""
    job = m.submit([Call(p.worker_id, failure) for p in m.plans])
    job.wait(m.options.timeout)
    ranks = {p.worker_id: p.rank for p in m.plans}
    return {ranks[o.worker]: o.value for o in job.outcomes()
            if o.engine_error is None and o.value is not None}


def post_mortem(m: Membership, rank: Optional[int] = None, *,
                console: Optional[Console] = None) -> int:
    """``%nbdist debug [RANK]``: pdb on the frame where the last cell failed on ``rank``
    (default: the first rank that failed, not one that only lost a peer). Returns the rank."""
    m.require()
    if rank is not None:
        parse_ranks(str(rank), m.world_size)  # an OptionError for a rank the job does not have
    if m.store is None:
        raise DebuggerUnavailable(f"%nbdist debug cannot open: {NO_STORE}")
    stdin, why = stdin_state() if console is None else (True, "")
    if not stdin:
        raise DebuggerUnavailable(f"%nbdist debug cannot open: {why}. Run the notebook in "
                                  "Jupyter (or IPython) to inspect a rank")
    found = failures(m)
    if rank is None and found:
        rank = min(found, key=lambda r: (found[r]["caused_by_peer"], found[r]["communication"],
                                         found[r]["t"], r))
    if rank is None or rank not in found:
        raise NothingToDebug(rank, found)
    f = found[rank]
    _say(f"nbdist: post-mortem of rank {rank}: {f['ename']}: {f['evalue']} at "
         f"{where(f['file'], f['line'])}; q leaves the debugger")
    call_id = uuid.uuid4().hex
    key = f"nbdist/debug/{call_id}"
    console = console or Console(key, m.store.set)
    console.key = key
    calls = [Call(m.plans[rank].worker_id, rt.post_mortem, (Link(key, True),))]
    run = Run("debug", [rank], world_size=m.world_size)
    CellRun(m, calls, run, _NoView(), companions=[console]).wait(None)
    return rank
