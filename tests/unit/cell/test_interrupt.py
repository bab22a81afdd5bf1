"""Ranks an interrupt cannot stop, on the scripted backend: the engine restarts their worker
processes after a short grace, the group is formed again at once, and the error says which
namespaces were lost; engines that cannot restart one worker name the ranks as stuck."""

from __future__ import annotations

import pytest
from fakes import Scripted, ScriptedBackend

from nbdist.cell import interrupt as escalation
from nbdist.cell import loop as cell_run
from nbdist.errors import (
    CellInterrupted,
    CellTimeoutError,
    InterruptTimeoutError,
    RanksRestarted,
    WorkersGone,
    restarted_section,
)
from nbdist.session import Session


@pytest.fixture
def backend() -> ScriptedBackend:
    b = ScriptedBackend(2)
    b.can_restart_workers = True  # as Dask's nannies can
    return b


@pytest.fixture
def session(backend) -> Session:
    return Session(backends=lambda engine: backend, stores=None).start(2, engine="dask",
                                                                      timeout=5)


def stuck_rank1(backend: ScriptedBackend) -> None:
    backend.script(r0=Scripted(hang=True), r1=Scripted(hang=True, ignores_interrupt=True))
    backend.names[backend.ids[1]] = ["model", "opt", "losses"]


def joins_fail(backend: ScriptedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on a worker's join fails, as when the job's store is gone."""
    answer = backend._answer

    def join_fails(name, c):
        if name == "join":
            raise RuntimeError("the store is gone")
        return answer(name, c)

    monkeypatch.setattr(backend, "_answer", join_fails)


def test_a_rank_that_does_not_stop_is_restarted_and_the_group_formed_again(session, backend):
    stuck_rank1(backend)
    old = list(backend.ids)
    gen = session.generation
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    r = info.value.restarted
    assert r is not None and r.ranks == (1,) and r.removed == () and not r.not_reformed
    assert backend.restarted == [old[1]]  # only the rank that did not stop
    text = str(info.value)
    assert "rank 1 on hostA did not stop within 5 s" in text
    assert "Rank 1's namespace is lost (it held: model, opt, losses)" in text
    assert "The other ranks keep their namespaces" in text
    assert "%%distributed --ranks 1" in text and "%nbdist restart" in text
    # the group was formed again, the fresh process in rank 1's place, before the error
    assert [p.worker_id for p in session.plans] == [old[0], old[1] + 1000]
    assert session.generation > gen + 1
    joins = [c for c in backend.submitted if c.fn.__name__ == "join"]
    assert {c.worker for c in joins[-2:]} == {old[0], old[1] + 1000}
    # the next cell runs at once, on both ranks, at the group's generation: no re-forming
    backend.submitted.clear()
    session.run_cell("x = 1")
    cells = [c for c in backend.submitted if c.fn.__name__ == "run_cell"]
    assert [c.worker for c in cells] == [old[0], old[1] + 1000]
    assert {c.args[3] for c in cells} == {session.generation}


IMPORTS = [("np", "numpy", ""), ("nn", "torch.nn", ""), ("torch", "torch", "")]


def test_a_restarted_rank_imports_again_what_it_had_imported(session, backend):
    stuck_rank1(backend)
    old = list(backend.ids)
    backend.names[old[1]] = ["t"]
    backend.imports[old[1]] = IMPORTS
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    # the imports went to the fresh process in rank 1's place, after the group formed again
    restores = [c for c in backend.submitted if c.fn.__name__ == "restore_imports"]
    assert [(c.worker, c.args) for c in restores] == [(old[1] + 1000, (IMPORTS,))]
    calls = backend.calls
    assert calls.index("restore_imports") > max(i for i, n in enumerate(calls) if n == "join")
    r = info.value.restarted
    assert r.names == {1: ["t"]} and r.restored == {1: ["nn", "np", "torch"]}
    text = str(info.value)
    assert "Rank 1's namespace is lost (it held: t); its imports are restored: nn, np, torch." \
        in text


def test_a_fresh_process_under_its_old_workers_id_gets_the_imports(session, backend,
                                                                   monkeypatch):
    stuck_rank1(backend)
    old = list(backend.ids)
    backend.names[old[1]] = ["t"]
    backend.imports[old[1]] = IMPORTS

    def in_place(ids, timeout):  # an engine whose restarted worker keeps its id
        backend.restarted.extend(ids)
        return list(ids)

    form = session.membership.form

    def fresh_form(options):  # the old process's call has ended: the id answers again
        backend.restarted.clear()
        form(options)

    monkeypatch.setattr(backend, "restart_workers", in_place)
    monkeypatch.setattr(session.membership, "form", fresh_form)
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    restores = [c for c in backend.submitted if c.fn.__name__ == "restore_imports"]
    assert [c.worker for c in restores] == [old[1]]
    assert info.value.restarted.restored == {1: ["nn", "np", "torch"]}


def test_an_import_that_fails_again_is_listed_as_lost(session, backend):
    stuck_rank1(backend)
    backend.names[backend.ids[1]] = []
    backend.imports[backend.ids[1]] = IMPORTS
    backend.not_importable.add("np")
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    assert "Rank 1's namespace is lost (it held: np); its imports are restored: nn, torch." \
        in str(info.value)


def test_imports_are_lost_with_the_rest_where_the_group_cannot_form_again(session, backend,
                                                                         monkeypatch):
    stuck_rank1(backend)
    backend.names[backend.ids[1]] = ["t"]
    backend.imports[backend.ids[1]] = IMPORTS
    joins_fail(backend, monkeypatch)
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    assert "restore_imports" not in backend.calls
    assert "Rank 1's namespace is lost (it held: t, np, nn, torch)." in str(info.value)


def test_ranks_that_stop_within_the_grace_are_not_restarted(session, backend):
    backend.script(r0=Scripted(hang=True), r1=Scripted(hang=True))
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("train()", timeout=0.1)
    assert info.value.restarted is None and backend.restarted == []
    assert "restarted" not in str(info.value)


def test_the_stop_button_escalates_the_same_way(session, backend, monkeypatch):
    stuck_rank1(backend)
    polls = [0]
    pump = cell_run.pump

    def interrupted_on_the_third_poll(job, run, view, healer=None, carried=(), **kw):
        polls[0] += 1
        if polls[0] == 3:
            raise KeyboardInterrupt
        pump(job, run, view, healer, carried, **kw)

    monkeypatch.setattr(cell_run, "pump", interrupted_on_the_third_poll)
    with pytest.raises(KeyboardInterrupt) as info:
        session.run_cell("time.sleep(600)")
    assert isinstance(info.value, CellInterrupted)
    assert info.value.restarted is not None and info.value.restarted.ranks == (1,)
    assert "Rank 1's namespace is lost" in str(info.value)


def test_an_engine_that_cannot_restart_names_the_stuck_ranks(session, backend, monkeypatch):
    backend.can_restart_workers = False
    monkeypatch.setattr(escalation, "STOP_GRACE", 0.05)
    stuck_rank1(backend)
    with pytest.raises(InterruptTimeoutError, match=r"rank\(s\) \[1\] did not stop"):
        session.run_cell("time.sleep(600)", timeout=0.1)
    assert backend.restarted == []


def test_a_worker_without_a_nanny_is_stopped_and_the_next_cell_says_so(session, backend):
    stuck_rank1(backend)
    backend.no_nanny.add(backend.ids[1])
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    r = info.value.restarted
    assert r is not None and r.removed == (1,)
    assert "stopped, not replaced" in str(info.value)
    with pytest.raises(WorkersGone, match=r"rank\(s\) 1 on hostA are gone"):
        session.run_cell("x = 1")


def test_a_group_that_cannot_be_formed_again_says_so(session, backend, monkeypatch):
    stuck_rank1(backend)
    joins_fail(backend, monkeypatch)
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("time.sleep(600)", timeout=0.1)
    assert "could not be formed again with the new process (RuntimeError: the store is gone)" \
        in str(info.value)


def test_what_a_restart_lost_is_listed_briefly():
    names = [f"n{i}" for i in range(20)]
    r = RanksRestarted((0, 2), 5.0, 4, {0: "a", 2: "b"}, {0: names, 2: []})
    text = restarted_section(r)
    assert "rank 0 on a, rank 2 on b did not stop within 5 s" in text
    assert "their worker processes" in text
    assert "n11 and 8 more)" in text and "n12" not in text
    assert "Rank 2's namespace is lost (it held no names of its own)" in text
    assert restarted_section(RanksRestarted((0,), 5.0, 1)).count("other ranks") == 0
    assert "Rank 0's namespace is lost." in restarted_section(RanksRestarted((0,), 5.0, 1))
    only_imports = RanksRestarted((0,), 5.0, 1, names={0: []}, restored={0: ["torch"]})
    assert ("Rank 0's namespace is lost (it held no names of its own besides its imports); "
            "its imports are restored: torch.") in restarted_section(only_imports)
