"""Widget views: traits after updates, the Scale control's error path, medium choice."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

import asyncio  # noqa: E402
import re  # noqa: E402

from synthetic import T0, training_events  # noqa: E402

from nbdist import table_layout as L  # noqa: E402
from nbdist.display import display_medium, make_run_view, set_display  # noqa: E402
from nbdist.display import html as H  # noqa: E402
from nbdist.display.summary import summary_bundle  # noqa: E402
from nbdist.display.text import StreamView, TextDashboard, format_summary  # noqa: E402
from nbdist.display.widgets import ClusterPanel, RunWidget, WidgetDashboard  # noqa: E402
from nbdist.errors import NoClusterError  # noqa: E402
from nbdist.records import ClusterStatus, WorkerRow  # noqa: E402
from nbdist.telemetry import events as ev  # noqa: E402
from nbdist.telemetry.aggregate import RunState  # noqa: E402


def feed_training(state, ranks=(0, 1), steps=8, slow_rank=None, n_of=None):
    for r in ranks:
        evs = training_events(steps, r == slow_rank)
        evs.append(ev.progress(1, "train", n_of(r) if n_of else steps, 20, T0 + steps * 0.1))
        evs.append(ev.scalars({"loss": 0.25}, T0 + 1))
        state.feed([{"rank": r, "seq": 1, "events": evs}])


def row_html(w, rank):
    """The markup of ``rank``'s row in a run widget's table."""
    t = w.table.value
    start = re.search(f"nbdist-rank-{rank}[ ']", t).start()
    return t[start:t.index("</tr>", start)]


def bar_width(row: str) -> float:
    return float(re.search(r"nbdist-bar-fill' style='width:([0-9.]+)%", row).group(1))


def test_run_widget_shows_a_row_per_rank_scalars_and_charts():
    state = RunState([0, 1])
    feed_training(state, n_of=lambda r: 5 + 5 * r)
    w = RunWidget([0, 1])
    w.show(state.snapshot())
    assert bar_width(row_html(w, 0)) == pytest.approx(25) and \
        bar_width(row_html(w, 1)) == pytest.approx(50)
    assert ">5/20 it<" in row_html(w, 0) and ">10/20 it<" in row_html(w, 1)
    assert "loss 0.25" in row_html(w, 0)  # each rank's own last values, in its row
    assert f"background:{L.BAR['running']}" in row_html(w, 0)
    assert "nbdist-step-chart" in w.chart.value and "nbdist-bandwidth-chart" in w.chart.value
    assert "nbdist-scalar-chart" in w.chart.value and "loss · ranks 0-1 (equal)" in w.chart.value
    assert "running" in w.header.value and "compute" in w.legend.value


def test_failed_rank_turns_red_with_its_reason_and_stays():
    state = RunState([0, 1])
    feed_training(state)
    state.feed([{"rank": 1, "seq": 2, "events": [ev.end(False, T0 + 2, "ValueError: <bad>")]},
                {"rank": 0, "seq": 2, "events": [ev.end(True, T0 + 2)]}])
    state.finish()
    w = RunWidget([0, 1])
    w.show(state.snapshot(), final=True)
    assert f"background:{L.FAIL}" in row_html(w, 1)
    assert f"background:{L.BAR['done']}" in row_html(w, 0)
    assert "ValueError: &lt;bad&gt;" in w.failures.value  # remote text is escaped
    assert "failed" in w.header.value


def test_straggler_is_flagged_on_its_row_and_named_in_the_header():
    state = RunState([0, 1, 2])
    feed_training(state, ranks=(0, 1, 2), slow_rank=2)
    w = RunWidget([0, 1, 2])
    w.show(state.snapshot())
    assert "nbdist-straggler" in row_html(w, 2) and "straggler" in row_html(w, 2)
    assert "nbdist-straggler" not in row_html(w, 0)
    assert "rank 2 is 40 ms/step slower" in w.header.value


def test_unexpected_rank_gets_a_row():
    state = RunState([0])
    feed_training(state, ranks=(0, 3))
    w = RunWidget([0])
    w.show(state.snapshot())
    assert "nbdist-rank-3" in w.table.value


def test_an_unchanged_part_is_not_sent_again():
    state = RunState([0, 1])
    feed_training(state)
    w = RunWidget([0, 1])
    w.show(state.snapshot())
    sent = []
    w.legend.observe(lambda c: sent.append(c), names="value")
    w.table.observe(lambda c: sent.append(c), names="value")
    w.show(state.snapshot())
    assert sent == []


def test_medium_is_chosen_by_argument_env_and_setting(monkeypatch):
    monkeypatch.delenv("NBDIST_DISPLAY", raising=False)
    assert display_medium() == "text"  # pytest runs no Jupyter kernel
    assert display_medium("widget") == "text"  # degrades without a kernel
    monkeypatch.setenv("NBDIST_DISPLAY", "bogus")
    with pytest.raises(ValueError, match="NBDIST_DISPLAY"):
        display_medium()
    with pytest.raises(ValueError):
        set_display("fancy")


def test_in_ipython_a_snapshot_and_a_run_show_as_the_run_summary():
    # The snapshot imports no view: making a run's view (as the session does before any run
    # has a snapshot) teaches IPython to draw it, so `last_run` at the end of a cell shows the
    # summary, and its text stays the snapshot's own repr.
    from IPython.core.interactiveshell import InteractiveShell

    from nbdist.telemetry.run import Run
    from nbdist.telemetry.snapshot import RunSnapshot

    shell = InteractiveShell.instance()
    html = shell.display_formatter.formatters["text/html"]
    for cls in (RunSnapshot, Run):
        html.type_printers.pop(cls, None)  # as in a fresh kernel
    run = Run("cell", [0, 1], world_size=2)
    feed_training(run)
    run.feed([{"rank": 1, "seq": 2, "events": [ev.end(False, T0 + 5, "Bad <input>")]}])
    run.finish()
    snap = run.snapshot()
    assert "text/html" not in shell.display_formatter.format(snap)[0]
    make_run_view("quiet", 0, 2)
    data, _ = shell.display_formatter.format(snap)
    assert data["text/plain"] == repr(snap)
    assert data["text/html"] == H.run_summary(snap)
    assert "Bad &lt;input&gt;" in data["text/html"] and "data:image/png" in data["text/html"]
    assert shell.display_formatter.format(run)[0]["text/html"] == H.run_summary(snap)


def test_text_run_view_shows_its_summary_as_text_and_html_under_ipython(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.instance()
    view = make_run_view("rank0", 0, 2)
    state = RunState([0, 1])
    feed_training(state)
    state.finish()
    snap = state.snapshot()
    view.dashboard.close(snap)
    assert shown == [{"text/plain": format_summary(snap), "text/html": H.run_summary(snap)}]


def test_text_run_view_prints_lines_not_a_flood(capsys):
    view = make_run_view("rank0", 0, 2)
    assert isinstance(view.dashboard, TextDashboard)
    state = RunState([0, 1])
    for k in range(50):  # 50 redraws in quick succession: one line, not 50
        batch = {"rank": 0, "seq": k + 1, "events": [
            ev.stream("stdout", f"line {k}\n"), ev.progress(1, "train", k, 50, T0 + k)]}
        view.stream.feed([batch])
        state.feed([batch])
        view.dashboard.update(state.snapshot())
    view.stream.close()
    state.finish()
    view.dashboard.close(state.snapshot())
    out = capsys.readouterr().out
    assert out.count("[0] line ") == 50
    status_lines = [ln for ln in out.splitlines() if ln.startswith("nbdist:")]
    assert len(status_lines) == 2 and "train 49/50 it" in status_lines[-1]
    assert "nbdist run:" in out  # the summary table
    quiet = make_run_view("quiet", 0, 2)
    assert quiet.dashboard is None and isinstance(quiet.stream, StreamView)


def test_scale_errors_stay_on_the_panel():
    def boom(n):
        raise RuntimeError("cannot <scale>")

    panel = ClusterPanel(lambda: ClusterStatus("none", 0), boom)
    panel.scale(3)
    assert "could not scale to 3" in panel.message.value and "&lt;scale&gt;" in panel.message.value


class FakeCluster:
    """A status function that can be stopped or broken, like a Session's."""

    def __init__(self):
        self.running, self.error, self.calls = True, None, 0

    def status(self):
        self.calls += 1
        if self.error:
            raise self.error
        if not self.running:
            raise NoClusterError()
        return ClusterStatus("ipyparallel", 2, (WorkerRow(0, "0", "h", 1, "cpu", True),
                                                WorkerRow(1, "1", "h", 2, "cpu", True)))

    def scale(self, n):
        if not self.running:
            raise NoClusterError()


def test_panel_says_stopped_and_shows_errors_on_itself():
    c = FakeCluster()
    panel = ClusterPanel(c.status, c.scale)
    assert "2/2 workers alive" in panel.table.value and not panel.stopped
    c.error = RuntimeError("engine <gone>")
    panel.refresh()  # the error is on the panel, not in a log
    assert "refresh failed: RuntimeError: engine &lt;gone&gt;" in panel.note.value
    c.error, c.running = None, False
    panel.refresh()
    assert panel.stopped and "stopped" in panel.table.value
    assert "2/2 workers alive" not in panel.table.value
    # nbdist's messages quote commands in backticks: the panel shows them as code
    assert "<code>%nbdist start -n 2</code>" in panel.table.value and "`" not in panel.table.value
    assert panel.scale_button.disabled and repr(panel) == "nbdist cluster: stopped"
    panel.scale(3)
    assert "could not scale to 3" in panel.message.value and "`" not in panel.message.value
    c.running = True
    panel.refresh()
    assert not panel.stopped and not panel.scale_button.disabled


def test_panel_refreshes_itself_on_the_event_loop_while_shown():
    c = FakeCluster()

    async def scenario():
        panel = ClusterPanel(c.status, c.scale, interval=0.01)
        assert panel._view_count == 0 and panel.refreshes == 1
        await asyncio.sleep(0.05)
        assert panel.refreshes == 1  # not shown anywhere: no refreshes
        panel._view_count = 1  # the front end drew it
        for _ in range(200):
            if panel.refreshes >= 4:
                break
            await asyncio.sleep(0.01)
        assert panel.refreshes >= 4
        c.running = False
        for _ in range(200):
            if panel.stopped:
                break
            await asyncio.sleep(0.01)
        assert "stopped" in panel.table.value
        panel._view_count = 0  # the output was cleared: refreshing stops
        await asyncio.sleep(0.03)
        n = panel.refreshes
        await asyncio.sleep(0.05)
        assert panel.refreshes == n and panel._task is None
        panel.close()

    asyncio.run(scenario())


def test_a_slow_status_spaces_refreshes_out():
    slow = FakeCluster()
    panel = ClusterPanel(slow.status, interval=1.0)
    panel._last_cost = 2.0  # the last status took 2 s: wait 2 / 0.2 = 10 s, not 1 s

    async def first_delay():
        panel._view_count = 1
        await asyncio.sleep(0.05)
        return panel.refreshes

    assert asyncio.run(first_delay()) == 1
    panel.close()


def test_widget_dashboard_shows_its_own_bundle_and_finishes_in_close(monkeypatch):
    shown = []

    class Handle:
        def update(self, bundle, raw):
            shown.append(bundle)

    def display(bundle, raw, display_id):
        shown.append(bundle)
        return Handle()

    monkeypatch.setattr("IPython.display.display", display)
    state = RunState([0, 1])
    dash = WidgetDashboard([0, 1])
    dash.update(state.snapshot())
    assert shown == []  # nothing under a cell that has sent no telemetry yet
    feed_training(state)
    dash.update(state.snapshot())
    state.feed([{"rank": r, "seq": 9, "events": [ev.end(True, T0 + 2)]} for r in (0, 1)])
    view = shown[0]["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == dash.widget.model_id  # the widget's own bundle, not a copy
    assert "nbdist-summary" in shown[0]["text/html"]
    assert shown[0]["text/plain"].startswith("nbdist run:")
    assert "nbdist-summary" in shown[0]["text/html"]
    assert "running" in dash.widget.header.value
    state.finish()
    final = state.snapshot()
    dash.close(final)
    assert len(shown) == 2 and "finished" in dash.widget.header.value
    # the run over, the output is the static summary alone: no widget for a saved notebook
    # to look for in a fresh session ("Error displaying widget: model not found")
    assert shown[1] == summary_bundle(final)
    assert "application/vnd.jupyter.widget-view+json" not in shown[1]


def test_dashboards_share_one_protocol():
    import inspect

    for cls in (TextDashboard, WidgetDashboard):
        assert isinstance(cls.interval, float)
        assert list(inspect.signature(cls.update).parameters) == ["self", "snap"]
        assert list(inspect.signature(cls.close).parameters) == ["self", "snap"]


def test_the_cluster_panels_output_becomes_static_when_stopped_or_replaced(monkeypatch):
    from display.test_widgets_job import WIDGET, Outputs, saved_whole

    from nbdist.display import end_cluster_views

    out = Outputs(monkeypatch)
    c = FakeCluster()
    first = ClusterPanel(c.status, c.scale, interval=None)
    first._ipython_display_()  # as `%nbdist cluster` shows it
    [live] = out.shown[0]
    assert live[WIDGET]["model_id"] == first.model_id
    # a frontend that draws no widgets shows the table
    assert "2/2 workers alive" in live["text/html"] and "2/2 workers alive" in live["text/plain"]
    second = ClusterPanel(c.status, c.scale, interval=None)
    second._ipython_display_()  # a new panel: the old one's output stays as it last was
    replaced = out.shown[0][-1]
    assert saved_whole(replaced) and "2/2 workers alive" in replaced["text/html"]
    assert "%nbdist cluster" in replaced["text/plain"]
    assert first._closed and not second._closed and len(out.shown[1]) == 1
    c.running = False  # %nbdist stop
    end_cluster_views()
    stopped = out.shown[1][-1]
    assert saved_whole(stopped) and "stopped" in stopped["text/html"]
    assert "2/2 workers alive" in stopped["text/html"]  # what ran, as last seen
    assert "stopped" in stopped["text/plain"] and second._closed
    end_cluster_views()
    assert len(out.shown[1]) == 2 and len(out.shown[0]) == 2
