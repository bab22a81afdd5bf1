"""Failures a new user meets, on both engines: a worker that exits mid-cell, and what the
next cell and the remedy do."""

from __future__ import annotations

import socket
import time

import pytest
from clusters import ENGINES, start_session

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


def test_connecting_to_an_address_with_nothing_there_fails_fast():
    from nbdist.errors import ClusterError
    from nbdist.session import Session

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"nothing answers at tcp://127\.0\.0\.1:\d+ .*"
                                           r"Scheduler at"):
        Session().connect(engine="dask", address=f"tcp://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10


@pytest.fixture(scope="module", params=ENGINES)
def cluster(request):
    s = start_session(request.param)
    yield s
    s.stop()


def test_an_ipyparallel_connection_file_that_is_not_there_fails_fast(tmp_path):
    from nbdist.errors import ClusterError
    from nbdist.session import Session

    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"could not connect to the ipyparallel cluster"):
        Session().connect(engine="ipyparallel", url_file=str(tmp_path / "missing.json"),
                          timeout=5)
    assert time.monotonic() - t0 < 10


def test_enormous_output_is_capped_with_a_notice(cluster, capsys):
    s = cluster
    s.run_cell("for i in range(200_000):\n    print('line', i)", telemetry=False)
    out, err = capsys.readouterr()
    assert "[0] line 0" in out and "[0] line 199999" not in out
    assert "output cut after 1,000,000 characters" in err
    # what reached the notebook is the budget plus "[0] " prefixes, not every line
    assert len(out) < 1_500_000  # all 200,000 lines with prefixes would be 3.1 MB


def test_pulling_what_cannot_travel_says_why(cluster):
    s = cluster
    s.run_cell("import threading, torch\nlock = threading.Lock()\n"
               "import nbdist.runtime.pulling as w\nw.MAX_PULL_BYTES = 1000\n"
               "big = torch.zeros(1000)")
    with pytest.raises(NameError, match=r"rank 0: lock \(lock\) cannot be sent .*pickle"):
        s.pull("lock")
    with pytest.raises(NameError,
                       match=r"big is 4 kB, over the 1 kB that pull sends.*torch\.save"):
        s.pull("big")
    s.run_cell("w.MAX_PULL_BYTES = 2 << 30")


@pytest.mark.parametrize("text", ["connection timed out", "Connection closed by peer"])
def test_a_users_own_timeout_or_connection_error_is_an_error_in_the_code(cluster, text):
    s = cluster
    s.run_cell("import torch, torch.distributed as dist\nkept = rank * 10")
    with pytest.raises(DistributedError) as info:
        s.run_cell(f"if rank == 1:\n    raise RuntimeError({text!r})\n"
                   "t = torch.ones(1)\ndist.all_reduce(t)")
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[1].ename == "RuntimeError" and not by_rank[1].communication
    assert not by_rank[1].caused_by_peer
    # Rank 0, left waiting in the all-reduce, is released and named as the consequence.
    assert 0 not in by_rank or by_rank[0].caused_by_peer
    assert "RuntimeError" in str(info.value).splitlines()[0]  # the headline is rank 1's
    # The namespace stays on every rank, and the next cell runs at full width.
    assert repr(s.run_cell("t = torch.ones(1)\ndist.all_reduce(t)\n(kept, t.item())")) \
        == "(0, 2.0)"
    assert repr(s.run_cell("kept", ranks="1")) == "10"
