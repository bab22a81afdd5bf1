"""How the ranks of a cell learn that their peers' calls have ended.

A rank whose cell failed waits a short grace for each peer's end mark in the job's store
before it returns: a peer still running may be waiting for it in a collective, and the failed
rank then closes its side of the group so that the collective fails at once instead of
hanging. A rank that fails always marks its own end (its peers may be waiting for it the same
way). A rank whose cell succeeded marks itself only where the notebook does not host the
store; where it does, the notebook marks a rank once its result has arrived while a peer still
runs (:class:`nbdist.cell.end_marks.EndMarks`), so the ranks of a cell that end together write
nothing to the store (a write there costs a rank's call about half a millisecond).
"""

from __future__ import annotations


def end_key(cell_id: str, rank: int) -> str:
    """The store key that says ``rank``'s call of cell ``cell_id`` has ended."""
    return f"nbdist/cell/{cell_id}/{rank}"
