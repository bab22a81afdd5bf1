"""The fold's seam across ranks, on its own: reports wait for every rank before they are
matched (``StepMatcher``); a rank's own reports are ``test_ranks.py``'s."""

from __future__ import annotations

import pytest

from nbdist.telemetry.matching import MAX_PENDING_COLLECTIVES, StepMatcher
from nbdist.telemetry.ranks import RankFold
from nbdist.telemetry.states import RankState


def matcher(n: int = 2, history: int = 300) -> tuple[StepMatcher, dict[int, RankFold]]:
    ranks: dict[int, RankFold] = {}
    m = StepMatcher(ranks, history)
    for r in range(n):
        ranks[r] = RankFold(history)
        m.active += 1
    return m, ranks


def end(m: StepMatcher, st: RankFold) -> None:
    st.state = RankState.DONE
    m.active -= 1


# ------------------------------------------------------------------ across ranks
def test_a_step_is_matched_when_its_last_report_arrives():
    m, ranks = matcher(2)
    m.steps(0, [0], [(0.10, 0.030, 0.02, 1000, True)])
    assert m.series == {} and m.matched == 0
    m.steps(1, [0], [(0.10, 0.010, 0.02, 1000, True)])
    assert m.matched == 1 and list(m.series) == [0]
    p = m.series[0]
    assert p.waited_for == 1 and p.transfer_s == pytest.approx(0.010)
    assert p.waiting_s == pytest.approx(0.010)  # mean over the ranks: rank 0 waited 20 ms
    assert list(ranks[0].m_waiting) == [pytest.approx(0.020)]
    assert list(ranks[1].m_waiting) == [0.0]
    assert list(ranks[0].m_bw) == [pytest.approx(1000 / 0.02)]
    b = m.blames[0]  # rank 0 waited 20 ms of its 100 ms step for rank 1
    assert (b.rank, b.share, b.waiting_s) == (1, pytest.approx(0.2), pytest.approx(0.020))


def test_steps_of_a_rank_that_ended_no_longer_wait_for_it():
    m, ranks = matcher(3)
    m.steps(0, [0, 1], [(0.1, 0.01, 0.0, 0, True)] * 2)
    m.steps(1, [0, 1], [(0.1, 0.01, 0.0, 0, True)] * 2)
    assert m.matched == 0  # rank 2 may still report
    end(m, ranks[2])
    m.settle_all()
    assert m.matched == 2 and [p.ranks for p in m.series.values()] == [2, 2]


def test_a_report_of_a_rank_that_ended_does_not_stand_in_for_one_still_running():
    m, ranks = matcher(3)
    m.steps(2, [0], [(0.1, 0.01, 0.0, 0, True)])
    end(m, ranks[2])
    m.steps(0, [0], [(0.1, 0.01, 0.0, 0, True)])  # two reports, two ranks running ...
    assert m.matched == 0  # ... but rank 1 has not reported
    m.steps(1, [0], [(0.1, 0.01, 0.0, 0, True)])
    assert m.matched == 1 and m.series[0].ranks == 3


def test_a_step_a_rank_did_not_time_is_not_split():
    m, _ = matcher(2)
    m.steps(0, [0], [(0.1, 0.01, 0.0, 0, True)])
    m.steps(1, [0], [None])
    assert m.matched == 0 and m.series == {}
    m.settle_all()  # nor later: the step is done with
    assert m.matched == 0


def test_a_rank_far_behind_is_given_up_on_past_the_history():
    m, _ = matcher(2, history=3)
    m.steps(0, range(5), [(0.1, 0.01, 0.0, 0, True)] * 5)
    m.steps(1, range(5), [(0.1, 0.01, 0.0, 0, True)] * 5)  # steps 0 and 1 were given up
    assert sorted(m.series) == [2, 3, 4]


def test_collectives_outside_steps_are_matched_by_their_order_per_op():
    m, ranks = matcher(2)
    m.collective(0, "broadcast", 1.0, 1.0, 8)  # untimed: it still takes its place in order
    m.collective(0, "broadcast", 2.0, 2.004, 800)
    m.collective(1, "all_reduce", 2.0, 2.001, 8)  # another op: its own order
    m.collective(1, "broadcast", 1.0, 1.001, 8)
    assert ranks[0].free == ranks[1].free == 0  # broadcast 0 is untimed on rank 0: never matched
    m.collective(1, "broadcast", 2.0, 2.001, 800)
    assert ranks[0].free == ranks[1].free == 1
    assert ranks[0].free_waiting_ns == 3_000_000 and ranks[1].free_waiting_ns == 0
    assert ranks[0].free_transfer_ns == ranks[1].free_transfer_ns == 1_000_000
    assert list(ranks[0].free_bw) == [pytest.approx(800 / 0.001)]


def test_collectives_outside_steps_that_never_match_are_dropped_oldest_first():
    m, _ = matcher(2)
    for k in range(MAX_PENDING_COLLECTIVES + 5):
        m.collective(0, "broadcast", k, k + 0.5, 8)
    assert len(m._free) == MAX_PENDING_COLLECTIVES  # the bound on memory is the point
    assert next(iter(m._free)) == ("broadcast", 5)


# ------------------------------------------------------------------ stragglers at scale
def test_flagged_judges_each_rank_against_the_median_of_the_others_as_defined():
    import random
    import statistics

    from nbdist.telemetry.matching import StragglerScore, flagged

    def by_definition(scores, min_score, min_s):
        out = []
        for r, s in scores.items():
            others = [q for p, q in scores.items() if p != r]
            if (s.score - statistics.median(q.score for q in others) >= min_score
                    and s.caused_s - statistics.median(q.caused_s for q in others) >= min_s):
                out.append(r)
        return out

    rnd = random.Random(7)
    seen = 0
    for n in (2, 3, 4, 5, 8, 33, 64):
        for _ in range(40):
            # few distinct values: ties, and the rank's own value repeated among the others
            scores = {r: StragglerScore(rnd.choice([0.0, 0.05, 0.1, 0.3, 0.6]),
                                        rnd.choice([0.0, 0.001, 0.01, 0.05, 0.2]), 0.0)
                      for r in range(n)}
            want = by_definition(scores, 0.1, 0.005)
            assert flagged(scores, 100, min_score=0.1, min_s=0.005) == want
            seen += bool(want)
    assert seen > 20  # the cases compared include many stragglers, not only none
