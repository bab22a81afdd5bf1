"""What the session keeps across cells, on the scripted backend: a push of a name replaces its
copy, named runs are bounded and keep their trace only while among the latest runs,
``status`` says what the notebook holds, and ``stop`` lets go of all of it."""

from __future__ import annotations

from fakes import Scripted, ok
from synthetic import T0, training_events

from nbdist.cell import runner
from nbdist.records import Held
from nbdist.telemetry import events as ev


class Blob:
    """A pushed value that is not a literal: the record keeps a copy of it."""

    def __init__(self, n: int) -> None:
        self.payload = bytes(n)


def named_cell(session, backend, name: str) -> None:
    """A cell named ``name`` whose two ranks each report eight training steps."""
    batches = [{"rank": r, "seq": 1, "events": training_events(8) + [ev.end(True, T0 + 2)]}
               for r in (0, 1)]
    backend.script(r0=Scripted(ok(seq=1), batches=batches[:1]),
                   r1=Scripted(ok(seq=1), batches=batches[1:]))
    session.run_cell("train()", name=name)


def test_a_push_again_of_the_same_name_holds_one_copy(session):
    session.push({"data": Blob(50_000)})
    one = session.held().push_bytes
    assert one > 50_000
    for _ in range(3):
        session.push({"data": Blob(50_000)})
    held = session.held()
    assert held.pushes == 4 and held.push_bytes == one  # four pushes, one copy


def test_status_says_what_the_notebook_holds(session, backend):
    session.push({"data": Blob(2**20)})
    session.run_cell("x = data")
    named_cell(session, backend, "base")
    status = session.status()
    held = status.held
    assert isinstance(held, Held) and held == session.held()
    assert (held.cells, held.pushes, held.runs, held.named) == (2, 1, 1, 1)
    assert held.push_budget == session.history.budget and held.trace_events > 0
    text = repr(status).splitlines()[-1]
    assert text == (f"notebook holds: history 2 of 5000 cells, 1 pushes / push copies "
                    f"{held.push_bytes / 2**20:.1f} MiB of 256 MiB / runs 1 of 3 / named runs "
                    f"1 of 50 / traces {held.trace_events} events")
    assert "notebook holds: history 2 of 5000 cells" in status._repr_html_()


def test_named_runs_are_bounded_and_keep_a_trace_only_while_among_the_latest(
        session, backend, monkeypatch):
    monkeypatch.setattr(runner, "MAX_NAMED", 4)
    for name in ("a", "b", "c", "d", "e"):
        named_cell(session, backend, name)
    assert list(session.named) == ["b", "c", "d", "e"]  # the oldest name went
    assert [r.name for r in session.runs] == ["c", "d", "e"]
    assert session.named["b"].trace_events == 0  # left the latest runs: figures only
    assert all(session.named[n].trace_events > 0 for n in "cde")
    assert [r.name for r in session.compare("b", "e").runs] == ["b", "e"]


def test_stop_lets_go_of_everything_the_session_kept(session, backend):
    session.push({"data": Blob(2**20)})
    session.run_cell("x = data")
    named_cell(session, backend, "base")
    assert session.held().push_bytes > 0
    assert session.stop().startswith("stopped 2 workers")
    held = session.held()
    assert (held.cells, held.pushes, held.push_bytes, held.runs, held.named,
            held.trace_events) == (0, 0, 0, 0, 0, 0)
    assert session.last_run is None
