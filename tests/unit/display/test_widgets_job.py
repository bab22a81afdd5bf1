"""A watched job's panel: the record's line over the run's dashboard, refreshed on the
kernel's event loop while shown, drawn final once the job has ended, then left alone."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

import asyncio  # noqa: E402

from synthetic import T0, batches, training_events  # noqa: E402

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


def _steps(jobs, steps, end=False):
    for rank in (0, 1):
        evs = training_events(steps) + ([ev.end(True, T0 + 9)] if end else [])
        for b in batches(rank, evs):
            jobs.fold({"type": "batch", "job": KEY, "batch": b}, 1)


def _panel(job, interval):
    return JobPanel(lambda: job.record.line(), job.snapshot,
                    lambda: job.record.state != RUNNING, [0, 1], interval=interval)


def test_the_panel_follows_the_job_while_shown_and_stops_once_it_ended():
    jobs, job = _job()

    async def scenario():
        panel = _panel(job, 0.01)
        assert "job 1 (torchrun-p) running" in panel.head.value and panel.refreshes == 1
        await asyncio.sleep(0.05)
        assert panel.refreshes == 1  # not shown anywhere: no refreshes
        panel._view_count = 1  # the front end drew it
        _steps(jobs, 4)
        for _ in range(300):
            if "steps {0: 4, 1: 4}" in panel.head.value and "nbdist-row" in panel.run.table.value:
                break
            await asyncio.sleep(0.01)
        assert "steps {0: 4, 1: 4}" in panel.head.value
        for rank in (0, 1):
            jobs.fold({"type": "exit", "job": KEY, "rank": rank, "pid": 10 + rank,
                       "ok": True}, 1)
        jobs.fold({"type": "bye"}, 1)
        for _ in range(300):
            if panel._task is None:
                break
            await asyncio.sleep(0.01)
        assert panel._task is None and panel.interval is None  # drawn final, then left
        assert "finished" in panel.head.value and panel.run.snapshot is not None
        n = panel.refreshes
        await asyncio.sleep(0.05)
        assert panel.refreshes == n
        panel.close()

    asyncio.run(scenario())


def test_without_widgets_the_job_is_printed(capsys):
    jobs, job = _job()
    _steps(jobs, 3, end=True)
    assert show_job(lambda: job.record.line(), job.snapshot, lambda: False, [0, 1],
                    job.summary, mode="text") is None
    out = capsys.readouterr().out
    assert out.startswith(job.record.line()) and "nbdist run:" in out
