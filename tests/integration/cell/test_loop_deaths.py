"""A rank killed in a cell without elastic training, on both engines: its row in the run's
record, the header and the raised error all say it died, of what signal, and the cell line
where it was last seen."""

from __future__ import annotations

import re
from html import escape

import pytest
from clusters import ENGINES, start_session

from nbdist.display.html import run_header
from nbdist.display.tables import run_table
from nbdist.errors import DistributedError
from nbdist.telemetry.states import RankState

pytestmark = pytest.mark.timeout(240)

# A collective first, so that the run records telemetry (and is kept as the last run); then
# rank 1 kills its own worker while rank 0 finishes the cell.
KILL = """\
import os, signal, time, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1)
"""


@pytest.mark.parametrize("engine", ENGINES)
def test_a_rank_killed_in_a_plain_cell_died_of_sigkill_in_its_row_and_its_error(engine):
    s = start_session(engine)
    try:
        s.run_cell("import os\npid = os.getpid()", output="quiet")
        pid = s.pull("pid", rank=1)
        with pytest.raises(DistributedError) as info:
            s.run_cell(KILL, output="quiet")
        # the error: rank 1 alone failed, and its line names the signal and the cell line
        # where the rank was last seen (its record is up to 50 ms old: any line up to the kill)
        [f] = info.value.failures
        assert (f.rank, f.ename) == (1, "WorkerError"), f
        assert f.evalue.startswith(f"its worker (pid {pid}) died: "), f.evalue
        died = f.evalue.split(": ", 1)[1]
        assert re.fullmatch(r"SIGKILL, last seen at (line [1-5]|the start) of "
                            r"<distributed cell 2>", died), died
        assert str(info.value) == f"cell failed on rank 1: WorkerError: {f.evalue}"
        # the last run's row and header say the same
        snap = s.last_run
        assert snap is not None
        one = next(r for r in snap.ranks if r.rank == 1)
        assert (one.state, one.error) == (RankState.DIED, died), one
        [row] = [r for r in run_table(snap).rows if r.rank == 1]
        assert row.cells[-1] == f"died: {died}", row.cells
        header = run_header(snap, final=True)
        assert "failed after" in header, header
        assert escape(f"rank 1 on {f.hostname} (pid {pid}) died: {died}") in header, header
        assert "no end-of-cell report" not in header
    finally:
        s.stop()
