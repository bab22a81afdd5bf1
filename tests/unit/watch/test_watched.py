"""A job's record: the frames its node forwarders send, folded into a Run and a state."""

from __future__ import annotations

from synthetic import T0, batches, training_events

from nbdist.telemetry import events as ev
from nbdist.watch.watched import FAILED, FINISHED, LOST, RUNNING, Jobs

KEY = "torchrun-x"


def _rank(rank, pid, world=2, host="h1", restart=0):
    return {"type": "rank", "job": KEY, "rank": rank, "world_size": world, "local_rank": rank,
            "host": host, "pid": pid, "restart": restart, "t": T0}


def _exit(rank, pid, ok=True, error=None, lost=False, failed_at=None):
    return {"type": "exit", "job": KEY, "rank": rank, "pid": pid, "ok": ok, "error": error,
            "lost": lost, "failed_at": failed_at, "t": T0}


def _train(jobs, rank, steps, conn=1, ok=True):
    evs = training_events(steps) + [ev.end(ok, T0 + 10, None if ok else "ValueError: x")]
    for b in batches(rank, evs):
        jobs.fold({"type": "batch", "job": KEY, "batch": b}, conn)


def test_two_ranks_that_end_well_make_a_finished_job_with_their_steps():
    jobs = Jobs()
    jobs.fold(_rank(0, 100), 1)
    jobs.fold(_rank(1, 101, host="h2"), 2)
    _train(jobs, 0, 6, conn=1)
    (rec,) = jobs.records()
    assert (rec.id, rec.key, rec.world_size, rec.state) == ("1", KEY, 2, RUNNING)
    assert rec.hosts == ("h1", "h2")
    _train(jobs, 1, 6, conn=2)
    jobs.fold(_exit(0, 100), 1)
    assert jobs.records()[0].state == RUNNING  # rank 1 has not said its end
    jobs.fold(_exit(1, 101), 2)
    assert jobs.records()[0].state == RUNNING  # until the nodes' launchers end
    jobs.fold({"type": "bye", "code": 0}, 1)
    jobs.closed(2)
    rec = jobs.records()[0]
    assert rec.state == FINISHED and rec.steps == {0: 6, 1: 6} and rec.error is None
    job = jobs.get("1")
    assert job is jobs.get(KEY) and job.run.ended is not None
    # its figures, and no trace: nothing writes one for a watched job
    assert job.run.recorded and job.run.trace_events == 0 and job.run.events() == {}


def test_a_rank_that_ends_with_an_error_fails_the_job_and_says_it():
    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 100 + r), 1)
    jobs.fold(_exit(1, 101, ok=False, error="ValueError: bad batch"), 1)
    jobs.fold(_exit(0, 100, ok=False, lost=True), 1)
    assert jobs.records()[0].error == "ValueError: bad batch"
    jobs.closed(1)
    rec = jobs.records()[0]
    assert rec.state == FAILED and rec.error == "ValueError: bad batch"
    assert "rank 1 (pid 101 on h1) failed: ValueError: bad batch" in jobs.get("1").notes


def test_a_status_the_script_raised_fails_the_rank_its_own_end_said_ended_well():
    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 100 + r), 1)
        _train(jobs, r, 3)  # both ends say ok: a raise SystemExit(3) is not seen by the rank
    jobs.fold(_exit(0, 100), 1)
    jobs.fold(_exit(1, 101, ok=False, error="exited with status 3", failed_at=T0 + 11), 1)
    jobs.closed(1)
    rec = jobs.records()[0]
    assert rec.state == FAILED and rec.error == "exited with status 3"
    rows = {r.rank: r for r in jobs.get("1").snapshot().ranks}
    assert str(rows[1].state) == "failed" and rows[1].error == "exited with status 3"
    assert str(rows[0].state) == "done" and rows[0].steps == rows[1].steps == 3


def test_the_error_raised_first_is_the_jobs_error_whichever_rank_reports_first():
    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 100 + r), 1)
    jobs.fold(_exit(0, 100, ok=False, error="RuntimeError: peer closed", failed_at=T0 + 2), 1)
    jobs.fold(_exit(1, 101, ok=False, error="ValueError: bad batch", failed_at=T0 + 1), 1)
    assert jobs.records()[0].error == "ValueError: bad batch"


def test_a_connection_that_ends_while_ranks_run_loses_the_job():
    jobs = Jobs()
    jobs.fold(_rank(0, 100), 1)
    jobs.fold(_rank(1, 101), 2)
    jobs.closed(1)
    assert jobs.records()[0].state == RUNNING  # rank 1's node still reports
    jobs.closed(2)
    assert jobs.records()[0].state == LOST


def test_a_forwarder_that_says_bye_with_every_rank_ended_finishes_the_job():
    jobs = Jobs()
    jobs.fold(_rank(0, 100, world=1), 1)
    jobs.fold(_exit(0, 100), 1)
    jobs.fold({"type": "bye", "code": 0, "t": T0}, 1)
    assert jobs.records()[0].state == FINISHED


def test_an_old_process_exit_does_not_end_its_restarted_rank():
    jobs = Jobs()
    jobs.fold(_rank(0, 100, world=1), 1)
    jobs.fold(_rank(0, 200, world=1, restart=1), 1)
    jobs.fold(_exit(0, 100, ok=False, lost=True), 1)
    assert jobs.get("1").ranks[0].ended is None and jobs.get("1").ranks[0].pid == 200


def test_drops_are_summed_over_ranks_and_places_latest_count_each():
    jobs = Jobs()
    jobs.fold(_rank(0, 100), 1)
    for where, rank, count in (("rank", 0, 3), ("rank", 0, 5), ("node", 0, 2), ("node", 1, 1)):
        jobs.fold({"type": "dropped", "job": KEY, "rank": rank, "where": where,
                   "count": count}, 1)
    rec = jobs.records()[0]
    assert rec.dropped == 8 and "8 batches dropped" in rec.line()


def test_frames_without_a_job_or_before_its_ranks_are_ignored_and_jobs_are_numbered():
    jobs = Jobs()
    jobs.fold({"type": "batch", "job": KEY, "batch": batches(0, training_events(2))[0]}, 1)
    jobs.fold({"type": "rank", "rank": 0}, 1)
    assert jobs.records() == []
    jobs.fold(_rank(0, 1), 1)
    jobs.fold({**_rank(0, 2), "job": "slurm-9"}, 1)
    assert [r.id for r in jobs.records()] == ["1", "2"]
    assert jobs.detach("2").key == "slurm-9" and jobs.detach("slurm-9") is None
    jobs.fold({**_rank(1, 3), "job": "slurm-9"}, 1)  # a detached job's frames are ignored
    assert [r.key for r in jobs.records()] == [KEY]
    jobs.fold({**_rank(0, 4), "job": "slurm-10"}, 1)
    assert [r.id for r in jobs.records()] == ["1", "3"]  # numbers are never reused


def test_a_restart_goes_on_in_the_same_run_with_the_earlier_attempt_kept():
    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 100 + r), 1)
    _train(jobs, 0, 3)
    run = jobs.get("1").run
    jobs.fold(_exit(1, 101, ok=False, lost=True), 1)
    jobs.fold(_exit(0, 100, ok=False, lost=True), 1)
    assert jobs.records()[0].state == RUNNING  # torchrun's process is still there
    for r in (0, 1):
        jobs.fold(_rank(r, 200 + r, restart=1), 1)
    jobs.fold(_exit(1, 101, ok=False, error="late word of the old process"), 1)  # ignored
    for r in (0, 1):
        _train(jobs, r, 5)
        jobs.fold(_exit(r, 200 + r), 1)
    jobs.fold(_rank(1, 101), 1)  # a reconnecting forwarder sends the old attempt again
    jobs.fold({"type": "bye", "code": 0}, 1)
    rec = jobs.records()[0]
    assert (rec.state, rec.restarts, rec.steps, rec.error) == (FINISHED, 1, {0: 5, 1: 5}, None)
    assert "restarted 1x" in rec.line()
    assert jobs.get("1").run is run  # one view across the attempts
    snap = jobs.get("1").snapshot()
    assert [(r.rank, r.steps, r.state.value) for r in snap.ranks] == [(0, 5, "done"),
                                                                      (1, 5, "done")]
    # the first attempt's rows, ended by the deaths the forwarder saw
    assert [(r.rank, r.steps, r.state.value) for r in snap.former] == [(0, 3, "died"),
                                                                       (1, 0, "died")]
    marks = [(m.kind, m.step, m.text.split(": ", 1)[1]) for m in snap.marks]
    assert marks == [("died", None, "rank 1 on h1 (pid 101) died"),  # it never stepped
                     ("died", 3, "rank 0 on h1 (pid 100) died"),
                     ("joined", 3, "rank 0 started again (restart 1)"),
                     ("joined", 3, "rank 1 started again (restart 1)")]
    notes = run.notes
    assert notes == ["rank 1 (pid 101 on h1) ended without saying how: killed, or lost",
                     "rank 0 (pid 100 on h1) ended without saying how: killed, or lost",
                     "the launcher restarted the ranks (restart 1)"]


def test_a_shown_jobs_refresh_takes_one_snapshot_of_its_run(monkeypatch):
    import pytest

    pytest.importorskip("ipywidgets")
    import IPython.display

    import nbdist.display as display
    from nbdist.watch.watched import WatchedJob

    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 10 + r), 1)
        _train(jobs, r, 3)
    job = jobs.get("1")
    taken = []
    snapshot = job.run.snapshot
    monkeypatch.setattr(job.run, "snapshot", lambda *a, **k: taken.append(1) or snapshot())
    monkeypatch.setattr(display, "display_medium", lambda mode=None: "widget")
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)
    panel = WatchedJob(jobs, job).show()
    try:
        taken.clear()
        panel.refresh()
        assert len(taken) == 1  # the header's steps come from the snapshot the panel drew
        assert "running, 2 ranks on h1, steps {0: 3, 1: 3}" in panel.head.value
    finally:
        panel.close()


def test_a_forwarder_that_takes_over_and_says_it_all_again_changes_nothing():
    """A node's new forwarder reads the ranks' spool from its start: who they are, batches
    already folded, ends already known. Each is taken once."""
    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 100 + r), 1)
    _train(jobs, 0, 4)
    jobs.fold(_exit(1, 101, ok=False, lost=True), 1)
    jobs.closed(1)
    for r in (0, 1):  # the new forwarder's connection
        jobs.fold(_rank(r, 100 + r), 2)
    _train(jobs, 0, 4, conn=2)
    jobs.fold(_exit(1, 101, ok=False, lost=True), 2)
    jobs.fold(_exit(0, 100), 2)
    jobs.closed(2)
    rec = jobs.records()[0]
    assert (rec.state, rec.steps, rec.restarts) == (LOST, {0: 4, 1: 0}, 0), rec
    assert jobs.get("1").notes == [
        "rank 1 (pid 101 on h1) ended without saying how: killed, or lost"]
    assert [m.kind for m in jobs.get("1").snapshot().marks] == ["died"]


def test_a_shown_job_refreshes_no_more_often_than_its_ranks_report(monkeypatch):
    """A job of a thousand ranks sends each rank's news every 4 s: its panel redraws every
    4 s, a small job's every second."""
    import pytest

    pytest.importorskip("ipywidgets")
    import IPython.display

    import nbdist.display as display
    from nbdist.telemetry.events import flush_interval
    from nbdist.watch.watched import WatchedJob

    monkeypatch.setattr(display, "display_medium", lambda mode=None: "widget")
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)
    jobs = Jobs()
    for key, world in (("small", 2), ("large", 1024)):
        jobs.fold({**_rank(0, 10), "job": key, "world_size": world}, 1)
    panels = [WatchedJob(jobs, jobs.get(key)).show() for key in ("small", "large")]
    try:
        assert [p.interval for p in panels] == [1.0, flush_interval(1024)] == [1.0, 4.0]
    finally:
        for p in panels:
            p.close()


def test_a_notebook_that_learns_a_running_job_counts_its_steps_and_time_from_the_ranks():
    """A restarted kernel listening again with the token file: the forwarder's batches to
    the notebook before it are gone with that notebook, so the first batch seen here is not
    the rank's first; the job's steps and its start are the ranks' own."""
    jobs = Jobs()
    jobs.fold(_rank(0, 100, world=1), 1)  # the rank began at T0, long before this notebook
    evs = training_events(10) + [ev.end(True, T0 + 10, None)]
    late = [b for b in batches(0, evs, per_batch=4) if b["seq"] >= 3]  # from step 4 on
    assert late[0]["events"][0]["step"] == 4
    for b in late:
        jobs.fold({"type": "batch", "job": KEY, "batch": b}, 1)
    job = jobs.get("1")
    assert jobs.records()[0].steps == {0: 10}  # not the 6 that arrived here
    assert jobs.records()[0].started == T0
    assert job.run.started == T0
    assert any("rank 0: its first 2 batches did not reach this notebook" in n
               for n in job.notes), job.notes


def test_a_notebook_that_saw_a_rank_from_its_start_counts_the_steps_it_folded():
    jobs = Jobs()
    jobs.fold(_rank(0, 100, world=1), 1)
    _train(jobs, 0, 6)
    assert jobs.records()[0].steps == {0: 6}
    assert not jobs.get("1").notes


def test_a_rank_the_job_ended_without_its_end_says_so_in_a_jobs_words_without_an_eta():
    jobs = Jobs()
    jobs.fold(_rank(0, 100, world=1), 1)
    evs = [ev.progress(1, "train", n, 100, T0 + n) for n in range(5)]
    for b in batches(0, evs):
        jobs.fold({"type": "batch", "job": KEY, "batch": b}, 1)
    (row,) = jobs.get("1").snapshot().ranks
    assert row.bar.eta_s is not None  # while it runs, its bar says when it ends
    jobs.closed(1)  # its launcher's connection ended: no word from the rank
    (row,) = jobs.get("1").snapshot().ranks
    assert str(row.state) == "stopped" and "end-of-cell" not in row.error
    assert row.error.startswith("ended without reporting its end"), row.error
    assert row.bar.eta_s is None


def test_stacks_ask_no_rank_of_a_job_that_is_not_running_and_answer_at_once():
    import time

    import pytest

    from nbdist.watch.watched import WatchedJob

    asked = []

    def ask(key, rank, timeout):  # a rank that never answers would cost the whole timeout
        asked.append((key, rank))
        return {r: "(did not answer)" for r in (0, 1) if rank in (None, r)}

    jobs = Jobs()
    for rank in (0, 1):
        jobs.fold(_rank(rank, 10 + rank), 1)
    handle = WatchedJob(jobs, jobs.get(KEY), ask)
    jobs.fold(_exit(0, 10), 1)  # running, rank 0 ended: rank 1 is asked, rank 0 is not
    assert handle.stacks() != {} and asked == [(KEY, None)]
    assert handle.stacks(rank=0) == {} and len(asked) == 1
    jobs.fold(_exit(1, 11, lost=True), 1)  # SIGKILLed: its forwarder says it is lost
    jobs.closed(1)
    assert jobs.records()[0].state == LOST
    t = time.monotonic()
    assert handle.stacks(timeout=10) == {} and handle.stacks(rank=1, timeout=10) == {}
    assert time.monotonic() - t < 1.0 and len(asked) == 1
    with pytest.raises(LookupError, match=r"rank 2 is not in job 1 \(torchrun-x\): its ranks "
                       r"are 0\.\.1 \(world size 2\)"):
        handle.stacks(rank=2)

    jobs = Jobs()  # a connection that ends while its ranks never said their end: lost too
    for rank in (0, 1):
        jobs.fold(_rank(rank, 10 + rank), 1)
    jobs.closed(1)
    assert WatchedJob(jobs, jobs.get(KEY), ask).stacks() == {} and len(asked) == 1


def test_a_forwarding_rank_that_ends_first_leaves_the_job_running_for_the_one_taking_over():
    """Under srun or mpirun the node's forwarder is a rank: ended before its peer (which
    takes over forwarding), its bye does not end the job, whose last rank then reports on a
    connection of its own; a bye once every rank said its end ends it at once."""
    jobs = Jobs()
    for r in (0, 1):
        jobs.fold(_rank(r, 100 + r), 1)
    _train(jobs, 0, 4, conn=1)
    jobs.fold(_exit(0, 100), 1)
    jobs.fold({"type": "bye", "code": 0}, 1)  # rank 0 forwarded, and ended first
    assert jobs.records()[0].state == RUNNING  # not lost: rank 1 has not said its end
    jobs.fold(_rank(1, 101), 2)  # rank 1 forwards now: every connection begins so
    _train(jobs, 1, 4, conn=2)
    jobs.closed(1)  # rank 0's connection, closed after its bye
    assert jobs.records()[0].state == RUNNING
    jobs.fold(_exit(1, 101), 2)
    jobs.fold({"type": "bye", "code": 0}, 2)
    rec = jobs.records()[0]
    assert rec.state == FINISHED and rec.steps == {0: 4, 1: 4}
    rows = {r.rank: str(r.state) for r in jobs.get("1").snapshot().ranks}
    assert rows == {0: "done", 1: "done"}


def test_a_bye_with_a_rank_never_heard_of_ends_the_job_once_its_connection_closes():
    jobs = Jobs()
    jobs.fold(_rank(0, 100), 1)  # of 2 ranks; the other never reported
    jobs.fold(_exit(0, 100), 1)
    jobs.fold({"type": "bye", "code": 0}, 1)
    assert jobs.records()[0].state == RUNNING  # another forwarder may yet carry rank 1
    jobs.closed(1)  # its connection's close, TAKE_OVER seconds on
    assert jobs.records()[0].state == LOST
