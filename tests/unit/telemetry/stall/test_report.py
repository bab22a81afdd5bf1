"""The hang doctor's verdict from synthetic stack reports, with an explicit clock: when it is
given, what it says, and how the errors of a timeout and an interrupt carry it."""

from __future__ import annotations

import io

import pytest
from fakes import Scripted, ScriptedBackend
from synthetic import T0, stack_sleeping, stack_waiting

from nbdist.cell import loop as cell_run
from nbdist.display import html as H
from nbdist.display.text import TextDashboard, format_summary
from nbdist.errors import CellInterrupted, CellTimeoutError
from nbdist.options import CellOptions
from nbdist.session import Session
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.columns import pack, seal
from nbdist.telemetry.run import Run
from nbdist.telemetry.stall.report import (
    ELSEWHERE,
    FAILED,
    FINISHED,
    IN_COLLECTIVE,
    UNKNOWN,
)
from nbdist.telemetry.stall.words import headline, where_lines


def feed(state: RunState, rank: int, *events: dict, seq: int = 1) -> None:
    state.feed([{"rank": rank, "seq": seq, "events": list(events)}])


def hung(stall_after=None, **kw) -> RunState:
    """Rank 0 waits in the all-reduce (group seq 5) that rank 1, asleep, never reached."""
    state = RunState([0, 1], started=T0, stall_after=stall_after)
    feed(state, 0, stack_waiting(T0 + 1, **kw))
    feed(state, 1, stack_sleeping(T0 + 1))
    return state


# ----------------------------------------------------------------- threshold
def test_the_threshold_follows_the_steps_of_the_run():
    state = RunState([0, 1], started=T0)
    for n in range(3):  # 4 s steps: a stall is 20 s without progress
        feed(state, 0, ev.step(n, T0 + 4 * n, T0 + 4 * n + 4), seq=n + 1)
    last = T0 + 12
    feed(state, 0, stack_waiting(last + 3), seq=9)
    feed(state, 1, stack_sleeping(last + 3))
    assert state.snapshot(at=last + 15).stall is None
    v = state.snapshot(at=last + 21).stall
    assert v is not None and v.threshold_s == 20.0 and v.idle_s == pytest.approx(21)


# ----------------------------------------------------------------- the verdict
def test_verdict_names_who_waits_where_and_who_never_arrived():
    state = hung()
    assert state.snapshot(at=T0 + 9).stall is None  # under the 10 s floor
    assert state.snapshot().stall is None  # no clock given: not judged
    v = state.snapshot(at=T0 + 12).stall
    assert v is not None and v.hang
    assert [(c.op, c.seq, c.group, c.size, rs) for c, rs in v.waits] == \
        [("all_reduce", 5, "default_pg", "float32 [4]", (0,))]
    assert v.missing == (1,)
    r0, r1 = v.rank(0), v.rank(1)
    assert (r0.status, r0.line, r0.doing) == (IN_COLLECTIVE, 6,
                                              "torch.distributed.distributed_c10d.all_reduce")
    assert (r1.status, r1.line, r1.doing) == (ELSEWHERE, 5, "time.sleep(0.05)")
    assert headline(v) == ("no step or collective completed for 12 s (stall threshold 10 s): "
                           "rank 0 waits in all_reduce (seq 5, float32 [4]); "
                           "rank 1 never reached it")
    assert where_lines(v, "In [7]") == [
        "rank 0: waiting in all_reduce (seq 5, float32 [4]) at In [7], line 6: "
        "dist.all_reduce(t) (in torch.distributed.distributed_c10d.all_reduce)",
        "rank 1: in time.sleep(0.05) at In [7], line 5; it never reached the all_reduce the "
        "others wait in"]


def test_without_the_flight_recorder_nbdists_own_count_names_the_call():
    v = hung(flight=False).snapshot(at=T0 + 12).stall
    [(c, ranks)] = v.waits
    assert (c.op, c.seq, c.group, c.size, ranks) == ("all_reduce", 1, None, "16 B float32", (0,))
    assert c.describe() == "all_reduce (call 1 of it in the cell, 16 B float32)"
    assert v.missing == (1,)


def test_a_rank_that_got_past_the_collective_is_not_blamed():
    state = RunState([0, 1, 2], started=T0)
    feed(state, 0, stack_waiting(T0 + 1, seq=5))
    feed(state, 1, stack_sleeping(T0 + 1))
    # rank 2's Flight Recorder shows seq 5 done: it is elsewhere, but not the one missing
    feed(state, 2, stack_sleeping(T0 + 1, flight=[
        {"group": "default_pg", "op": "all_reduce", "seq": 5, "sizes": [[4]],
         "dtypes": ["Float"], "state": "completed", "done": True, "p2p": False}]))
    v = state.snapshot(at=T0 + 12).stall
    assert v.missing == (1,)
    assert v.rank(2).last.seq == 5


def test_a_rank_that_finished_the_cell_never_reached_the_collective():
    state = RunState([0, 1], started=T0)
    feed(state, 1, stack_sleeping(T0 + 0.5), ev.end(True, T0 + 1))  # its report is older
    feed(state, 0, stack_waiting(T0 + 2))
    v = state.snapshot(at=T0 + 12).stall
    assert v.rank(1).status == FINISHED and v.missing == (1,)
    assert "rank 1: finished the cell; it never reached the all_reduce" in where_lines(v)[1]


def test_ranks_with_no_report_yet_are_not_blamed():
    state = RunState([0, 1], started=T0)
    feed(state, 0, stack_waiting(T0 + 1))
    v = state.snapshot(at=T0 + 12).stall
    assert v.rank(1).status == UNKNOWN and v.missing == () and not v.hang
    assert where_lines(v)[1] == "rank 1: no report of where it is"


def test_progress_makes_older_reports_stale_and_restarts_the_clock():
    state = hung()
    feed(state, 0, ev.comm("broadcast", T0 + 2, T0 + 3, 16), seq=2)  # a collective completed
    assert state.snapshot(at=T0 + 12).stall is None  # 9 s since then
    assert state.snapshot(at=T0 + 14).stall is None  # the reports are older than the progress
    feed(state, 0, stack_sleeping(T0 + 8, line=2), seq=3)
    v = state.snapshot(at=T0 + 14).stall
    # nobody waits in a collective, but the run had made progress before: a stall
    assert v is not None and not v.waits and v.rank(0).line == 2
    assert v.rank(1).status == UNKNOWN
    assert headline(v) == ("no step or collective completed for 11 s (stall threshold 10 s): "
                           "no rank is inside a collective")


def test_a_slow_cell_that_never_stepped_or_communicated_is_not_a_hang():
    state = RunState([0, 1], started=T0)
    feed(state, 0, stack_sleeping(T0 + 5))
    feed(state, 1, stack_sleeping(T0 + 5))
    assert state.snapshot(at=T0 + 60).stall is None
    assert state.where(T0 + 60) is not None  # but an error can still say where they were


def test_stall_after_zero_switches_the_verdict_off():
    assert hung(stall_after=0).snapshot(at=T0 + 1000).stall is None
    assert hung(stall_after=1).snapshot(at=T0 + 1.5).stall is not None


def test_interrupt_reports_outlive_the_ranks_end_stall_reports_do_not():
    state = RunState([0, 1], started=T0)
    feed(state, 0, stack_waiting(T0 + 1, reason="interrupt"),
         ev.end(False, T0 + 2, "KeyboardInterrupt: "))
    feed(state, 1, stack_sleeping(T0 + 1), ev.end(False, T0 + 2, "ValueError: bad"))
    state.finish()
    v = state.where(T0 + 3)
    assert v.rank(0).status == IN_COLLECTIVE and v.rank(0).reason == "interrupt"
    assert v.rank(1).status == FAILED and v.rank(1).error == "ValueError: bad"
    assert state.snapshot(at=T0 + 12).stall is not None  # stopped where it stood: still shown
    finished = RunState([0], started=T0)
    feed(finished, 0, stack_waiting(T0 + 1), ev.end(True, T0 + 2))
    assert finished.snapshot(at=T0 + 100).stall is None  # a run that ended well is not stalled


def test_a_cell_function_shows_its_call_chain():
    state = RunState([0, 1], started=T0)
    e = stack_waiting(T0 + 1)
    e["frames"].insert(0, {"file": "<distributed cell 1>", "line": 9, "name": "<module>",
                           "cell": True, "code": "train()", "call": "train()"})
    e["frames"][1]["name"] = "train"
    feed(state, 0, e)
    feed(state, 1, stack_sleeping(T0 + 1))
    lines = where_lines(state.snapshot(at=T0 + 12).stall)
    assert lines[1:3] == ["    cell line 9, in <module>: train()",
                          "    cell line 6, in train: dist.all_reduce(t)"]


def test_run_says_once_when_the_verdict_appears_or_changes(monkeypatch):
    clock = [T0]
    monkeypatch.setattr("nbdist.telemetry.run.time.time", lambda: clock[0])
    run = Run("cell", [0, 1], world_size=2, stall_after=1)
    run.feed([{"rank": 0, "seq": 1, "events": [stack_waiting(T0 + 0.5)]}])
    assert not run.stall_news()  # under the threshold
    clock[0] = T0 + 2
    assert run.stall_news() and not run.stall_news()
    run.feed([{"rank": 1, "seq": 1, "events": [stack_sleeping(T0 + 2)]}])
    assert run.stall_news()  # rank 1 reported: the verdict now names it
    assert run.snapshot().stall.missing == (1,)
    assert run.recorded  # kept for last_run although no step or collective completed


# ----------------------------------------------------------------- views
def test_text_view_prints_the_verdict_as_soon_as_it_appears_and_only_then():
    out = io.StringIO()
    dash = TextDashboard(stream=out, interval=1000)
    snap = hung().snapshot(at=T0 + 12)
    dash.update(snap)
    dash.update(snap)
    text = out.getvalue()
    assert text.count("nbdist: hang doctor: no step or collective completed for 12 s") == 1
    assert "\n  rank 1: in time.sleep(0.05) at cell line 5; it never reached" in text
    assert "hang doctor:" in format_summary(snap)


def test_html_shows_the_verdict_escaped():
    state = RunState([0, 1], started=T0)
    e = stack_sleeping(T0 + 1)
    e["frames"][0]["code"] = e["frames"][0]["call"] = "f('<b>')"
    feed(state, 1, e)
    feed(state, 0, stack_waiting(T0 + 1))
    html = H.run_summary(state.snapshot(at=T0 + 12))
    assert "nbdist-stall" in html and "f(&#x27;&lt;b&gt;&#x27;)" in html and "<b>')" not in html
    assert H.stall(RunState([0]).snapshot()) == ""


def test_widget_shows_the_verdict():
    pytest.importorskip("ipywidgets")
    from nbdist.display.widgets import RunWidget

    w = RunWidget([0, 1])
    w.show(hung().snapshot(at=T0 + 12))
    assert "rank 1 never reached it" in w.stall.value
    w.show(hung().snapshot(at=T0 + 2))
    assert w.stall.value == ""


# ----------------------------------------------------------------- errors
def test_timeout_error_lists_where_each_rank_was():
    v = hung().where(T0 + 4)
    err = CellTimeoutError(4, [0, 1], where=v, label="In [7]")
    text = str(err)
    assert text.startswith("cell ran past --timeout 4 s; rank(s) [0, 1] were still running")
    assert "\n\nWhere each rank was when it was interrupted:\n  rank 0: waiting in all_reduce" \
        in text
    assert "  rank 1: in time.sleep(0.05) at In [7], line 5;" in text
    assert "Rank 1 never reached the all_reduce (seq 5, float32 [4]) that rank 0 waits in." \
        in text
    assert "Where each rank" not in str(CellTimeoutError(4, [0]))  # no reports: as before


def test_interrupt_error_is_a_keyboard_interrupt_that_says_where():
    err = CellInterrupted([0, 1], hung().where(T0 + 4))
    with pytest.raises(KeyboardInterrupt):
        raise err
    assert not isinstance(err, Exception)  # `except Exception` does not swallow an interrupt
    assert "rank 1: in time.sleep(0.05) at cell line 5" in str(err)
    assert err._render_traceback_()[0].startswith("\x1b[31mKeyboardInterrupt\x1b[0m: cell "
                                                  "interrupted; rank(s) [0, 1]")


def test_stall_after_must_be_zero_or_positive():
    assert CellOptions(stall_after=0).stall_after == 0
    with pytest.raises(ValueError, match="--stall-after"):
        CellOptions(stall_after=-1)


# ----------------------------------------------------------------- the session
@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(2)


@pytest.fixture
def session(backend) -> Session:
    return Session(backends=lambda engine: backend).start(2, engine="ipyparallel", timeout=5)


def _hung_cell(backend: ScriptedBackend) -> None:
    """Both ranks hang; their reports of where they are reach the notebook meanwhile."""
    backend.script(
        r0=Scripted(hang=True, batches=[{"rank": 0, "seq": 1, "events": [
            stack_waiting(T0 + 1, reason="interrupt")]}]),
        r1=Scripted(hang=True, batches=[{"rank": 1, "seq": 1, "events": [
            stack_sleeping(T0 + 1, reason="interrupt")]}]))


def test_session_timeout_error_carries_the_ranks_reports(session, backend):
    _hung_cell(backend)
    with pytest.raises(CellTimeoutError) as info:
        session.run_cell("hang()", timeout=0.1, stall_after=30, execution_count=7)
    assert info.value.where.missing == (1,)
    assert "rank 1: in time.sleep(0.05) at In [7], line 5" in str(info.value)
    call = backend.submitted[-1]
    assert call.kwargs["measure"].stall_after == 30  # the workers sample on the same threshold


def test_session_interrupt_raises_a_keyboard_interrupt_with_the_reports(
        session, backend, monkeypatch):
    _hung_cell(backend)
    polls = [0]
    pump = cell_run.pump

    def interrupted_on_the_third_poll(job, run, view, coordinator=None, carried=(), **kw):
        polls[0] += 1
        if polls[0] == 3:
            raise KeyboardInterrupt  # the kernel's stop button, while the cell runs
        pump(job, run, view, coordinator, carried, **kw)

    monkeypatch.setattr(cell_run, "pump", interrupted_on_the_third_poll)
    with pytest.raises(KeyboardInterrupt) as info:
        session.run_cell("hang()")
    assert isinstance(info.value, CellInterrupted) and info.value.ranks == [0, 1]
    assert "Rank 1 never reached the all_reduce" in str(info.value)
    assert set(backend.interrupted) == set(backend.ids)


def test_a_slow_cell_with_only_stall_reports_is_not_kept_as_a_recorded_run():
    run = Run("cell", [0], world_size=1)
    run.feed([{"rank": 0, "seq": 1, "events": [stack_sleeping(T0 + 5)]}])
    assert not run.stall_news() and not run.recorded  # nothing to show: last_run stays as it was
    run.feed([{"rank": 0, "seq": 2, "events": [stack_sleeping(T0 + 6, reason="interrupt")]}])
    assert run.recorded and run.where().rank(0).reason == "interrupt"


def test_ranks_that_called_different_collectives_in_the_same_place_are_a_clash():
    state = RunState([0, 1], started=T0)
    feed(state, 0, stack_waiting(T0 + 1, seq=5))
    other = stack_waiting(T0 + 1, seq=5)
    other["flight"][-1]["op"] = other["collective"]["op"] = "broadcast"
    feed(state, 1, other)
    v = state.snapshot(at=T0 + 12).stall
    assert v.missing == () and not v.hang
    [(a, b)] = v.clashes
    assert (a.op, b.op, a.seq) == ("all_reduce", "broadcast", 5)
    assert headline(v).endswith("all_reduce and broadcast are both collective 5 of group "
                                "default_pg: the ranks called different collectives")
    assert "the ranks called different collectives." in str(
        CellTimeoutError(1, [0, 1], where=state.where(T0 + 2)))


def test_what_a_rank_sends_while_an_interrupt_unwinds_it_is_not_progress():
    state = RunState([0, 1], started=T0)
    feed(state, 0, ev.step(0, T0, T0 + 0.5), seq=1)
    feed(state, 0, stack_waiting(T0 + 5, reason="interrupt"),
         ev.step(1, T0 + 0.5, T0 + 6),  # the step the interrupt cut short, closed on the way out
         ev.end(False, T0 + 6, "KeyboardInterrupt: "), seq=2)
    feed(state, 1, stack_sleeping(T0 + 5, reason="interrupt"),
         ev.end(False, T0 + 6, "KeyboardInterrupt: "))
    state.finish()
    v = state.where(T0 + 6)
    assert v is not None and v.missing == (1,) and v.idle_s == pytest.approx(5.5)
    assert state.snapshot(at=T0 + 11).stall is not None  # the final view keeps the verdict


def test_a_sealed_batch_sent_while_an_interrupt_unwinds_folds_as_its_events_do():
    # the step the interrupt cut short, its collectives summed on the worker (as a cell's
    # rank seals them): what came after the interrupt is read one by one, as plain events
    tail = [ev.comm("all_reduce", T0 + 0.6, T0 + 4.0, 64, step=1),
            ev.comm("all_reduce", T0 + 5.5, T0 + 5.9, 64, step=1),
            ev.step(1, T0 + 0.5, T0 + 6), ev.end(False, T0 + 6, "KeyboardInterrupt: ")]
    sealed = seal(pack(tail))
    assert [e["kind"] for e in sealed] == [ev.SEALED, ev.END] and "rows" in sealed[0]

    def fold(events: list[dict]) -> RunState:
        state = RunState([0], started=T0)
        feed(state, 0, ev.step(0, T0, T0 + 0.5), seq=1)
        feed(state, 0, stack_waiting(T0 + 5, reason="interrupt"), seq=2)
        state.feed([{"rank": 0, "seq": 3, "events": events}])
        state.finish()
        return state

    plain, folded = fold(tail), fold(sealed)
    assert folded.where(T0 + 6) == plain.where(T0 + 6)
    assert folded.where(T0 + 6).idle_s == pytest.approx(2.0)  # progress until T0 + 4 only
    assert folded.snapshot(at=T0 + 11) == plain.snapshot(at=T0 + 11)
