"""A watched job's panel: the record's line over the run's dashboard, refreshed by a thread
of its own while shown (so also while another cell holds the kernel's main thread), drawn
final once the job has ended, then left alone; and the text printed where widgets are not."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

import asyncio  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from synthetic import T0, batches, stack_sleeping, stack_waiting, training_events  # noqa: E402

from nbdist.display import show_job  # noqa: E402
from nbdist.display.widgets import JobPanel  # noqa: E402
from nbdist.telemetry import events as ev  # noqa: E402
from nbdist.watch.watched import RUNNING, Jobs, WatchedJob  # noqa: E402

KEY = "torchrun-p"


def _job():
    jobs = Jobs()
    for rank in (0, 1):
        jobs.fold({"type": "rank", "job": KEY, "rank": rank, "world_size": 2, "host": "n1",
                   "pid": 10 + rank}, 1)
    return jobs, WatchedJob(jobs, jobs.get("1"))


def _steps(jobs, steps, end=False, t0=T0):
    for rank in (0, 1):
        evs = training_events(steps, t0=t0) + ([ev.end(True, t0 + 9)] if end else [])
        for b in batches(rank, evs):
            jobs.fold({"type": "batch", "job": KEY, "batch": b}, 1)


def _stalled():
    """A job that stepped 5 times, then went 30 s without progress: rank 0 waits in the
    all-reduce at line 31 of train.py, rank 1 sleeps at line 28."""
    jobs, job = _job()
    now = time.time()
    _steps(jobs, 5, t0=now - 31)
    done = [{"group": "0", "op": "all_reduce", "seq": 10, "sizes": [[4]], "dtypes": ["Float"],
             "state": "completed", "done": True, "p2p": False}]
    where = {0: stack_waiting(now - 15, 11, line=31, last_done=10),
             1: stack_sleeping(now - 15, line=28, flight=done)}
    for rank, e in where.items():
        for f in e["frames"]:
            if f["cell"]:
                f["file"] = "/work/jobs/train.py"  # the script's own frames
        jobs.fold({"type": "batch", "job": KEY, "batch": {"rank": rank, "seq": 10,
                                                          "events": [e]}}, 1)
    return jobs, job


def _panel(job, interval):
    return JobPanel(lambda: job.record.line(), job.snapshot,
                    lambda: job.record.state != RUNNING, [0, 1], interval=interval)


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_the_panel_follows_the_job_while_shown_and_stops_once_it_ended():
    jobs, job = _job()
    panel = _panel(job, 0.01)
    assert "job 1 (torchrun-p) running" in panel.head.value and panel.refreshes == 1
    assert not _wait(lambda: panel.refreshes > 1, 0.05)  # shown nowhere: no refreshes
    panel._view_count = 1  # the front end drew it
    _steps(jobs, 4)
    assert _wait(lambda: "steps {0: 4, 1: 4}" in panel.head.value
                 and "nbdist-rank-1" in panel.run.table.value)
    for rank in (0, 1):
        jobs.fold({"type": "exit", "job": KEY, "rank": rank, "pid": 10 + rank, "ok": True}, 1)
    jobs.fold({"type": "bye"}, 1)
    assert _wait(lambda: not panel._beside)  # drawn final, then its thread left
    assert panel.interval is None
    assert "finished" in panel.head.value and panel.run.snapshot is not None
    n = panel.refreshes
    assert not _wait(lambda: panel.refreshes > n, 0.05)
    panel.close()


def test_the_panel_refreshes_while_another_cell_holds_the_kernel():
    """The kernel's event loop turns only between cells: a panel refreshed on it would stand
    still while a cell runs. This one follows the job all the same."""
    jobs, job = _job()

    async def kernel():
        panel = _panel(job, 0.01)
        panel._view_count = 1  # shown, from the kernel's loop

        # a cell runs: the loop does not turn until it returns
        feeder = threading.Thread(target=_steps, args=(jobs, 6))  # the collector's frames
        feeder.start()
        feeder.join()
        moved = _wait(lambda: "steps {0: 6, 1: 6}" in panel.head.value)
        n = panel.refreshes
        ticking = _wait(lambda: panel.refreshes >= n + 3)
        panel._view_count = 0  # the output was cleared: refreshing stops
        assert _wait(lambda: not panel._beside)
        n = panel.refreshes
        still = not _wait(lambda: panel.refreshes > n, 0.05)
        panel.close()
        return moved, ticking, still

    moved, ticking, still = asyncio.run(kernel())
    assert moved and ticking and still


def test_the_widget_view_shows_the_rows_steps_state_and_the_hang_doctors_verdict(
        monkeypatch):
    jobs, job = _stalled()
    monkeypatch.setattr("nbdist.display.widgets_available", lambda: True)  # as in a kernel
    panel = job.show()  # what %nbdist job 1 show draws
    assert isinstance(panel, JobPanel)
    head = panel.head.value
    assert "job 1 (torchrun-p) running" in head and "steps {0: 5, 1: 5}" in head
    assert "stalled" in head
    table = panel.run.table.value
    assert "nbdist-rank-0" in table and "nbdist-rank-1" in table
    assert "waiting in all_reduce" in table
    assert "held the others: in time.sleep(0.05) at train.py:28" in table
    verdict = panel.run.stall.value
    assert "rank 0 waits in all_reduce (seq 11, float32 [4])" in verdict
    assert "rank 1 never reached it" in verdict
    assert "train.py:31" in verdict and "in time.sleep(0.05) at train.py:28" in verdict
    panel.close()


def test_without_widgets_the_job_is_printed(capsys):
    jobs, job = _job()
    _steps(jobs, 3, end=True)
    assert show_job(lambda: job.record.line(), job.snapshot, lambda: False, [0, 1],
                    job.summary, mode="text") is None
    out = capsys.readouterr().out
    assert out.startswith(job.record.line()) and "nbdist run:" in out


def test_the_text_view_shows_the_rows_steps_state_and_the_hang_doctors_verdict(capsys):
    jobs, job = _stalled()
    assert job.show() is None  # no kernel here: printed
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("job 1 (torchrun-p) running, 2 ranks on n1, steps {0: 5, 1: 5}, "
                        "stalled (the hang doctor's verdict: show)")
    rows = {line.split()[0]: line for line in lines if line[:1] in "01" and "steps" in line}
    assert "5 steps" in rows["0"] and rows["0"].endswith("running · waiting in all_reduce")
    assert rows["1"].endswith("running · held the others: in time.sleep(0.05) at train.py:28")
    assert any(line.startswith("hang doctor: ") and line.endswith("rank 1 never reached it")
               for line in lines)
    assert ("rank 1: in time.sleep(0.05) at train.py:28; it never reached the all_reduce the "
            "others wait in") in lines


class Outputs:
    """The notebook's outputs, as ``IPython.display.display`` with a display id makes and
    updates them: one list of bundles per display id, the last one what a save keeps."""

    def __init__(self, monkeypatch):
        self.shown: list[list[dict]] = []
        monkeypatch.setattr("IPython.display.display", self.display)

    def display(self, bundle, raw=False, display_id=None):
        if not raw:  # display(panel): IPython's formatter asks the panel to show itself
            from IPython.core.formatters import DisplayFormatter

            assert DisplayFormatter().format(bundle) == ({}, {})
            return None
        assert display_id is True
        shown = [bundle]
        self.shown.append(shown)

        class Handle:
            def update(self, bundle, raw):
                assert raw
                shown.append(bundle)

        return Handle()


WIDGET = "application/vnd.jupyter.widget-view+json"


def saved_whole(bundle):
    """The bundle holds no widget view and its HTML survives a viewer's sanitizer whole."""
    from display.test_static_charts import JUPYTERLAB, visible

    bleach = pytest.importorskip("bleach")
    html = bundle["text/html"]
    return (WIDGET not in bundle and "<svg" not in html and bundle["text/plain"]
            and visible(bleach.clean(html, **JUPYTERLAB)).parts == visible(html).parts)


def test_the_panels_output_carries_html_while_live_and_becomes_static_when_the_job_ends(
        monkeypatch):
    from IPython.core.formatters import DisplayFormatter

    out = Outputs(monkeypatch)
    jobs, job = _job()
    _steps(jobs, 4)
    panel = _panel(job, None)
    # shown as a cell's value or with display(): the panel makes its own output, by id
    assert DisplayFormatter().format(panel) == ({}, {})
    [live] = out.shown[0]
    assert live[WIDGET]["model_id"] == panel.model_id
    # a frontend that draws no widgets shows the job's line and its run's summary
    assert "job 1 (torchrun-p) running" in live["text/html"]
    assert "nbdist-summary" in live["text/html"] and "<svg" not in live["text/html"]
    assert live["text/plain"].startswith("nbdist job 1 (torchrun-p) running")
    panel.refresh()
    assert len(out.shown[0]) == 1  # while the job runs, the widget draws the news
    for rank in (0, 1):
        jobs.fold({"type": "exit", "job": KEY, "rank": rank, "pid": 10 + rank, "ok": True}, 1)
    jobs.fold({"type": "bye"}, 1)
    panel.refresh()  # drawn final: the output becomes the job's static summary
    final = out.shown[0][-1]
    assert len(out.shown[0]) == 2 and saved_whole(final)
    assert "job 1 (torchrun-p) finished" in final["text/html"]
    assert "nbdist-summary" in final["text/html"] and "step" in final["text/plain"]
    panel.refresh()
    assert len(out.shown[0]) == 2
    panel._ipython_display_()  # shown again once it ended: the static summary only
    assert out.shown[1] == [final]
    panel.close()


def test_a_detached_jobs_panel_ends_static(monkeypatch):
    out = Outputs(monkeypatch)
    jobs, job = _job()
    _steps(jobs, 2)
    monkeypatch.setattr("nbdist.display.widgets_available", lambda: True)  # as in a kernel
    panel = job.show()
    assert WIDGET in out.shown[0][0]
    job.detach()
    panel.refresh()  # the panel's next refresh
    final = out.shown[0][-1]
    assert saved_whole(final) and "detached" in final["text/plain"]
    assert panel.interval is None
    panel.close()
