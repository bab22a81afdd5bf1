"""What the views say when things break: the cause of a stop, a run gone quiet, counts that
cannot invert, bars named, one colour per meaning, the theme's colours. Synthetic events, pure
views (no cluster)."""

from __future__ import annotations

import re

import pytest
from synthetic import T0, stack_sleeping, stack_waiting, training_events

from nbdist import table_layout as L
from nbdist.display import html as H
from nbdist.display.tables import run_table
from nbdist.display.text import TextDashboard, format_summary
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.run import Run


def stopped_by_timeout() -> Run:
    """Rank 0 waits in an all-reduce that rank 1, asleep, never reaches; the notebook's
    --timeout interrupts both."""
    run = Run("cell", [0, 1], world_size=2, stall_after=30)
    for r in (0, 1):
        run.feed([{"rank": r, "seq": 1, "events": training_events(5)}])
    run.stopped("--timeout 16 s")
    run.feed([{"rank": 0, "seq": 2, "events": [stack_waiting(T0 + 9, reason="interrupt")]},
              {"rank": 1, "seq": 2, "events": [stack_sleeping(T0 + 9, reason="interrupt")]}])
    run.feed([{"rank": r, "seq": 3, "events": [ev.end(False, T0 + 10, "KeyboardInterrupt: ")]}
              for r in (0, 1)])
    run.finish()
    return run


def test_a_timeout_blames_the_rank_that_held_the_others_and_says_who_waited():
    snap = stopped_by_timeout().snapshot()
    rows = {r.rank: r for r in run_table(snap).rows}
    assert rows[0].cells[-1] == "stopped by --timeout · waiting in all_reduce"
    assert rows[1].cells[-1] == "stopped by --timeout · held the others: in time.sleep(0.05) " \
                                "at line 5"
    assert rows[1].held and not rows[1].broken and not rows[0].broken and not rows[0].held
    html = H.run_summary(snap)
    assert "KeyboardInterrupt" not in html and "KeyboardInterrupt" not in format_summary(snap)
    assert "stopped by --timeout 16 s after" in H.run_header(snap, final=True)
    # the hang doctor's report says where each was, in the hang colour, threshold or not
    assert f"color:{L.HANG}'>hang doctor:" in H.stall(snap)
    markup = H.run_table_html(snap)
    assert "nbdist-rank-row nbdist-rank-1 nbdist-held' style='color:" + L.HANG in markup
    assert f"color:{L.FAIL}" not in markup


def test_an_interrupt_says_interrupted():
    run = Run("cell", [0], world_size=1)
    run.feed([{"rank": 0, "seq": 1, "events": training_events(3)}])
    run.stopped("interrupt")
    run.feed([{"rank": 0, "seq": 2, "events": [ev.end(False, T0 + 1, "KeyboardInterrupt: ")]}])
    run.finish()
    snap = run.snapshot()
    assert run_table(snap).rows[0].cells[-1] == "interrupted"
    assert H.run_header(snap, final=True).count("interrupted after") == 1


def test_a_run_that_goes_quiet_says_for_how_long_before_the_verdict():
    state = RunState([0, 1], started=T0, stall_after=10)
    for r in (0, 1):
        state.feed([{"rank": r, "seq": 1, "events": training_events(5)}])
    last = T0 + 0.5  # the fifth step's end
    assert state.snapshot(at=last + 1).idle_s is None  # a second is nothing to say
    snap = state.snapshot(at=last + 4)
    assert snap.idle_s == pytest.approx(4) and snap.stall is None
    assert "no step for 4 s" in H.run_header(snap)
    # the verdict takes over past the threshold; the quiet phrase goes
    state.feed([{"rank": 0, "seq": 2, "events": [stack_waiting(last + 9)]},
                {"rank": 1, "seq": 2, "events": [stack_sleeping(last + 9)]}])
    snap = state.snapshot(at=last + 11)
    assert snap.stall is not None and snap.idle_s is None
    assert "no step for" not in H.run_header(snap)
    assert "11 s" in H.stall(snap)  # the verdict's age, as of now


def test_a_cell_without_telemetry_shows_its_clock_once_it_runs_a_while():
    from nbdist.display.widgets import RunWidget

    state = RunState([0, 1], started=T0)
    assert not state.snapshot(at=T0 + 1).has_news
    snap = state.snapshot(at=T0 + 3)
    assert snap.has_news and not snap.has_telemetry
    w = RunWidget([0, 1])
    w.show(snap)
    assert "no step yet" in w.header.value and w.table.value == "" and w.legend.value == ""


def test_counts_are_read_at_one_moment_so_the_later_report_does_not_look_ahead():
    state = RunState([0, 1])
    # both ranks move in lockstep, 10 items/s; rank 1's batch came 0.5 s later
    for r, last in ((0, 49), (1, 54)):
        evs = [ev.progress(1, "train", n, 200, T0 + n * 0.1) for n in range(0, last + 1)]
        state.feed([{"rank": r, "seq": 1, "events": evs}])
    snap = state.snapshot()
    assert [r.bar.n for r in snap.ranks] == [49, 49]
    assert all(r.behind_s is None for r in snap.ranks)
    # a rank far behind is shown as of its own report, and says so
    state.feed([{"rank": 1, "seq": 2, "events": [ev.progress(1, "train", 130, 200, T0 + 13)]}])
    snap = state.snapshot()
    zero, one = snap.ranks
    assert one.bar.n == 130 and zero.bar.n == 49 and zero.behind_s == pytest.approx(13 - 4.9)
    assert "as of 8.1 s before the others" in run_table(snap).rows[0].cells[-1]


def test_a_row_names_its_bar_and_an_outer_bar_does_not_take_the_row():
    state = RunState([0])
    evs = [ev.progress(1, "epochs", 0, 3, T0),
           ev.progress(2, "epoch 0", 40, 40, T0 + 1, done=True),
           ev.progress(1, "epochs", 1, 3, T0 + 1.01),
           ev.progress(3, "epoch 1", 10, 40, T0 + 1.3),
           ev.progress(3, "epoch 1", 20, 40, T0 + 1.6)]
    state.feed([{"rank": 0, "seq": 1, "events": evs}])
    state.feed([{"rank": 0, "seq": 2, "events": [ev.progress(1, "epochs", 1, 3, T0 + 1.7)]}])
    [r] = state.snapshot().ranks
    assert (r.bar.desc, r.bar.n, r.bar.outer) == ("epoch 1", 20, ("epochs 1/3",))
    row = run_table(state.snapshot()).rows[0]
    assert row.cells[1] == "epoch 1 · 50%" and row.cells[2] == "20/40 it"


def test_one_colour_per_meaning_in_the_legend():
    legend = H.legend()
    meanings = {"straggler": L.STRAGGLER, "hang": L.HANG, "failure": L.FAIL,
                "recovery": L.RECOVERY}
    for word, colour in meanings.items():
        assert re.search(f"background:{colour};[^']*'></span>{word}", legend), word
    assert len(set(meanings.values()) | {L.COMPUTE, L.WAITING, L.TRANSFER}) == 7


def test_charts_and_legend_take_the_themes_colours():
    state = RunState([0, 1])
    for r in (0, 1):
        state.feed([{"rank": r, "seq": 1, "events": training_events(5)
                     + [ev.scalars({"loss": 0.5}, T0 + 1), ev.progress(1, "", 5, 10, T0)]}])
    charts = H.charts(state.snapshot())
    svgs = re.findall(r"<svg [^>]*>", charts)
    assert len(svgs) == 3 and all("fill='currentColor'" in s for s in svgs)
    assert "var(--jp-ui-font-color2" in H.legend()
    assert "var(--jp-layout-color3" in H.run_table_html(state.snapshot())  # the bars' track


def test_the_text_view_prints_what_happened_once():
    import io

    from nbdist.telemetry.recovery import Lost

    out = io.StringIO()
    view = TextDashboard(stream=out, interval=0)
    run = Run("cell", [0, 1], world_size=2)
    run.feed([{"rank": r, "seq": 1, "events": training_events(3)} for r in (0, 1)])
    run.note_recovery(Lost(T0, 1, "h", 7, "SIGKILL"))
    view.update(run.snapshot())
    view.update(run.snapshot())
    run.finish()
    view.close(run.snapshot())
    assert out.getvalue().count("rank 1 on h (pid 7) died: SIGKILL") == 1


def test_the_scale_box_follows_the_cluster_it_shows():
    pytest.importorskip("ipywidgets")
    from nbdist.display.widgets import ClusterPanel
    from nbdist.records import ClusterStatus, WorkerRow

    size = [2]

    def status():
        return ClusterStatus("ipyparallel", size[0], tuple(
            WorkerRow(i, str(i), "h", 10 + i, "cpu", True, 1.0) for i in range(size[0])))

    panel = ClusterPanel(status, scale=lambda n: None, interval=None)
    assert panel.count.value == 2
    size[0] = 17  # scaled elsewhere (%nbdist scale 17)
    panel.refresh()
    assert panel.count.value == 17  # one click on Scale must not shrink it back to 2
    panel.count.value = 20  # someone typed a number: the box keeps it
    size[0] = 18
    panel.refresh()
    assert panel.count.value == 20


def test_a_backend_tells_the_start_view_as_workers_come_up():
    from nbdist.backends.base import Backend

    class Counting(Backend):
        def _start(self, n, timeout):
            came = iter([[], [1], [1], [1, 2, 3]])
            self._await_workers(lambda: next(came), n, timeout,
                                lambda k, timeout: waited.append(k))

        connect = worker_ids = submit = interrupt = transport = None

    told, waited = [], []
    b = Counting()
    b.on_ready = lambda k, n: told.append((k, n))
    b.start(3, 30)
    assert told == [(0, 3), (1, 3), (3, 3)]
    # while counting, the engine's own wait for the next worker; then for all, to say why not
    assert waited == [1, 2, 2, 3]


def test_a_warning_shows_again_in_the_next_cell():
    import warnings

    from nbdist.runtime.capture import captured_output

    class Sink:
        def __init__(self):
            self.events = []

        def emit(self, e):
            self.events.append(e)

    def warn():
        warnings.warn("this shard is small", stacklevel=1)

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # Python's own: once per location
        for _ in range(2):  # the same cell, run twice on a warm worker
            sink = Sink()
            with captured_output(sink):
                warn()
                warn()  # once per location within a cell, as Python shows it
            assert [e["message"] for e in sink.events if e["kind"] == "warning"] == \
                ["this shard is small"]


def test_one_very_long_step_does_not_flatten_the_others():
    from nbdist.telemetry.snapshot import StepPoint

    series = [StepPoint(n, 0.1, 0.08, 0.01, 0.01, 1000, None, 2) for n in range(20)]
    series[10] = StepPoint(10, 13.0, 12.9, 0.05, 0.05, 1000, None, 2)  # waited for a worker
    svg = H.step_chart_svg(series)
    assert ">400 ms<" in svg  # the top: 4 times the 90th percentile, not 13 s
    assert svg.count("nbdist-cut-bar") == 1 and "step 10: 13 s" in svg  # cut, and told
    heights = [float(h) for h in re.findall(r"<rect [^>]*height='([0-9.]+)'", svg)]
    assert max(heights) <= 120 - 16 - 14 + 0.1
