"""Ranks after ``%nbdist scale``, the same on both engines: the highest ranks leave, workers
that stay keep their ranks, a new worker takes the rank of a worker that left and then the
next rank; and the group formed on them works."""

from __future__ import annotations

import pytest
from clusters import ENGINES, start_session

from nbdist.errors import DistributedError

pytestmark = pytest.mark.timeout(300)


def pids(session) -> list[int]:
    """Each rank's worker process, in rank order, as the ranks themselves report it."""
    session.run_cell("import os\n_pid = os.getpid()", output="quiet")
    return [session.pull("_pid", rank=r) for r in range(session.world_size)]


def group_sum(session) -> float:
    return float(repr(session.run_cell(
        "import torch, torch.distributed as dist\n"
        "t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nt.item()", output="quiet")))


@pytest.mark.parametrize("engine", ENGINES)
def test_after_a_scale_workers_keep_their_ranks_and_new_ones_fill_the_gaps(engine):
    s = start_session(engine, n=3)
    try:
        p0, p1, p2 = pids(s)
        s.scale(4)  # grow: the three keep their ranks, the new worker is rank 3
        grown = pids(s)
        assert grown[:3] == [p0, p1, p2] and grown[3] not in (p0, p1, p2)
        s.scale(3)  # shrink: the highest rank leaves
        assert pids(s) == [p0, p1, p2]
        # rank 1's worker exits; where the engine restarts it (a Dask nanny), the new process
        # is a new worker all the same
        with pytest.raises(DistributedError):
            s.run_cell("import os, time\nif rank == 1:\n    os._exit(0)\ntime.sleep(0.5)",
                       output="quiet")
        s.scale(3)  # the new worker takes rank 1: ranks 0 and 2 keep theirs
        after = pids(s)
        assert [after[0], after[2]] == [p0, p2], "the workers that stayed lost their ranks"
        assert after[1] not in (p0, p1, p2)
        assert group_sum(s) == 0 + 1 + 2
        s.scale(2)  # the highest rank leaves
        assert pids(s) == after[:2]
        assert group_sum(s) == 1
    finally:
        s.stop()
