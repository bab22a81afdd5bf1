"""The session's verbs of the debugger and of faults on purpose (``%nbdist debug``,
``%nbdist kill``, ``%nbdist hang``), one thin method each into their rooms,
:mod:`nbdist.debugger.console` and :mod:`nbdist.debugger.faults`; and what a cell's call takes
from them."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

from ..options import parse_ranks
from ..runtime.debugger import Link
from .console import for_call, post_mortem
from .faults import Faults

if TYPE_CHECKING:
    from ..group.membership import Membership


class DebugVerbs:
    """Mixed into :class:`~nbdist.session.Session`, which has ``membership`` and
    ``world_size``."""

    membership: Membership
    world_size: int

    @functools.cached_property
    def faults(self) -> Faults:
        """Faults asked for on purpose (``%nbdist kill --after``), due in the next cell."""
        return Faults()

    def _beside(self, m: Membership, cell_id: str) -> tuple[Link, list[Any]]:
        """How a cell's ranks reach the notebook's stdin (``breakpoint()``, ``input()``), and
        the companions of its loop: the debugger's console, faults due in it."""
        link, console = for_call(m, cell_id)
        return link, [console, *self.faults.for_call(m)]

    def debug(self, rank: Optional[int] = None) -> int:
        """Post-mortem pdb on the frame where the last cell failed on ``rank`` (default: the
        first rank that failed), answered in the notebook (``%nbdist debug``); returns the
        rank. See ``docs/debugging.md``."""
        self.membership.require()
        if rank is not None:
            parse_ranks(str(rank), self.world_size)
        return post_mortem(self.membership, rank)

    def kill(self, rank: int, signal: str = "SIGKILL", *, after: Optional[float] = None) -> str:
        """Send ``signal`` to ``rank``'s worker process from outside it, now or ``after``
        seconds into the next cell (``%nbdist kill``); returns what it did, in words."""
        return self.faults.kill(self.membership, rank, signal, after)

    def hang(self, rank: int, seconds: float = 60.0) -> str:
        """Make ``rank`` hold for ``seconds`` at its next collective (``%nbdist hang``);
        returns what it did, in words."""
        return self.faults.hang(self.membership, rank, seconds)
