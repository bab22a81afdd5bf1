"""The notebook's decisions during an elastic run (:class:`nbdist.elastic.coordinator.Coordinator`),
on fakes: who is in the next group, when to stop, when a replacement gets in."""

from __future__ import annotations

import pickle
from typing import Any, Optional

import pytest

from nbdist.backends.base import Call, Outcome, Submission
from nbdist.elastic.coordinator import Coordinator
from nbdist.group.membership import Membership
from nbdist.options import ClusterOptions
from nbdist.telemetry.events import elastic

KEY = "nbdist/elastic/cell/0"


class FakeJob(Submission):
    def __init__(self, workers: list, done: bool = False) -> None:
        self.running = set() if done else set(workers)
        self.workers = workers

    def wait(self, timeout: Optional[float]) -> bool:
        return not self.running

    def pending(self) -> list:
        return sorted(self.running)

    def outcomes(self) -> list[Outcome]:
        return [Outcome(w, value={"ok": True}) for w in self.workers]

    def drain_events(self) -> list:
        return []


class FakeBackend:
    owns_cluster = True
    controller_ip = "127.0.0.1"

    def __init__(self, workers: list) -> None:
        self.live = list(workers)
        self.added = 0
        self.submitted: list[Call] = []

    def worker_ids(self) -> list:
        return list(self.live)

    def add_worker(self, known: set) -> None:
        self.added += 1

    def exit_cause(self, worker: Any, pid: Optional[int]) -> Optional[str]:
        return "SIGKILL"

    def transport(self):
        return None

    def submit(self, calls: list[Call]) -> Submission:
        self.submitted.extend(calls)
        job = FakeJob([c.worker for c in calls])
        if calls[0].fn.__name__ in ("describe", "set_transport"):
            job.running.clear()
            job.outcomes = lambda: [Outcome(c.worker, value=info(c.worker)) for c in calls]
        return job


def info(w: Any) -> dict:
    return {"worker_id": w, "hostname": "hostA", "pid": 100 + w, "cpu_count": 2,
            "gpu_count": 0, "addresses": [], "route_ip": None}


@pytest.fixture
def setup():
    workers = [0, 1]
    backend = FakeBackend(workers)
    store: dict[str, bytes] = {}

    class Store:
        def set(self, k: str, v: bytes) -> None:
            store[k] = v

    job = FakeJob(workers)
    membership = Membership(stores=None)
    membership.backend, membership.store = backend, Store()
    membership.options = ClusterOptions(timeout=5)
    membership.admit(workers)
    membership.replan(workers)
    membership.generation = 9  # the group the cell started with
    coordinator = Coordinator(membership, {}, default_max_failures=None)
    coordinator.follow(job)
    return coordinator, backend, store, job


def feed(coordinator: Coordinator, worker: int, what: str, **info: Any) -> None:
    ev = elastic(what, 1.0, run=KEY, epoch=info.pop("epoch", 0), worker=str(worker), **info)
    coordinator.feed([{"rank": worker, "seq": 1, "events": [ev]}])
    coordinator.tick()


def plan(store: dict, epoch: int):
    return pickle.loads(store[f"{KEY}/plan/{epoch}"])


def test_the_survivors_form_the_next_group_and_a_replacement_is_asked_for(setup):
    coordinator, backend, store, job = setup
    feed(coordinator, 0, "begin", world=2, commit=1, max_failures=None)
    backend.live.remove(1)  # rank 1's worker died
    job.running.discard(1)
    feed(coordinator, 0, "failed", commit=5, error="RuntimeError: Connection closed by peer",
         world=2)
    # the dead rank is news the moment the plan goes out, before the survivors healed
    [lost] = coordinator.news()
    assert str(lost) == "rank 1 on hostA (pid 101) died: SIGKILL" and lost.rank == 1
    p = plan(store, 1)
    assert list(p.ranks) == ["0"] and p.ranks["0"].rank == 0 and p.ranks["0"].world_size == 1
    assert p.generation == 10 and p.join_expected and p.abort is None
    assert backend.added == 1
    # the job's membership is the plan's from now on: nothing copies it back after the cell
    assert coordinator.membership.plans == list(p.ranks.values())
    assert coordinator.membership.generation == 10
    feed(coordinator, 0, "healed", epoch=1, commit=5, rolled_back=0, discarded=2, seconds=0.1,
         world=1, world_before=2, failures=1, joined=None)
    [line] = coordinator.new_lines()  # the recovery's line; the death was said once, above
    assert "re-formed without rank 1" in line and "died" not in line
    assert "rolled back to commit 5 (2 optimizer steps repeated)" in line
    assert "world 2 -> 1" in line


def test_a_member_that_is_alive_and_has_not_reported_is_waited_for(setup):
    coordinator, backend, store, job = setup
    feed(coordinator, 0, "failed", commit=5, error="x", world=2)
    assert f"{KEY}/plan/1" not in store  # rank 1 is alive and still running: wait for it
    feed(coordinator, 1, "failed", commit=4, error="x", world=2)
    assert list(plan(store, 1).ranks) == ["0", "1"]
    assert backend.added == 0  # nobody was lost


def test_an_error_in_the_code_stops_the_run_with_that_rank_named(setup):
    coordinator, backend, store, job = setup
    feed(coordinator, 1, "stopped", error="ValueError: bad batch")
    p = plan(store, 1)
    assert p.abort and "rank 1 stopped" in p.abort and "ValueError: bad batch" in p.abort
    assert p.stopped_by == 1
    assert not p.ranks


def test_the_failure_budget_ends_the_run(setup):
    coordinator, backend, store, job = setup
    feed(coordinator, 0, "begin", world=2, commit=1, max_failures=0)
    backend.live.remove(1)
    feed(coordinator, 0, "failed", commit=5, error="x", world=2)
    assert "max_failures=0" in plan(store, 1).abort
    assert backend.added == 0


def test_a_new_worker_is_let_in_at_the_next_epoch(setup):
    coordinator, backend, store, job = setup
    backend.live.remove(1)
    job.running.discard(1)
    feed(coordinator, 0, "failed", commit=5, error="x", world=2)
    backend.live.append(2)  # the engine started the replacement
    coordinator.tick()
    p = plan(store, 2)
    assert list(p.ranks) == ["0", "2"] and p.joiner == "2" and p.joiner_slot == 1
    assert 2 in coordinator.membership.infos  # admitted as every worker is: described, connected
    assert [c.fn.__name__ for c in backend.submitted[-3:]] == ["describe", "set_transport",
                                                               "elastic_join"]
    assert store[f"{KEY}/join"] == b"2"
    [(w, _)] = coordinator.joiner_jobs
    assert w == 2
    assert not coordinator.wrap_up_needed([0, 2])  # rank 0 still trains: it will let it in
    assert coordinator.wrap_up_needed([2])  # only the newcomer is left waiting
    coordinator.wrap_up()
    assert "finished before the replacement joined" in plan(store, 3).abort
    assert store[f"{KEY}/join"] == b"-1"
    assert [(p.worker_id, p.world_size) for p in coordinator.membership.plans] == [(0, 1)]


def test_a_replacement_that_healed_is_recorded_with_the_slot_and_step_it_took(setup):
    coordinator, backend, store, job = setup
    backend.live.remove(1)
    job.running.discard(1)
    feed(coordinator, 0, "failed", commit=5, error="x", world=2)
    assert list(coordinator.found_lost) == [1]  # the cell loop records no second death for it
    backend.live.append(2)
    coordinator.tick()
    coordinator.news()
    # the replacement's own report that it healed, at the job's step 20
    feed(coordinator, 2, "healed", epoch=2, commit=20, rolled_back=0, discarded=0, seconds=0.5,
         world=2, world_before=1, failures=1, joined="2", step=20)
    [joined] = coordinator.news()
    assert (joined.kind.value, joined.rank, joined.step) == ("joined", 1, 20)
    assert "a replacement worker joined at commit 20" in joined.line()
    feed(coordinator, 0, "healed", epoch=2, commit=20, rolled_back=0, discarded=0, seconds=0.5,
         world=2, world_before=1, failures=1, joined="2")
    assert [r.kind.value for r in coordinator.news()] == []  # the survivor's report: no second join


def test_what_was_healed_shows_in_the_run_summary_once():
    from nbdist.display.html import run_summary
    from nbdist.telemetry.recovery import Lost, Recovery, RecoveryKind
    from nbdist.telemetry.run import Run

    run = Run("cell", [0, 1], world_size=2)
    lost = Lost(1.0, 1, "hostA", 9, "SIGKILL")
    run.note_recovery(lost)
    run.note_recovery(Recovery(2.0, RecoveryKind.FAILURE, [lost], 2, 1, commit=4))
    html = run_summary(run.snapshot())
    assert html.count("rank 1 on hostA (pid 9) died: SIGKILL") == 1
    assert "nbdist-last-event" in html and "re-formed without rank 1" in html
    assert run.notes == [lost.line(), run.notes[1]] and "world 2 -> 1" in run.notes[1]
