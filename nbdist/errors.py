"""Errors nbdist raises in the notebook: what went wrong, on which rank and host, what to do."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

# How a rank fails when a *peer* died or closed the group under it: consequences, not causes.
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote process exited|"
    r"ProcessGroup.*(aborted|destroyed)|Broken pipe|NCCL communicator was aborted",
    re.IGNORECASE,
)


# Any failure of communication: the above, a collective timing out, or a group that is gone.
_COMM = re.compile(_PEER_LOSS.pattern + r"|gloo|nccl|timed out|process group", re.IGNORECASE)


class NbdistError(Exception):
    """Base class of every error nbdist raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of nbdist's internal frames: the message is the point."""
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


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


class NoClusterError(NbdistError):
    def __init__(self) -> None:
        super().__init__(
            "no nbdist cluster is running. Start one with `%nbdist start -n 2` "
            "(Python: `nbdist.start(2)`), or attach with `%nbdist connect`."
        )


@dataclass(frozen=True)
class RankFailure:
    """One rank's error."""

    rank: int
    hostname: str
    ename: str
    evalue: str
    traceback: str = ""
    line: Optional[int] = None

    @property
    def consequential(self) -> bool:
        """True when this rank failed only because a peer went away."""
        return bool(_PEER_LOSS.search(self.evalue))

    @property
    def communication(self) -> bool:
        """True when this rank failed in communication (a collective, the group), not in code."""
        return bool(_COMM.search(self.evalue))

    def headline(self) -> str:
        where = f" (cell line {self.line})" if self.line else ""
        return f"rank {self.rank} on {self.hostname}: {self.ename}: {self.evalue}{where}"


class DistributedError(NbdistError):
    """A ``%%distributed`` cell or ``%nbdist run`` failed on one or more ranks.

    ``failures`` holds every failing rank; ``causes`` those that did not merely lose a peer.
    """

    def __init__(self, failures: Sequence[RankFailure], what: str = "cell",
                 remedy: str = "", ) -> None:
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.what = what
        self.remedy = remedy
        super().__init__(self._summary())

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]

    @property
    def causes(self) -> list[RankFailure]:
        primary = [f for f in self.failures if not f.consequential]
        return primary or list(self.failures)

    def _summary(self) -> str:
        causes = self.causes
        ranks = ", ".join(str(f.rank) for f in causes)
        plural = "s" if len(causes) > 1 else ""
        head = causes[0]
        msg = f"{self.what} failed on rank{plural} {ranks}: {head.ename}: {head.evalue}"
        others = [f for f in self.failures if f not in causes]
        if others:
            msg += f" (rank{'s' if len(others) > 1 else ''} " \
                   f"{', '.join(str(f.rank) for f in others)} stopped because of it)"
        return msg

    def _render_traceback_(self) -> list[str]:
        """Used by IPython instead of our local frames: show the remote tracebacks."""
        lines = [f"\x1b[31m{type(self).__name__}\x1b[0m: {self._summary()}", ""]
        for f in self.causes:
            lines.append(f"\x1b[1m--- {f.headline()}\x1b[0m")
            lines.extend(f.traceback.rstrip("\n").splitlines() or [f"{f.ename}: {f.evalue}"])
            lines.append("")
        for f in self.failures:
            if f not in self.causes:
                lines.append(f"--- {f.headline()}")
        if self.remedy:
            lines += ["", self.remedy]
        return lines


class CellTimeoutError(NbdistError):
    """A cell ran past its ``--timeout``."""

    def __init__(self, timeout: float, ranks: Sequence[int], hint: str = "") -> None:
        self.ranks = list(ranks)
        super().__init__(
            f"cell ran past --timeout {timeout:g} s; rank(s) {self.ranks} were still running and "
            "were interrupted. The process group is re-formed for the next cell; re-create "
            "DistributedDataParallel wrappers made before it." + (f" {hint}" if hint else "")
        )
