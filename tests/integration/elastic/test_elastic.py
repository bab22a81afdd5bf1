"""Elastic training on real clusters: ranks are SIGKILLed mid-training inside
``nbdist.elastic.run`` and the cell carries on; the result is checked against an uninterrupted
single-process run of the same steps (the training and its reference: ``elastic_training.py``).
"""

from __future__ import annotations

import os
import time

import pytest
from elastic_training import SETUP, STEPS, assert_trained_like_reference

from nbdist.errors import CellTimeoutError, DistributedError, WorkersGone

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def session(cluster, tmp_path):
    """The module's cluster at full width, with fresh training state."""
    try:
        cluster.run_cell("USE_DDP = False\n" + SETUP)
    except WorkersGone:  # a test before ended with a worker lost for good: the remedy
        cluster.scale(2)
        cluster.run_cell("USE_DDP = False\n" + SETUP)
    assert cluster.world_size == 2
    cluster.flags = tmp_path
    return cluster


def flag(s, name: str) -> str:
    return str(s.flags / name)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_training_heals_and_the_result_is_exact(session, victim, capsys):
    s = session
    t0 = time.monotonic()
    s.run_cell(f"train(state, {STEPS}, kill=[(5, {victim}, {flag(s, 'k')!r})])\n"
               "done = (rank, world_size, state.step)")
    out = capsys.readouterr().out
    assert os.path.exists(flag(s, "k"))  # the kill happened
    assert f"rank {victim} on " in out and "died: SIGKILL" in out, out
    assert "rolled back to commit 6" in out and "world 2 -> 1" in out
    assert "a replacement worker joined" in out and "world 1 -> 2" in out, out
    assert s.world_size == 2
    # The replacement ran the rest of the cell too, as its new rank.
    assert sorted(eval(repr(s.run_cell("done", ranks=str(r)))) for r in range(2)) == [
        (0, 2, STEPS), (1, 2, STEPS)]
    assert_trained_like_reference(s)
    assert time.monotonic() - t0 < 120


def test_ddp_wrappers_are_rebuilt_on_the_new_group(cluster, tmp_path, capsys):
    s = cluster
    try:
        s.run_cell("USE_DDP = True\n" + SETUP)
    except WorkersGone:
        s.scale(2)
        s.run_cell("USE_DDP = True\n" + SETUP)
    s.run_cell(f"train(state, {STEPS}, kill=[(4, 1, {str(tmp_path / 'k')!r})])")
    assert "world 1 -> 2" in capsys.readouterr().out
    # The cell's own name for the wrapper follows the rebuilt one, on every rank.
    for r in range(2):
        assert repr(s.run_cell("model is state.model", ranks=str(r))) == "True"
    assert_trained_like_reference(s)


def test_two_failures_in_one_run(session, capsys):
    s = session
    s.run_cell(f"train(state, {STEPS}, kill=[(5, 1, {flag(s, 'a')!r}), "
               f"(40, 0, {flag(s, 'b')!r})])")
    out = capsys.readouterr().out
    assert os.path.exists(flag(s, "a")) and os.path.exists(flag(s, "b"))
    # each death said once as it happened (the summary's table then keeps each dead worker's row)
    events = [line for line in out.splitlines() if line.startswith("nbdist.elastic")]
    assert sum("died: SIGKILL" in e for e in events) == 2, out
    assert sum("a replacement worker joined" in e for e in events) == 2, out
    assert s.world_size == 2
    assert_trained_like_reference(s)


def test_a_replacement_that_dies_while_being_healed_is_replaced_again(session, capsys):
    s = session
    # The cell's names hold an object that ends the process unpickling it, once: the first
    # replacement dies in the middle of its heal; the next one heals.
    s.run_cell(
        "class Bomb:\n"
        "    def __init__(self, path): self.path = path\n"
        "    def __reduce__(self): return (explode_once, (self.path,))\n"
        "def explode_once(path):\n"
        "    if not os.path.exists(path):\n"
        "        open(path, 'w').close()\n"
        "        os._exit(3)\n"
        "    return None\n"
        f"bomb = Bomb({flag(s, 'bomb')!r})")
    s.run_cell(f"train(state, {STEPS}, kill=[(5, 1, {flag(s, 'a')!r})])")
    out = capsys.readouterr().out
    assert os.path.exists(flag(s, "bomb"))
    assert "a replacement worker joined" in out and "world 1 -> 2" in out, out
    assert s.world_size == 2
    assert_trained_like_reference(s)


def test_the_failure_budget_ends_the_run_with_a_clear_error(session):
    s = session
    s.run_cell("train = nbdist.elastic.run(max_failures=0)(train.fn)")
    with pytest.raises(DistributedError, match=r"max_failures=0"):
        s.run_cell(f"train(state, {STEPS}, kill=[(3, 1, {flag(s, 'k')!r})])")


def test_an_error_in_the_code_is_not_retried_and_stops_every_rank(session):
    s = session
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as info:
        s.run_cell("@nbdist.elastic.run\n"
                   "def broken(state):\n"
                   "    for i in range(100):\n"
                   "        if rank == 1 and i == 3:\n"
                   "            raise ValueError('bad batch')\n"
                   "        t = torch.ones(1)\n"
                   "        dist.all_reduce(t)\n"
                   "        state.commit()\n"
                   "broken(state)")
    assert time.monotonic() - t0 < 30
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[1].ename == "ValueError" and not by_rank[1].caused_by_peer
    assert by_rank[0].ename == "ElasticError" and by_rank[0].caused_by_peer
    assert str(info.value).splitlines()[0] == (
        "cell failed on rank 1: ValueError: bad batch (rank 0 stopped because of it)")
    assert "not from errors in the code" in by_rank[0].evalue
    # Nothing the cell built was lost, and the next cell runs at full width.
    assert s.world_size == 2
    assert repr(s.run_cell("state.step")) == "0"


def test_an_interrupted_run_resumes_from_its_last_commit(session):
    s = session
    with pytest.raises(CellTimeoutError):
        s.run_cell(f"train(state, {STEPS}, pause=0.2)", timeout=3)
    # The next call rolls back to the last commit before going on: no step applied twice.
    s.run_cell(f"train(state, {STEPS}, pause=0)")
    assert_trained_like_reference(s)


def test_state_persists_to_a_directory_and_a_new_cluster_restores_it(session, tmp_path):
    s = session
    d = str(tmp_path / "ckpt")
    s.run_cell(f"state.persist({d!r}, every=5)\ntrain(state, 20, pause=0)")
    assert os.path.exists(os.path.join(d, "nbdist-elastic-state.pt"))
    s.restart()  # the whole cluster is gone; a new one starts from the directory
    s.run_cell("USE_DDP = False\n" + SETUP + f"\nstate.persist({d!r}, every=5)")
    # Commit 1 is train's starting point (step 0), so commit 20, the last one written
    # (every 5th), is step 19.
    assert repr(s.run_cell("state.step")) == "19"
    s.run_cell(f"train(state, {STEPS}, pause=0)")
    assert_trained_like_reference(s)
