"""The Session, its membership and its cell loop on a scripted in-memory backend: error
shaping, timeouts, group generations and the event grace period, in milliseconds."""

from __future__ import annotations

import time

import pytest
from fakes import Scripted, ScriptedBackend, failed, ok

from nbdist.backends.base import Outcome
from nbdist.cell import interrupt as escalation
from nbdist.cell import loop as cell_run
from nbdist.errors import (
    REBUILD_DDP,
    CellTimeoutError,
    ClusterError,
    DistributedError,
    InterruptTimeoutError,
    NoClusterError,
    OptionError,
    WorkerCallFailed,
    WorkersGone,
)
from nbdist.runtime import results
from nbdist.session import Session
from nbdist.telemetry import events as ev

T0 = 1_700_000_000.0


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(2)


@pytest.fixture
def session(backend) -> Session:
    s = Session(backends=lambda engine: backend, stores=None).start(2, engine="ipyparallel",
                                                                    timeout=5)
    assert backend.calls == ["describe", "describe", "set_transport", "set_transport",
                             "open_store", "join", "join"]
    return s


def step(rank: int, n: int, seq: int) -> dict:
    return {"rank": rank, "seq": seq, "events": [
        ev.step(n, T0 + n, T0 + n + 0.1, samples=8, comm_total_s=0.02, comm_exposed_s=0.01),
        ev.end(True, T0 + n + 0.2)]}


def test_start_forms_the_job_and_returns_rank0s_value(session, backend):
    assert session.world_size == 2 and session.generation == 1
    assert [p.worker_id for p in session.plans] == backend.ids
    backend.script(r0=Scripted(ok({"text/plain": "42"})), r1=Scripted(ok({"text/plain": "7"})))
    value = session.run_cell("x")
    assert value is not None and value.rank == 0 and repr(value) == "42"


def test_code_error_on_one_rank_and_peer_loss_on_the_other(session, backend):
    backend.script(
        r0=Scripted(failed("RuntimeError", "Connection closed by peer", communication=True,
                           caused_by_peer=True, group_alive=False)),
        r1=Scripted(failed("ZeroDivisionError", "division by zero", line=3)))
    gen = session.generation
    with pytest.raises(DistributedError) as info:
        session.run_cell("1/0")
    err = info.value
    assert err.ranks == [0, 1]
    assert [f.rank for f in err.causes] == [1]  # rank 0 only lost its peer
    assert "rank 0 stopped because of it" in str(err)
    assert err.failures[1].line == 3 and err.failures[1].hostname == "hostA"
    assert REBUILD_DDP in err.remedy  # rank 0's group is gone: the next cell re-forms it
    assert session.generation == gen + 1


def test_code_error_with_group_intact_does_not_reform(session, backend):
    backend.script(r1=Scripted(failed("ValueError", "bad")))
    gen = session.generation
    with pytest.raises(DistributedError) as info:
        session.run_cell("raise ValueError('bad')")
    assert info.value.remedy == "" and session.generation == gen


def test_partial_rank_hint_only_for_communication_failures(session, backend):
    backend.script(r1=Scripted(failed("RuntimeError", "[gloo] Timed out", communication=True)))
    with pytest.raises(DistributedError) as info:
        session.run_cell("dist.barrier()", ranks="1")
    assert "collectives need every rank" in info.value.remedy
    backend.script(r1=Scripted(failed("NameError", "name 'x' is not defined")))
    with pytest.raises(DistributedError) as info:
        session.run_cell("x", ranks="1")
    assert "collectives" not in info.value.remedy


def test_timeout_interrupts_the_late_ranks_and_bumps_the_generation(session, backend):
    backend.script(r1=Scripted(hang=True))
    gen = session.generation
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("while True: pass", timeout=0.2)
    assert info.value.ranks == [1]
    assert backend.ids[1] in backend.interrupted and backend.ids[0] not in backend.interrupted
    assert session.generation == gen + 1
    assert "DistributedDataParallel" in str(info.value)


def test_a_rank_that_ignores_the_interrupt_is_named(session, backend, monkeypatch):
    monkeypatch.setattr(escalation, "STOP_GRACE", 0.05)
    backend.script(r0=Scripted(hang=True, ignores_interrupt=True))
    with pytest.raises(InterruptTimeoutError, match=r"rank\(s\) \[0\] did not stop.*restart"):
        session.run_cell("stuck()", timeout=0.1)


def test_engine_error_on_one_worker_is_a_worker_error(session, backend):
    backend.script(r1=Scripted(engine_error="EngineError: Engine 101 died\ntraceback..."))
    gen = session.generation
    with pytest.raises(DistributedError) as info:
        session.run_cell("import os; os._exit(1)")
    [f] = info.value.failures
    assert f.rank == 1 and f.ename == "WorkerError" and "Engine 101 died" in f.evalue
    assert not f.communication and session.generation == gen + 1


def test_last_batch_arriving_after_the_outcome_is_waited_for(session, backend):
    backend.script(r0=Scripted(ok(seq=2), batches=[step(0, 0, 1)], late=[step(0, 1, 2)]),
                   r1=Scripted(ok(seq=1), batches=[step(1, 0, 1)]))
    session.run_cell("train()")
    snap = session.last_run
    assert snap is not None
    assert [r.steps for r in snap.ranks] == [2, 1]  # rank 0's late step was not lost
    assert backend.jobs[-1].drains_after_done >= 3


def test_the_last_batch_a_result_carries_is_folded_after_the_batches_sent_before_it(
        session, backend):
    # rank 0 sent batch 1 (arriving late) and carries batch 2; rank 1 sent nothing
    tail0 = dict(step(0, 1, 2), seq=2)
    tail1 = dict(step(1, 0, 1), seq=1)
    backend.script(r0=Scripted(results.finish(results.cell_ok(), seconds=0.01,
                                              group_alive=True, seq=1, tail=tail0),
                               late=[step(0, 0, 1)]),
                   r1=Scripted(results.finish(results.cell_ok(), seconds=0.01,
                                              group_alive=True, seq=0, tail=tail1)))
    session.run_cell("train()")
    events = session.runs[-1].events()
    assert [e["step"] for e in events[0] if e["kind"] == "step"] == [0, 1]  # in order
    assert [e["step"] for e in events[1] if e["kind"] == "step"] == [0]
    assert backend.jobs[-1].drains_after_done >= 3  # waited for rank 0's batch 1


def test_a_result_that_carries_its_only_batch_waits_for_nothing(session, backend, monkeypatch):
    monkeypatch.setattr(cell_run, "_EVENT_GRACE", 30.0)
    backend.script(r0=Scripted(results.finish(results.cell_ok(), seconds=0.01,
                                              group_alive=True, seq=0,
                                              tail=dict(step(0, 0, 1), seq=1))))
    t0 = time.monotonic()
    session.run_cell("train()")
    # no poll for a batch on the channel (the grace would be 30 s); the carried one is folded
    assert time.monotonic() - t0 < 5 and session.last_run.ranks[0].steps == 1


def test_missing_batches_give_up_after_the_grace_period(session, backend, monkeypatch):
    monkeypatch.setattr(cell_run, "_EVENT_GRACE", 0.05)
    backend.script(r0=Scripted(ok(seq=5), batches=[step(0, 0, 1)]))  # batches 2-5 never come
    session.run_cell("train()")
    assert session.last_run.ranks[0].steps == 1


def test_runs_keep_only_what_recorded_telemetry(session, backend):
    session.run_cell("x = 1")
    assert len(session.runs) == 0
    backend.script(r0=Scripted(ok(seq=1), batches=[step(0, 0, 1)]))
    session.run_cell("train()")
    assert len(session.runs) == 1 and session.runs[-1].what == "cell"
    assert "Run cell on ranks [0, 1], finished" in repr(session.runs[-1])


def test_usage_errors_are_option_errors(session):
    with pytest.raises(OptionError, match="out of range"):
        session.run_cell("x", ranks="5")
    with pytest.raises(OptionError, match="at least 1"):
        session.scale(0)
    with pytest.raises(ValueError):  # an OptionError is a ValueError for Python callers
        session.run_cell("x", timeout=-1)


def test_no_cluster_and_status(backend):
    s = Session(backends=lambda engine: backend, stores=None)
    with pytest.raises(NoClusterError, match="nbdist start"):
        s.run_cell("x")
    assert "not running" in s._repr_html_()
    s.start(2)
    status = s.status()
    assert status.alive == 2 and [r.rank for r in status.rows] == [0, 1]
    assert "hostA" in s._repr_html_()
    assert s.stop() == "stopped 2 workers of scripted"
    assert not s.running and s.stop() is None


def test_stopping_a_connected_cluster_says_its_workers_keep_running(backend):
    s = Session(backends=lambda engine: backend, stores=None).connect(profile="x")
    assert s.stop() == "disconnected from scripted; its 2 workers keep running"


def test_cells_are_named_and_numbered_as_the_editor_shows_them(session, backend):
    backend.script(r1=Scripted(failed("ValueError", "bad", line=3)))
    with pytest.raises(DistributedError) as info:
        session.run_cell("x = 1\nraise ValueError('bad')", first_line=2, execution_count=12)
    [call] = [c for c in backend.submitted if c.fn.__name__ == "run_cell"][-1:]
    code, filename = call.args[:2]
    assert filename == "<distributed cell [12]>"
    # the magic's line is the editor's line 1: the code's first line is compiled as line 2
    assert code.splitlines()[1] == "x = 1" and code.splitlines()[0] == ""
    assert "rank 1 on hostA: ValueError: bad (In [12], line 3)" in \
        "\n".join(info.value._render_traceback_())
    with pytest.raises(SyntaxError) as syntax:
        session.run_cell("x = 1\ny = (", first_line=2, execution_count=13)
    assert syntax.value.lineno == 3 and syntax.value.filename == "<distributed cell [13]>"
    # from Python there is no magic line and no execution count
    session.run_cell("x = 1")
    call = [c for c in backend.submitted if c.fn.__name__ == "run_cell"][-1]
    assert call.args[0] == "x = 1" and call.args[1].startswith("<distributed cell ")


def test_restart_of_a_connected_cluster_connects_again(backend):
    s = Session(backends=lambda engine: backend, stores=None).connect(profile="x")
    gen = s.generation
    s.restart()
    assert backend.owns_cluster is False and s.generation == gen + 1


def test_a_dead_worker_is_refused_at_once_with_the_remedy(session, backend):
    backend.script(r1=Scripted(engine_error="EngineError: Engine 101 died"))
    with pytest.raises(DistributedError):
        session.run_cell("import os; os._exit(0)")
    backend.ids.remove(backend.ids[1])  # the engine no longer has it
    jobs = len(backend.jobs)
    with pytest.raises(WorkersGone, match=r"rank\(s\) 1 on hostA are gone.*scale 2") as info:
        session.run_cell("x = 1")
    assert info.value.ranks == [1]
    assert len(backend.jobs) == jobs  # refused before anything was sent


def test_a_worker_the_engine_dropped_is_named_by_rank(session, backend):
    backend.ids.remove(backend.ids[0])  # gone without a failed call first
    with pytest.raises(WorkersGone, match=r"rank\(s\) 0 "):
        session.run_cell("x = 1")


def test_nbdists_own_calls_fail_naming_the_workers_and_what_they_were_for(
        session, backend, monkeypatch):
    submit = backend.submit

    def engine_fails(calls):
        job = submit(calls)
        job.outcomes = lambda: [Outcome(c.worker, engine_error="EngineError: died")
                                for c in calls]
        return job

    monkeypatch.setattr(backend, "submit", engine_fails)
    with pytest.raises(WorkerCallFailed, match="could not push values:\nworker 100: Engine") \
            as info:
        session.push({"x": 1})
    assert isinstance(info.value, ClusterError) and set(info.value.errors) == set(backend.ids)

    def never_answers(calls):
        job = submit(calls)
        job.wait = lambda timeout: False
        job.pending = lambda: [c.worker for c in calls]
        return job

    monkeypatch.setattr(backend, "submit", never_answers)
    with pytest.raises(WorkerCallFailed, match=r"workers \[100\] did not pull 'x' within 5 s"):
        session.pull("x")


def test_two_ranks_on_one_gpu_form_a_gloo_group_and_say_so_nccl_is_refused(capsys):
    """`%nbdist start -n 2` on a one-GPU machine: the ranks share GPU 0, so `auto` forms gloo
    (one line says so), and replacements and exports follow it; nccl is refused."""
    backend = ScriptedBackend(2)
    backend.gpus = 1
    s = Session(backends=lambda engine: backend, stores=None).start(2, timeout=5)
    joins = [c for c in backend.submitted if c.fn.__name__ == "join"]
    assert [c.args[3] for c in joins] == ["gloo", "gloo"]  # the dist backend each rank gets
    assert [p.gpu for p in s.plans] == [0, 0]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(
        "nbdist: ranks 0, 1 share GPU 0 on hostA, and NCCL needs one GPU per rank: the "
        "process group uses gloo")
    assert s.membership.dist_backend == "gloo" and s.options.dist_backend == "auto"
    with pytest.raises(ClusterError, match=r"--dist-backend nccl, but ranks 0, 1 share GPU 0 "
                                           r"on hostA.*leave the dist backend at auto"):
        Session(backends=lambda engine: backend, stores=None).start(
            2, timeout=5, dist_backend="nccl")
    backend.gpus = 2  # one GPU each: the ranks pick NCCL themselves
    s = Session(backends=lambda engine: backend, stores=None).start(2, timeout=5)
    assert s.membership.dist_backend == "auto" and "share" not in capsys.readouterr().out
