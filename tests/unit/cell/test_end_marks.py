"""The notebook marks the end of ranks whose call returned while a peer still runs, where it
hosts the store (:mod:`nbdist.runtime.end_marks`); ranks mark themselves elsewhere."""

from __future__ import annotations

import pytest
from fakes import FakeStore, Scripted, ScriptedBackend, failed

from nbdist.runtime.end_marks import end_key
from nbdist.session import Session


@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(3)


def _session(backend: ScriptedBackend, store: object) -> Session:
    s = Session(backends=lambda engine: backend, stores=None).start(3, timeout=5)
    s.membership.store = store
    return s


def test_ranks_that_ended_while_a_peer_runs_are_marked_by_the_notebook(backend):
    store = FakeStore()
    session = _session(backend, store)
    # rank 2 runs until the notebook has marked the two others: it waits on that
    backend.script(r2=Scripted(until=lambda: len(store.values) == 2))
    session.run_cell("x = 1", timeout=5)
    cell_id = backend.submitted[-1].args[2]
    assert sorted(store.values) == sorted(end_key(cell_id, r) for r in (0, 1))
    assert all(c.kwargs["mark_end"] is False for c in backend.submitted[-3:])


def test_ranks_that_end_together_write_nothing(backend):
    store = FakeStore()
    session = _session(backend, store)
    session.run_cell("x = 1")
    assert store.values == {}


def test_a_rank_that_fails_alone_finds_its_peers_marked(backend):
    """The failing rank waits for its peers' marks before it returns (the worker's side is
    integration-tested); the notebook gives the two that succeeded theirs meanwhile."""
    store = FakeStore()
    session = _session(backend, store)
    backend.script(r1=Scripted(result=failed("ValueError", "bad"),
                               until=lambda: len(store.values) == 2))
    with pytest.raises(Exception, match="ValueError"):
        session.run_cell("x = 1", timeout=5)
    cell_id = backend.submitted[-1].args[2]
    assert sorted(store.values) == sorted(end_key(cell_id, r) for r in (0, 2))


def test_without_the_notebook_s_store_ranks_mark_themselves(backend):
    session = _session(backend, None)
    session.run_cell("x = 1")
    assert all(c.kwargs["mark_end"] is True for c in backend.submitted[-3:])


def test_a_store_that_is_gone_does_not_fail_the_cell(backend):
    from nbdist.boot.store_host import StoreError

    class GoneStore:
        calls = 0

        def set(self, key, value):
            GoneStore.calls += 1
            raise StoreError("the rendezvous store process is gone")

    session = _session(backend, GoneStore())
    done = iter([False, False, True])
    backend.script(r2=Scripted(until=lambda: next(done, True)))
    session.run_cell("x = 1", timeout=5)  # no StoreError: rank 2 ran to its end
    assert GoneStore.calls == 1  # tried once, then left alone
