"""The order in which :class:`~nbdist.group.membership.Membership` ranks workers when the job
is formed again (after a scale, a restart of ranks): workers that stay keep their ranks, new
ones take the ranks of workers that left and then the next ones, whatever order the engine
lists them in."""

from __future__ import annotations

from nbdist.group.membership import Membership
from nbdist.runtime.env import RankPlan


def job(*workers: str) -> Membership:
    m = Membership(stores=None)
    m.plans = [RankPlan(w, "h", r, r, len(workers), len(workers), 0, 1, "127.0.0.1", 1, None)
               for r, w in enumerate(workers)]
    return m


def test_a_new_job_takes_the_engines_order():
    assert Membership(stores=None).ranked(["b", "a", "c"]) == ["b", "a", "c"]


def test_workers_that_stay_keep_their_ranks_and_new_ones_follow():
    m = job("w0", "w1", "w2")
    # the engine lists a new worker first (a restarted Dask worker's name sorts before)
    assert m.ranked(["new", "w0", "w1", "w2"]) == ["w0", "w1", "w2", "new"]


def test_a_new_worker_takes_the_rank_of_a_worker_that_left():
    m = job("w0", "w1", "w2")
    # ipyparallel lists a replacement engine last, Dask a restarted worker where its name sorts
    assert m.ranked(["w0", "w2", "new"]) == ["w0", "new", "w2"]
    assert m.ranked(["new", "w0", "w2"]) == ["w0", "new", "w2"]
    assert m.ranked(["w0", "w2", "n1", "n2"]) == ["w0", "n1", "w2", "n2"]


def test_ranks_above_one_that_left_move_down_when_no_worker_takes_it():
    m = job("w0", "w1", "w2", "w3")
    assert m.ranked(["w2", "w0", "w3"]) == ["w0", "w2", "w3"]
    assert m.ranked(["w0", "w3", "new"]) == ["w0", "new", "w3"]


def test_new_workers_keep_the_engines_order_among_themselves():
    m = job("w0")
    assert m.ranked(["n2", "w0", "n1"]) == ["w0", "n2", "n1"]
