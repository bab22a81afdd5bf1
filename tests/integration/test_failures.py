"""Failures a new user meets, on both engines: a worker that exits mid-cell, and what the
next cell and the remedy do."""

from __future__ import annotations

import time

import pytest
from conftest import start_session

from nbdist.errors import DistributedError, WorkersGone

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("engine", ["ipyparallel", "dask"])
def test_a_worker_that_exits_mid_cell_is_named_and_replaced_by_scale(engine):
    s = start_session(engine)
    try:
        s.run_cell("kept = 'rank %d survives' % rank")
        with pytest.raises(DistributedError) as info:
            s.run_cell("import os, time\nif rank == 1:\n    os._exit(0)\ntime.sleep(0.5)")
        assert [f.rank for f in info.value.failures] == [1]
        assert info.value.failures[0].ename == "WorkerError"
        t0 = time.monotonic()
        with pytest.raises(WorkersGone, match=r"rank\(s\) 1 .*%nbdist scale 2") as gone:
            s.run_cell("print(rank)")
        assert gone.value.ranks == [1]
        assert time.monotonic() - t0 < 10  # not the process group's 60 s timeout
        s.scale(2)  # a replacement joins; rank 0's worker keeps its namespace
        assert s.world_size == 2
        assert repr(s.run_cell("kept", ranks="0")) == "'rank 0 survives'"
        total = s.run_cell("import torch, torch.distributed as dist\n"
                           "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
        assert repr(total) == "2.0"
    finally:
        s.stop()
