"""The hang doctor on a watched job: the ranks' stack reports, folded with the job's other
events, give the verdict a cell's dashboard gives, with the places named as the script's lines
(``train.py:28``), in the job's record, its line, its text and its panel's snapshot."""

from __future__ import annotations

import time

from synthetic import batches, stack_sleeping, stack_waiting, training_events

from nbdist.telemetry.stall.report import Frame, RankWhere, StallReport
from nbdist.watch.stalls import in_script, script_name, verdict
from nbdist.watch.watched import Jobs, WatchedJob

KEY = "torchrun-p"
SCRIPT = "/work/jobs/train.py"
DONE_10 = [{"group": "0", "op": "all_reduce", "seq": 10, "sizes": [[4]], "dtypes": ["Float"],
            "state": "completed", "done": True, "p2p": False}]


def in_train_py(event):
    """A rank's stack report from the script: its own frames are the script's file's."""
    for f in event["frames"]:
        if f["cell"]:
            f["file"] = SCRIPT
    return event


def stalled_job(idle_s=30.0):
    """A job of two ranks that stepped 5 times; then, ``idle_s`` seconds without progress,
    rank 0 waits in the all-reduce at line 31 and rank 1 sleeps at line 28."""
    jobs = Jobs()
    for rank in (0, 1):
        jobs.fold({"type": "rank", "job": KEY, "rank": rank, "world_size": 2, "host": "n1",
                   "pid": 10 + rank}, 1)
    t0 = time.time() - idle_s - 1
    t = time.time() - idle_s / 2
    where = {0: in_train_py(stack_waiting(t, 11, line=31, last_done=10)),
             1: in_train_py(stack_sleeping(t, line=28, flight=DONE_10))}
    for rank in (0, 1):
        for b in batches(rank, training_events(5, t0=t0) + [where[rank]]):
            jobs.fold({"type": "batch", "job": KEY, "batch": b}, 1)
    return jobs, WatchedJob(jobs, jobs.get("1"))


def test_the_verdict_names_the_rank_the_collective_and_the_scripts_lines():
    jobs, job = stalled_job()
    rec = job.record
    head, *where = rec.stall.splitlines()
    assert head.startswith("no step or collective completed for ")
    assert head.endswith("rank 0 waits in all_reduce (seq 11, float32 [4]); "
                         "rank 1 never reached it")
    assert where == [
        "rank 0: waiting in all_reduce (seq 11, float32 [4]) at train.py:31: dist.all_reduce(t)"
        " (in torch.distributed.distributed_c10d.all_reduce)",
        "rank 1: in time.sleep(0.05) at train.py:28; it never reached the all_reduce the "
        "others wait in"]
    assert rec.line().endswith(", stalled (the hang doctor's verdict: show)")
    assert "cell line" not in rec.stall
    # the text view: the rank's row says who held the others, then the verdict
    text = job.summary()
    assert "held the others: in time.sleep(0.05) at train.py:28" in text
    assert f"hang doctor: {head}" in text and where[1] in text
    assert job.snapshot().stall.script == "train.py"


def test_progress_after_the_reports_ends_the_verdict():
    jobs, job = stalled_job()
    assert job.record.stall is not None
    for rank in (0, 1):  # both went on: a step after their reports
        b = batches(rank, training_events(1, t0=time.time() - 0.5))[0]
        jobs.fold({"type": "batch", "job": KEY, "batch": {**b, "seq": 9}}, 1)
    assert job.record.stall is None and ", stalled" not in job.record.line()


def test_no_verdict_before_the_threshold():
    jobs, job = stalled_job(idle_s=4.0)  # 4 s without progress: under the 10 s floor
    assert job.record.stall is None and verdict(job.snapshot()) is None


def test_a_rank_in_no_frame_of_the_script_leaves_the_places_as_they_are():
    inner = Frame("/x/torch/autograd/graph.py", 825, "torch.autograd.graph.run", False)
    v = StallReport((RankWhere(0, "elsewhere", doing="run", frames=(inner,)),), 12.0)
    assert script_name(v) is None
    assert in_script(None) is None
    here = Frame(SCRIPT, 3, "<module>", True)
    assert script_name(StallReport((RankWhere(0, "elsewhere", frames=(here,)),), 1.0)) \
        == "train.py"
