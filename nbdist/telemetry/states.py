"""The states a rank goes through in a run, as the notebook sees them. A leaf module."""

from __future__ import annotations

from enum import Enum


class RankState(str, Enum):
    """Where one rank of a run stands. A ``str`` enum: ``RankState.DONE == "done"``.

    WAITING
        Selected for the run; nothing heard from it yet.
    RUNNING
        It has sent telemetry or output and has not finished.
    DONE
        It finished the cell (or script) without error.
    FAILED
        It finished with an error; the snapshot carries the reason.
    STOPPED
        The run ended without an end-of-cell report from it: interrupted, timed out, or its
        worker died.
    DIED
        Its worker is gone, as elastic training's coordinator found it (the snapshot carries
        the cause, e.g. ``SIGKILL``); a replacement worker, if one joins, is a row of its own.
    """

    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"
    DIED = "died"

    def __str__(self) -> str:
        return self.value

    @property
    def active(self) -> bool:
        """Not finished yet (waiting or running)."""
        return self in (RankState.WAITING, RankState.RUNNING)

    @property
    def broken(self) -> bool:
        """Ended badly (failed, stopped or died): drawn in the failure colour."""
        return self in (RankState.FAILED, RankState.STOPPED, RankState.DIED)
