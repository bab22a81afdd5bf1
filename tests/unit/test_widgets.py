"""Widget views: traits after updates, the Scale control's error path, medium choice."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from synthetic import T0, training_events  # noqa: E402

from nbdist.display import display_medium, make_run_view, set_display  # noqa: E402
from nbdist.display.refresh import Throttle  # noqa: E402
from nbdist.display.text import StreamView, TextDashboard  # noqa: E402
from nbdist.display.widgets import ClusterPanel, RunWidget, WidgetDashboard  # noqa: E402
from nbdist.records import ClusterStatus  # noqa: E402
from nbdist.telemetry import events as ev  # noqa: E402
from nbdist.telemetry.aggregate import RunState  # noqa: E402


def feed_training(state, ranks=(0, 1), steps=8, slow_rank=None, n_of=None):
    for r in ranks:
        evs = training_events(steps, r == slow_rank)
        evs.append(ev.progress(1, "train", n_of(r) if n_of else steps, 20, T0 + steps * 0.1))
        evs.append(ev.scalars({"loss": 0.25}, T0 + 1))
        state.feed([{"rank": r, "seq": 1, "events": evs}])


def test_run_widget_shows_a_bar_per_rank_scalars_and_charts():
    state = RunState([0, 1])
    feed_training(state, n_of=lambda r: 5 + 5 * r)
    w = RunWidget([0, 1])
    w.show(state.snapshot())
    assert set(w.rows) == {0, 1}
    assert w.rows[0].bar.value == pytest.approx(0.25) and w.rows[1].bar.value == pytest.approx(0.5)
    assert w.rows[0].bar.bar_style == "info"
    assert "steps/s" in w.rows[0].stats.value and "ETA" not in w.rows[0].stats.value
    assert "loss" in w.scalars.value and "0.25" in w.scalars.value
    assert "nbdist-step-chart" in w.chart.value and "nbdist-allreduce-chart" in w.chart.value
    assert "running" in w.header.value


def test_failed_rank_turns_red_with_its_reason_and_stays():
    state = RunState([0, 1])
    feed_training(state)
    state.feed([{"rank": 1, "seq": 2, "events": [ev.end(False, T0 + 2, "ValueError: <bad>")]},
                {"rank": 0, "seq": 2, "events": [ev.end(True, T0 + 2)]}])
    state.finish()
    w = RunWidget([0, 1])
    w.show(state.snapshot(), final=True)
    assert w.rows[1].bar.bar_style == "danger" and w.rows[0].bar.bar_style == "success"
    assert "ValueError: &lt;bad&gt;" in w.rows[1].stats.value  # remote text is escaped
    assert "failed" in w.header.value


def test_straggler_is_flagged_on_its_bar():
    state = RunState([0, 1, 2])
    feed_training(state, ranks=(0, 1, 2), slow_rank=2)
    w = RunWidget([0, 1, 2])
    w.show(state.snapshot())
    assert w.rows[2].bar.bar_style == "warning" and "straggler" in w.rows[2].stats.value
    assert "straggler" not in w.rows[0].stats.value


def test_unexpected_rank_gets_a_row():
    state = RunState([0])
    feed_training(state, ranks=(0, 3))
    w = RunWidget([0])
    w.show(state.snapshot())
    assert set(w.rows) == {0, 3} and w.rows[3].box in w.children


def test_throttle_limits_redraws():
    now = [0.0]
    t = Throttle(0.25, clock=lambda: now[0])
    assert t.due() and not t.due()
    now[0] = 0.2
    assert not t.due()
    now[0] = 0.26
    assert t.due()


def test_medium_is_chosen_by_argument_env_and_setting(monkeypatch):
    monkeypatch.delenv("NBDIST_DISPLAY", raising=False)
    assert display_medium() == "text"  # pytest runs no Jupyter kernel
    assert display_medium("widget") == "text"  # degrades without a kernel
    monkeypatch.setenv("NBDIST_DISPLAY", "bogus")
    with pytest.raises(ValueError, match="NBDIST_DISPLAY"):
        display_medium()
    with pytest.raises(ValueError):
        set_display("fancy")


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
    assert len(status_lines) == 2 and "train 49/50" in status_lines[-1]
    assert "nbdist run:" in out  # the summary table
    quiet = make_run_view("quiet", 0, 2)
    assert quiet.dashboard is None and isinstance(quiet.stream, StreamView)


def test_scale_errors_stay_on_the_panel():
    def boom(n):
        raise RuntimeError("cannot <scale>")

    panel = ClusterPanel(lambda: ClusterStatus("none", 0), boom)
    panel.scale(3)
    assert "could not scale to 3" in panel.message.value and "&lt;scale&gt;" in panel.message.value


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
    view = shown[0]["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == dash.widget.model_id  # the widget's own bundle, not a copy
    assert "nbdist-summary" in shown[0]["text/html"]
    assert shown[0]["text/plain"].startswith("nbdist run:")
    assert "running" in dash.widget.header.value
    state.finish()
    dash.close(state.snapshot())
    assert len(shown) == 2 and "finished" in dash.widget.header.value


def test_dashboards_share_one_protocol():
    import inspect

    for cls in (TextDashboard, WidgetDashboard):
        assert isinstance(cls.interval, float)
        assert list(inspect.signature(cls.update).parameters) == ["self", "snap"]
        assert list(inspect.signature(cls.close).parameters) == ["self", "snap"]
