"""The hang doctor on both engines: rank 1 never reaches the all-reduce rank 0 waits in.

The live verdict, the error of ``--timeout`` and the error of an interrupt all name rank 1 in
``time.sleep`` at cell line 5 and rank 0 in ``dist.all_reduce`` at line 6, on real workers
with a real gloo group (and torch's Flight Recorder on).
"""

from __future__ import annotations

import _thread
import threading
import time

import pytest

from nbdist.backends.base import poll_until
from nbdist.display.text import TextDashboard
from nbdist.errors import CellInterrupted, CellTimeoutError

pytestmark = pytest.mark.timeout(180)

# Short sleeps: on Dask the interrupt is raised in the cell's thread, where it lands between
# two bytecodes (a rank in one long sleep is restarted instead: the last test).
CELL = """\
import time, torch, torch.distributed as dist
t = torch.ones(4)
if rank == 1:
    for _ in range(1200):
        time.sleep(0.05)
dist.all_reduce(t)
"""
SLEEPING = "rank 1: in time.sleep(0.05) at cell line 5"
WAITING = "rank 0: waiting in all_reduce (seq "
AT_LINE_6 = "at cell line 6: dist.all_reduce(t)"


@pytest.fixture
def session(cluster):
    """The module's 2-worker cluster (tests/conftest.py), for each engine."""
    return cluster


def _group_works(session) -> None:
    value = session.run_cell("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
    assert repr(value) == "3.0"


def test_timeout_says_where_each_rank_was(session):
    t0 = time.monotonic()
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell(CELL, timeout=4)
    assert time.monotonic() - t0 < 25  # not the group's 60 s collective timeout
    text = str(info.value)
    assert SLEEPING in text
    assert WAITING in text and AT_LINE_6 in text
    assert "Rank 1 never reached the all_reduce" in text and "that rank 0 waits in" in text
    where = info.value.where
    assert where.missing == (1,) and [ranks for _, ranks in where.waits] == [(0,)]
    assert {w.reason for w in where.ranks} == {"interrupt"}  # taken before it unwound
    # the Flight Recorder named the collective: the group's sequence number, the tensor
    assert where.rank(0).collective.group == "default_pg"
    assert where.rank(0).collective.size == "float32 [4]"
    _group_works(session)


def test_a_stall_is_shown_live_and_an_interrupt_says_where(session, monkeypatch, capsys):
    pids = [row.pid for row in session.status().rows]
    seen: list = []  # (seconds since the cell was sent, snapshot) per dashboard redraw
    update = TextDashboard.update

    def recording(self, snap):
        seen.append((time.monotonic() - started, snap))
        update(self, snap)

    monkeypatch.setattr(TextDashboard, "update", recording)
    monkeypatch.setenv("NBDIST_DISPLAY", "text")

    def named() -> bool:
        return any(s.stall is not None and s.stall.missing == (1,) for _, s in seen)

    listening: list = []

    def press_stop_when_stalled() -> None:
        poll_until(named, 30)
        listening.extend(_listening(pids))  # while the Flight Recorder and sampler are busy
        _thread.interrupt_main()  # what the kernel's stop button does in the notebook

    helper = threading.Thread(target=press_stop_when_stalled, daemon=True)
    started = time.monotonic()
    helper.start()
    with pytest.raises(KeyboardInterrupt) as info:
        session.run_cell(CELL, stall_after=1)
    helper.join(10)

    # the live verdict came once the 1 s threshold had passed, and soon after it
    when, snap = next((t, s) for t, s in seen if s.stall is not None and s.stall.missing)
    assert 1.0 <= when < 10, when
    v = snap.stall
    assert v.threshold_s == 1.0 and v.hang
    assert v.rank(0).status == "waiting" and v.rank(0).collective.op == "all_reduce"
    assert v.rank(0).line == 6 and v.rank(0).doing.endswith("distributed_c10d.all_reduce")
    assert v.rank(1).status == "elsewhere" and v.rank(1).doing == "time.sleep(0.05)"
    assert v.rank(1).line == 5
    out = capsys.readouterr().out
    assert "nbdist: hang doctor: no step or collective completed" in out
    assert "rank 0 waits in all_reduce" in out and "rank 1 never reached it" in out
    assert SLEEPING in out

    # the interrupt's error: a KeyboardInterrupt that says where each rank was
    assert isinstance(info.value, CellInterrupted)
    text = str(info.value)
    assert SLEEPING in text and WAITING in text and AT_LINE_6 in text
    assert "Rank 1 never reached the all_reduce" in text

    # nothing the hang doctor turned on listens beyond loopback
    assert listening and all(ip == "127.0.0.1" for _, ip in listening), listening
    _group_works(session)


def _listening(pids: list[int]) -> list[tuple[int, str]]:
    import psutil

    return [(pid, c.laddr.ip) for pid in pids
            for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_a_rank_blocked_in_one_long_call_is_stopped_and_the_next_cell_does_not_wait(session):
    """``time.sleep(600)``: ipyparallel's SIGINT ends the sleep; in a Dask worker's thread no
    interrupt reaches it, so its process is restarted and the error says what was lost."""
    session.run_cell("kept = rank * 10\nimport numpy", output="quiet")
    engine = session.backend.name
    t0 = time.monotonic()
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("import time\nif rank == 1:\n    time.sleep(600)\n", timeout=3)
    stopped = time.monotonic() - t0
    text = str(info.value)
    assert "rank 1: in time.sleep(600) at cell line 3" in text  # taken before it was stopped
    if engine == "dask":
        r = info.value.restarted
        assert r is not None and r.ranks == (1,) and not r.removed and not r.not_reformed
        assert "Rank 1's namespace is lost (it held: " in text
        assert "kept" in r.names[1] and "numpy" not in r.names[1]  # names, not modules
        assert "The other ranks keep their namespaces" in text
    else:
        assert info.value.restarted is None
    assert stopped < 60, stopped
    t0 = time.monotonic()
    value = session.run_cell("import torch, torch.distributed as dist\n"
                             "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
                             "(t.item(), 'kept' in globals())")
    assert time.monotonic() - t0 < 20  # not the group's timeout waiting for an old cell
    assert repr(value) == "(3.0, True)"  # rank 0 kept its namespace on both engines
    kept_on_1 = session.run_cell("'kept' in globals()", ranks="1")
    assert repr(kept_on_1) == ("False" if engine == "dask" else "True")
