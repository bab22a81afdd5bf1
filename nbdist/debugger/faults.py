"""Faults on purpose, for demos and tests: ``%nbdist kill RANK`` and ``%nbdist hang RANK``.

A kill is delivered from outside the rank's worker process, by the engine (ipyparallel's nanny
beside each engine, Dask's nanny beside each worker), so the rank meets it as it meets a real
one: the process is gone, whatever it was doing. Now, or ``after`` seconds into the next cell
(:class:`KillTimer`, a companion of the cell loop: the kernel runs one cell at a time, so that
is how a kill reaches a cell that runs). A hang is armed on the rank's worker
(:mod:`nbdist.runtime.faults`): it holds there at its next collective.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from ..backends.base import Call, signal_text
from ..errors import OptionError
from ..options import parse_ranks
from ..runtime.faults import arm

if TYPE_CHECKING:
    from ..group.membership import Membership


def signal_number(name: str) -> int:
    """``"SIGKILL"``, ``"KILL"``, ``"kill"`` or ``"9"`` -> 9."""
    text = str(name).strip()
    if text.isdigit():
        number = int(text)
    else:
        upper = text.upper()
        found = getattr(signal.Signals, upper if upper.startswith("SIG") else f"SIG{upper}",
                        None)
        if found is None:
            raise OptionError(f"no signal named {name!r}: use a name such as SIGKILL, SIGTERM "
                              "or SIGINT, or a number")
        number = int(found)
    if number not in {int(s) for s in signal.Signals}:
        raise OptionError(f"no signal numbered {number} on this system")
    return number


def _rank(m: Membership, rank: int) -> Any:
    parse_ranks(str(rank), m.world_size)  # an OptionError for a rank the job does not have
    return m.plans[rank]


def deliver(m: Membership, rank: int, signum: int) -> str:
    """Send ``signum`` to ``rank``'s worker process through the engine; returns what was done,
    in words. The job checks its workers before the next call."""
    plan = _rank(m, rank)
    info = m.infos.get(plan.worker_id) or {}
    m.require().signal(plan.worker_id, signum, info.get("pid"))
    m.distrust([plan.worker_id])
    return (f"sent {signal_text(signum)} to rank {rank} (pid {info.get('pid', '?')} on "
            f"{info.get('hostname', plan.hostname)})")


class Kill(NamedTuple):
    rank: int
    signum: int
    after: float


class KillTimer:
    """A companion of the cell loop (:class:`~nbdist.cell.loop.Companion`) that delivers a
    kill ``kill.after`` seconds into the cell."""

    def __init__(self, m: Membership, kill: Kill, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.m, self.kill, self.say, self.clock = m, kill, say, clock
        self.due = clock() + kill.after
        self.done = False

    def feed(self, batches: Sequence[Any]) -> None:
        pass

    def tick(self, running: Collection[int]) -> None:
        if not self.done and self.clock() >= self.due:
            self.done = True
            self.say(f"nbdist: {deliver(self.m, self.kill.rank, self.kill.signum)} "
                     f"({self.kill.after:g} s into the cell, %nbdist kill)")

    def paused(self) -> float:
        return 0.0

    def close(self) -> None:
        if not self.done:
            self.say(f"nbdist: the cell ended before rank {self.kill.rank}'s "
                     f"{signal_text(self.kill.signum)} was due ({self.kill.after:g} s in); "
                     "nothing was sent")


class Faults:
    """The faults a session was asked for: kills due in its next cell."""

    def __init__(self) -> None:
        self.pending: list[Kill] = []

    def kill(self, m: Membership, rank: int, sig: str = "SIGKILL",
             after: Optional[float] = None) -> str:
        """``%nbdist kill RANK [--signal NAME] [--after S]``; returns what it did, in words."""
        m.require()
        _rank(m, rank)
        signum = signal_number(sig)
        if after is None:
            return deliver(m, rank, signum)
        if after < 0:
            raise OptionError(f"--after must be 0 or more seconds, not {after:g}")
        self.pending.append(Kill(rank, signum, float(after)))
        return (f"rank {rank} gets {signal_text(signum)} {after:g} s into the next "
                "%%distributed cell")

    def hang(self, m: Membership, rank: int, seconds: float) -> str:
        """``%nbdist hang RANK [--seconds S]``; returns what it did, in words."""
        m.require()
        if not seconds > 0:
            raise OptionError(f"--seconds must be more than 0, not {seconds:g}")
        plan = _rank(m, rank)
        m.call([Call(plan.worker_id, arm, (seconds,))], m.options.timeout,
               f"arm a hang on rank {rank}")
        return f"rank {rank} holds at its next collective for {seconds:g} s"

    def for_call(self, m: Membership) -> list[KillTimer]:
        """The kills due in the call that starts now (each is for one call only)."""
        timers = [KillTimer(m, k) for k in self.pending]
        self.pending.clear()
        return timers
