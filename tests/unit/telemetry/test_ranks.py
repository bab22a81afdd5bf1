"""The fold's seam within one rank, on its own: a rank's collectives and steps become its
reports (:class:`nbdist.telemetry.ranks.RankFold`)."""

from __future__ import annotations

import pytest

from nbdist.telemetry.ranks import RankFold


def test_collectives_of_a_step_add_up_until_the_step_lands():
    st = RankFold(300)
    st.add_collective(3, 1.0, 1.5, 100)
    st.add_collective(3, 1.2, 2.0, 50)  # overlaps the first: busy 1.0 s, not 1.3 s
    st.add_collective(3, 2.5, 2.5, 30, untimed=True)  # a GPU bucket with no time yet
    reports, untimed_bytes = st.add_steps([3], [0.0], [3.0], [3.0], [8], [0.4])
    assert reports == [(3.0, 0.4, pytest.approx(1.0), 150, False)]
    assert untimed_bytes == 0 and list(st.step_bytes) == [180] and st.comm == {}
    st.add_collective(4, 1.0, 1.1, 10, untimed=True)  # timed, but a bucket of it was not
    (report,), _ = st.add_steps([4], [0.0], [3.0], [3.0], [8], [0.4])
    assert report[4] is False


def test_what_a_worker_summed_adds_to_what_came_one_by_one():
    st = RankFold(300)
    st.add_collective(0, 1.0, 1.2, 10)
    st.add_collectives(0, 40, 30, False, [1.1, 1.5, 2.0, 2.1])  # one untimed 10 bytes
    (report,), _ = st.add_steps([0], [0.0], [3.0], [3.0], [1], [0.2])
    assert report == (3.0, 0.2, pytest.approx(0.6), 40, True)
    assert list(st.step_bytes) == [50]


def test_a_step_without_collectives_and_an_untimed_step():
    st = RankFold(300)
    st.add_collective(1, 0.5, 0.6, 7)
    reports, untimed_bytes = st.add_steps(
        [0, 1], [0.0, 1.0], [1.0, 2.0], [1.0, 1.0], [4, 4], [0.3, 5.0],
        timing=[(True, 0), (False, 200)])
    # the untimed step counts its gradients' bytes and its collectives', but no report
    assert reports == [(1.0, 0.3, 0.0, 0, True), None]
    assert untimed_bytes == 200 and list(st.step_bytes) == [0, 207]
    assert st.steps == 2 and list(st.exposed) == [0.3]  # exposed: timed steps only
