"""The hang doctor for a job started outside the notebook.

Each rank of a watched job samples its own main thread as a cell's worker does
(:meth:`~nbdist.agent.rank.RankAgent.start`: the event sink's thread, once the script makes
no progress for a while), and its ``stack`` events reach the job's run with its other
events, where the cells' hang doctor judges them (:class:`~nbdist.telemetry.stall.report.
StallWatch`: which ranks wait in which collective, which never reached it). What differs is
where a rank stands: at a line of the script, not of a cell. The frames of the script are
those the rank marked as its own (the file it runs), so the verdict names that file
(``train.py:27``) instead of ``cell line 27``. Pure: snapshots in, snapshots and text out.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from ..telemetry.snapshot import RunSnapshot
from ..telemetry.stall.report import StallReport
from ..telemetry.stall.words import headline, where_lines


def script_name(v: StallReport) -> Optional[str]:
    """The file name of the script the ranks run (``train.py``), from the frames they marked
    as the script's; None where no rank stands in one (a script run with ``-c``)."""
    for w in v.ranks:
        for f in w.frames:
            if f.cell and f.file:
                return os.path.basename(f.file)
    return None


def in_script(snap: Optional[RunSnapshot]) -> Optional[RunSnapshot]:
    """``snap`` with its hang doctor's verdict placing ranks at the script's lines."""
    if snap is None or snap.stall is None or snap.stall.script is not None:
        return snap
    name = script_name(snap.stall)
    return snap if name is None else replace(snap, stall=replace(snap.stall, script=name))


def verdict(snap: Optional[RunSnapshot]) -> Optional[str]:
    """The hang doctor's verdict on a job as text (None: none now): the headline, then a
    line per rank, as the dashboard says it::

        no step or collective completed for 12 s (stall threshold 10 s): rank 0 waits in
        allreduce (seq 31, float32 [68]); rank 1 never reached it
        rank 0: waiting in allreduce (seq 31, float32 [68]) at train.py:24: loss.backward()
        rank 1: in time.sleep(300) at train.py:21; it never reached the allreduce ...
    """
    snap = in_script(snap)
    if snap is None or snap.stall is None:
        return None
    return "\n".join([headline(snap.stall), *where_lines(snap.stall)])
