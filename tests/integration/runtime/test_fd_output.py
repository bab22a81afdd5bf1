"""On both engines: what a rank writes to its file descriptors (``os.system``,
``subprocess.run``, ``os.write``, a C call) reaches the notebook prefixed by rank under the cell
that wrote it, as prints do; and a rank that dies is named with its signal or exit status, the
cell line and its last lines on stderr (gloo's own abort, as torchrun reports it: -6, SIGABRT).
"""

from __future__ import annotations

import os
import textwrap

import pytest
from clusters import ENGINES, start_session

from nbdist.backends.base import poll_until
from nbdist.display.tables import run_table
from nbdist.errors import DistributedError
from nbdist.group import losses
from nbdist.runtime import fd_output

pytestmark = pytest.mark.timeout(300)

WRITES = """\
import ctypes, os, subprocess
print("print before", rank)
os.system(f"echo system {rank}")
subprocess.run(["sh", "-c", f"echo subprocess {rank} >&2"], check=True)
os.write(2, f"fdwrite {rank}\\n".encode())
msg = f"libc {rank}\\n".encode()
ctypes.CDLL(None).write(2, msg, len(msg))
print("print after", rank)
"""


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param)
    yield s
    s.stop()


def run(session, code, **kw):
    return session.run_cell(textwrap.dedent(code), **kw)


def test_fd_output_reaches_the_cell_prefixed_by_rank_in_order(session, capsys):
    run(session, WRITES, output="all")
    out, err = capsys.readouterr()
    for r in (0, 1):
        assert f"[{r}] subprocess {r}" in err and f"[{r}] fdwrite {r}" in err
        assert f"[{r}] libc {r}" in err
        assert (out.index(f"[{r}] print before {r}") < out.index(f"[{r}] system {r}")
                < out.index(f"[{r}] print after {r}")), out
    # the next cell shows nothing of it
    run(session, "x = 1", output="all")
    out, err = capsys.readouterr()
    assert "system" not in out and "fdwrite" not in err


def test_fd_output_honours_rank0_and_ranks_as_prints_do(session, capsys):
    run(session, "import os\nos.system(f'echo only {rank}')", output="rank0")
    out, _ = capsys.readouterr()
    assert "[0] only 0" in out and "only 1" not in out
    run(session, "import os\nos.system(f'echo picked {rank}')", output="all", ranks="1")
    out, _ = capsys.readouterr()
    assert "[1] picked 1" in out and "picked 0" not in out


def test_a_child_writing_between_cells_shows_in_the_next_cell(session, capsys, tmp_path):
    go = tmp_path / "go"
    run(session, f"""
        import os, subprocess
        pid = os.getpid()
        child = subprocess.Popen(["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done; "
                                              f"echo between {{rank}}"])
    """, output="all")
    out, _ = capsys.readouterr()
    assert "between" not in out
    pid = session.pull("pid", rank=0)
    go.touch()
    # the child writes after its cell ended: wait until rank 0's file has it
    path = fd_output.paths(pid)["stdout"]
    assert poll_until(lambda: os.path.exists(path) and b"between" in open(path, "rb").read(),
                      30), path
    run(session, "child.wait()", output="all")
    out, _ = capsys.readouterr()
    assert "[0] between 0" in out


# torchrun reports these deaths as exit code -6 (gloo's abort), -9 and 3. SIGKILL comes from
# outside the cell's thread (as the out-of-memory killer's or a kill's does) while it sleeps.
# Each cell's first line is a collective, so that the run is recorded for the dashboard.
FIRST = "import torch, torch.distributed as dist; dist.barrier()\n"
DEATHS = [
    (FIRST + "x = torch.ones(3 if rank == 0 else 5)\n"
     "dist.all_reduce(x)\n", 0, "SIGABRT at line 3 of <distributed cell 2>"),
    (FIRST + "import os, threading, time\nif rank == 1:\n    os.write(2, b'going\\n')\n"
     "    threading.Timer(1, os.kill, (os.getpid(), 9)).start()\ntime.sleep(5)\n", 1,
     "SIGKILL, last seen at line 6 of <distributed cell 2>"),
    (FIRST + "import os\nif rank == 1:\n    os.write(2, b'leaving now\\n')\n    os._exit(3)\n"
     "import time; time.sleep(1)\n", 1, "exit status 3 at line 5 of <distributed cell 2>"),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("code, dead, cause", DEATHS, ids=["abort", "sigkill", "exit"])
def test_a_death_is_named_with_its_signal_cell_line_and_stderr_tail(engine, code, dead,
                                                                    cause, capsys):
    s = start_session(engine)
    try:
        s.run_cell("import os\npid = os.getpid()", output="quiet")
        pid = s.pull("pid", rank=dead)
        with pytest.raises(DistributedError) as info:
            s.run_cell(code, output="quiet", timeout=120)
        [f] = [f for f in info.value.failures if f.rank == dead]
        assert f.ename == "WorkerError"
        assert f.evalue == f"its worker (pid {pid}) died: {cause}", f.evalue
        # the run's record and the rank's row on the dashboard say it in the same words
        out, _ = capsys.readouterr()
        assert f"rank {dead} on {f.hostname} (pid {pid}) died: {cause}" in out, out
        table = run_table(s.last_run)
        [state] = [r.cells[-1] for r in table.rows if r.cells[0] == str(dead)]
        assert state == f"died: {cause}", table
        # and so does %nbdist status, on the dead rank's row
        [row] = [r for r in s.status().rows if r.rank == dead]
        assert not row.alive and row.state == f"died: {cause}", row
        if cause.startswith("SIGABRT"):
            assert "Received data size doesn't match" in f.traceback, f.traceback
            assert f.traceback.startswith("its last lines on stderr:\n")
        elif cause.startswith("SIGKILL"):  # no stack to dump: the line last seen
            assert "    going\n" in f.traceback
        else:
            assert "    leaving now\n" in f.traceback
        # the notebook read the dead rank's files, and removed them
        assert not any(os.path.exists(p) for p in fd_output.paths(pid).values())
    finally:
        s.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_death_on_another_host_is_read_there_or_where_it_is_kept_is_named(engine,
                                                                           monkeypatch):
    s = start_session(engine)
    try:
        s.run_cell("import os\npid = os.getpid()", output="quiet")
        pid = s.pull("pid", rank=1)
        code, _, seen = DEATHS[1]
        with monkeypatch.context() as far:  # the notebook takes rank 1's host for another
            far.setattr(losses, "_here", lambda host: False)
            with pytest.raises(DistributedError) as info:
                s.run_cell(code, output="quiet", timeout=120)
        [f] = [f for f in info.value.failures if f.rank == 1]
        files = fd_output.paths(pid)
        if engine == "dask":  # a nanny on its host read what it left there, and removed it
            assert f.evalue == f"its worker (pid {pid}) died: {seen}", f.evalue
            assert "    going\n" in f.traceback, f.traceback
            assert not any(os.path.exists(p) for p in files.values())
        else:  # ipyparallel runs nothing on a dead engine's host: where its stderr is
            assert f.evalue == f"its worker (pid {pid}) died: SIGKILL", f.evalue
            assert f.traceback.startswith(
                f"its stderr is kept in {f.hostname}:{files['stderr']}\n"), f.traceback
            assert os.path.exists(files["stderr"])
        s.stop()
        # %nbdist stop removes what dead ranks left on the notebook's host
        assert not any(os.path.exists(p) for p in files.values())
    finally:
        s.stop()
