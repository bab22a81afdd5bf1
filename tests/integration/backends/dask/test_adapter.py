"""The Dask engine on real Dask workers: connecting, status, interrupts, scaling, event latency."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

distributed = pytest.importorskip("distributed")

from nbdist.backends.base import Call  # noqa: E402
from nbdist.errors import (  # noqa: E402
    CellTimeoutError,
    ClusterError,
    DistributedError,
    WorkersDidNotStart,
)
from nbdist.session import Session  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def cell(session, code, **kw):
    kw.setdefault("output", "quiet")
    return session.run_cell(textwrap.dedent(code), **kw)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        tick.wait(0.05)


@pytest.fixture
def external_cluster():
    """A Dask cluster on loopback that nbdist did not start."""
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True,
                                       host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                       silence_logs=logging.WARNING)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def dask_session():
    s = Session().start(2, engine="dask", timeout=60)
    try:
        yield s
    finally:
        s.stop()


def test_connect_to_a_running_scheduler(external_cluster):
    s = Session().connect(engine="dask", address=external_cluster.scheduler_address,
                          timeout=60)
    try:
        assert not s.backend.owns_cluster
        assert s.backend.controller_ip == "127.0.0.1"
        assert s.world_size == 2
        assert external_cluster.scheduler_address in s.backend.describe()
        # Two threads per worker: calls still run one rank per process, with one namespace.
        value = cell(s, """
            import os, torch, torch.distributed as dist
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            pid = os.getpid()
            (dist.get_world_size(), t.item())
        """)
        assert repr(value) == "(2, 1.0)"
        pids = {s.pull("pid", rank=r) for r in range(2)}
        assert len(pids) == 2
        cell(s, "counter = rank")
        cell(s, "counter += 10")
        assert [s.pull("counter", rank=r) for r in range(2)] == [10, 11]
        with pytest.raises(ClusterError, match="not started by nbdist: scale it with the tool "
                           r"that started it \(dask-jobqueue.*%nbdist restart"):
            s.scale(3)
    finally:
        s.stop()
    # Disconnecting leaves someone else's cluster running.
    assert len(external_cluster.scheduler_info["workers"]) == 2


def test_connect_by_scheduler_file(external_cluster, tmp_path):
    path = tmp_path / "scheduler.json"
    with distributed.Client(external_cluster.scheduler_address, timeout=30) as c:
        c.write_scheduler_file(str(path))
    s = Session().connect(engine="dask", scheduler_file=str(path), timeout=60)
    try:
        assert repr(cell(s, "world_size")) == "2"
    finally:
        s.stop()


def test_connect_over_tls_with_dask_security(tmp_path, monkeypatch):
    from distributed.security import Security
    from IPython.core.interactiveshell import InteractiveShell

    import nbdist.session as session_mod

    sec = Security.temporary()  # a throwaway CA and certificate, as a site's TLS setup would
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       protocol="tls://", host="127.0.0.1", security=sec,
                                       dashboard_address="127.0.0.1:0",
                                       silence_logs=logging.WARNING)
    try:
        assert cluster.scheduler_address.startswith("tls://")
        # A client without the certificates is refused. In a process of its own: after a
        # refused TLS handshake, Dask's next client in the same process can hang starting its
        # IO-loop thread (seen once in CI), which is Dask's state, not what is tested here.
        refused = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom nbdist.session import Session\n"
             "from nbdist.errors import ClusterError\ntry:\n"
             f"    Session().connect(engine='dask', address={cluster.scheduler_address!r}, "
             "timeout=5)\nexcept ClusterError as e:\n    print('refused:', e)\n"
             "    sys.exit(0)\nsys.exit(1)"], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 0 and "refused:" in refused.stdout, refused.stderr[-2000:]
        s = Session().connect(engine="dask", address=cluster.scheduler_address,
                              security=sec, timeout=60)
        try:
            value = cell(s, "import torch, torch.distributed as dist\n"
                            "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
            assert repr(value) == "3.0"
        finally:
            s.stop()
        # The same through the magic, with the credentials in files as a site would have them.
        for name in ("tls_ca_file", "tls_client_cert", "tls_client_key"):
            (tmp_path / f"{name}.pem").write_text(getattr(sec, name))
        monkeypatch.setattr(session_mod, "_default", Session())
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "nbdist")
        status = shell.run_line_magic(
            "nbdist", f"connect --engine dask {cluster.scheduler_address} --timeout 60 "
            f"--tls-ca-file {tmp_path}/tls_ca_file.pem --tls-cert {tmp_path}/tls_client_cert.pem "
            f"--tls-key {tmp_path}/tls_client_key.pem")
        try:
            assert [r.rank for r in status.rows] == [0, 1] and all(r.alive for r in status.rows)
        finally:
            shell.run_line_magic("nbdist", "stop")
    finally:
        cluster.close()


def test_connect_failure_is_a_clear_cluster_error():
    with pytest.raises(ClusterError, match=r"nothing answers at tcp://127\.0\.0\.1:9 "):
        # Nothing listens on port 9 of loopback (discard service is not run here).
        Session().connect(engine="dask", address="tcp://127.0.0.1:9", timeout=3)


def test_a_failed_start_keeps_dask_s_error_and_closes_the_cluster(monkeypatch):
    import distributed.exceptions

    from nbdist.backends.dask.adapter import DaskBackend

    # what wait_for_workers raises (a plain TimeoutError before distributed 2025.10)
    WorkerStartTimeoutError = getattr(distributed.exceptions, "WorkerStartTimeoutError",
                                      TimeoutError)

    def too_slow(self, n_workers, timeout=None):
        raise WorkerStartTimeoutError(1, n_workers, timeout)

    # LocalCluster waits for its own workers, so a short timeout alone would not fail.
    monkeypatch.setattr(distributed.Client, "wait_for_workers", too_slow)
    b = DaskBackend()
    with pytest.raises(WorkersDidNotStart, match="only 2 of 2 dask workers") as info:
        b.start(2, 30)
    assert isinstance(info.value.__cause__, WorkerStartTimeoutError)
    assert b.cluster is None and b.client is None  # closed: no worker process is left


UNGUARDED = """
import nbdist
nbdist.start(2, engine="dask", timeout=60)
print("sum of ranks", nbdist.run_cell(
    "import torch, torch.distributed as d; t = torch.tensor([rank]); d.all_reduce(t); t.item()"))
nbdist.stop()
"""


def _run_script(tmp_path, text: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``text`` as a plain script in its own process group, killed whole on a timeout."""
    script = tmp_path / "train.py"
    script.write_text(text)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the script ran past {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_script_without_a_main_guard_is_told_the_cause_and_the_fix(tmp_path):
    t0 = time.monotonic()
    done = _run_script(tmp_path, UNGUARDED)
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"nbdist.errors.UnguardedScriptError: {tmp_path / 'train.py'}, "
                           "line 3, starts Dask workers at the top level"), last
    assert "import the script again" in last and 'if __name__ == "__main__":' in last
    assert "sum" not in done.stdout and "Nanny failed" not in done.stderr
    assert took < 60, took  # refused before any worker is spawned, not after a start timeout


def test_the_same_script_with_a_main_guard_runs(tmp_path):
    body = "".join(f"    {line}\n" for line in UNGUARDED.strip().splitlines()[1:])
    done = _run_script(tmp_path, f"import nbdist\nif __name__ == \"__main__\":\n{body}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sum of ranks 1" in done.stdout, done.stdout  # 0 + 1: both workers in one group


def test_status_rows_and_stable_worker_order(dask_session):
    status = dask_session.status()
    assert "LocalCluster tcp://127.0.0.1:" in status.engine
    assert [r.rank for r in status.rows] == [0, 1]
    assert all(r.alive and r.state == "idle" and r.pid for r in status.rows)
    assert len({r.pid for r in status.rows}) == 2
    assert dask_session.backend.worker_ids() == [p.worker_id for p in dask_session.plans]


def test_state_and_group_persist_in_the_worker_process(dask_session):
    cell(dask_session, """
        import os, threading, torch.distributed as dist
        first = (os.getpid(), id(dist.group.WORLD))
    """)
    for _ in range(3):  # Dask may use another thread for each task; the process is the same
        cell(dask_session, "same = first == (os.getpid(), id(dist.group.WORLD))")
        assert dask_session.pull("same", rank=1) is True


def test_timeout_interrupts_a_long_cell_and_the_next_cell_works(dask_session):
    cell(dask_session, "import time, torch, torch.distributed as dist")
    t0 = time.monotonic()
    with pytest.raises(CellTimeoutError) as info:
        cell(dask_session, """
            spins = 0
            while True:          # pure Python: an interrupt lands between two bytecodes
                spins += 1
        """, timeout=2)
    assert info.value.ranks == [0, 1]
    assert time.monotonic() - t0 < 20
    assert dask_session.pull("spins", rank=0) > 0
    value = cell(dask_session, "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert repr(value) == "2.0"


def test_scale_up_and_down_reforms_the_group(dask_session):
    cell(dask_session, "kept = rank * 100")
    dask_session.scale(3)
    assert dask_session.world_size == 3
    assert len(dask_session.backend.worker_ids()) == 3
    value = cell(dask_session, """
        import torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        (dist.get_world_size(), t.item())
    """)
    assert repr(value) == "(3, 3.0)"
    # Workers that stayed keep their namespace and rank.
    assert dask_session.pull("kept", rank=1) == 100
    dask_session.scale(1)
    assert len(dask_session.backend.worker_ids()) == 1
    assert repr(cell(dask_session, "dist.get_world_size()")) == "1"
    assert dask_session.pull("kept", rank=0) == 0
    # The retired workers' runner actors were released: the scheduler holds one, for the
    # worker that stayed.
    client = dask_session.backend.client
    wait_until(lambda: len(client.run_on_scheduler(_runner_keys)) == 1, 10,
               "the retired workers' runners to be released")


def _runner_keys(dask_scheduler=None):
    return sorted(str(k) for k in dask_scheduler.tasks if "-runner-" in str(k))


def test_calls_go_through_nbdist_s_client_when_another_is_the_default(dask_session,
                                                                      external_cluster):
    theirs = distributed.Client(external_cluster.scheduler_address, timeout=30)
    try:
        assert distributed.default_client() is theirs
        their_pids = set(theirs.run(os.getpid).values())
        dask_session.scale(3)  # the new worker's runner is made while theirs is the default
    finally:
        theirs.close()
        external_cluster.close()  # calls relayed by their scheduler would now fail
    value = cell(dask_session, """
        import os, torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        pid = os.getpid()
        t.item()
    """, timeout=60)
    assert repr(value) == "3.0"
    pids = {dask_session.pull("pid", rank=r) for r in range(3)}
    assert len(pids) == 3 and not pids & their_pids


def test_an_error_in_a_worker_call_comes_back_with_its_traceback(dask_session):
    def failing_call():
        raise ValueError("no such thing")

    backend = dask_session.backend
    [w, _] = backend.worker_ids()
    job = backend.submit([Call(w, failing_call)])
    assert job.wait(60)
    [outcome] = job.outcomes()
    assert outcome.engine_error.startswith("ValueError: no such thing")
    assert "failing_call" in outcome.engine_error  # the traceback names where it was raised
    assert repr(cell(dask_session, "rank")) == "0"  # and the worker carries on


def test_events_arrive_while_the_cell_runs(dask_session):
    backend = dask_session.backend
    plan = dask_session.plans[0]
    sent = {}

    def emitter(seconds: float) -> float:
        from nbdist.runtime import worker as rt
        from nbdist.telemetry.events import stream

        rt.current().sink.emit(stream("stdout", "ping\n"))
        t = time.time()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:  # stay busy, so only streaming can deliver it
            pass
        return t

    job = backend.submit([Call(plan.worker_id, emitter, (5.0,))])
    got = []
    t_seen = None
    deadline = time.monotonic() + 4
    tick = threading.Event()
    while time.monotonic() < deadline and t_seen is None:
        for b in job.drain_events():
            got.append(b)
            t_seen = time.time()
        tick.wait(0.005)
    assert job.wait(30)
    [outcome] = job.outcomes()
    sent["t"] = outcome.value
    assert t_seen is not None, "no event arrived while the call was still running"
    assert any(e.get("text") == "ping\n" for b in got for e in b["events"])
    # The sink flushes every 0.1 s; the rest is Dask's event path.
    assert t_seen - sent["t"] < 1.0


def test_a_worker_that_dies_is_reported_and_restart_recovers(dask_session):
    cell(dask_session, "import os, torch, torch.distributed as dist")
    with pytest.raises(DistributedError) as info:
        cell(dask_session, """
            t = torch.ones(1)
            if rank == 1:
                os._exit(3)       # the process is gone, mid-cell
            dist.all_reduce(t)
        """, timeout=60)
    causes = {f.rank: f for f in info.value.failures}
    # the rank's line names the death as the engine saw it end: the exit status it chose
    assert causes[1].ename == "WorkerError" and "died: exit status 3" in causes[1].evalue
    dask_session.restart()
    value = cell(dask_session, """
        import torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        t.item()
    """)
    assert repr(value) == "2.0"
