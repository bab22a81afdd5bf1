"""``nbdist.elastic.State`` on one process: commit, restore, persist, pickle. (The code a
replacement worker runs to resume a cell: ``test_protocol.py``.)"""

from __future__ import annotations

import pickle

import pytest
import torch

from nbdist.elastic import ElasticError, State, run
from nbdist.runtime.elastic.protocol import Wrapped


def model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    return m, torch.optim.Adam(m.parameters(), lr=0.1)


def step(m, opt):
    loss = m(torch.ones(3, 4)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_restore_brings_back_parameters_optimizer_state_and_values():
    m, opt = model_and_opt()
    s = State(model=m, optimizer=opt, step=0)
    step(m, opt)
    s.step = 1
    s.commit()
    saved = [p.detach().clone() for p in m.parameters()]
    exp_avg = opt.state[m.weight]["exp_avg"].clone()
    for _ in range(3):
        step(m, opt)
    s.step = 4
    s.extra = ["set later"]  # attributes set later are committed from the next commit on
    assert s.restore() == 1
    assert s.step == 1 and s.extra == ["set later"]  # not in commit 1: left as it is
    s.commit()
    s.extra.append("changed")
    assert s.restore() == 2 and s.extra == ["set later"]
    for p, q in zip(m.parameters(), saved):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[m.weight]["exp_avg"], exp_avg, rtol=0, atol=0)


def test_the_commit_is_not_changed_by_training_after_a_restore():
    # Optimizers keep the tensors load_state_dict gives them: the commit must hand a copy.
    m, opt = model_and_opt()
    step(m, opt)
    s = State(model=m, optimizer=opt)
    s.commit()
    first = [p.detach().clone() for p in m.parameters()]
    s.restore()
    step(m, opt)
    step(m, opt)
    s.restore()
    for p, q in zip(m.parameters(), first):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_commits_reuse_their_buffers():
    m, opt = model_and_opt()
    s = State(model=m)
    s.commit()
    s.commit()
    ptr = s.committed()[1]["model"][1]["weight"].data_ptr()
    s.commit()
    s.commit()
    assert s.committed()[1]["model"][1]["weight"].data_ptr() == ptr  # two buffers, alternating
    assert s.commits == 4


def test_restore_without_a_commit_says_what_to_do():
    with pytest.raises(ElasticError, match="call state.commit"):
        State(step=0).restore()


def test_persist_writes_atomically_and_a_new_state_restores(tmp_path):
    m, opt = model_and_opt()
    s = State(model=m, optimizer=opt, step=0).persist(str(tmp_path), every=2)
    for i in range(5):
        step(m, opt)
        s.step = i + 1
        s.commit()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["nbdist-elastic-state.pt"]  # no temporary file left behind
    m2, opt2 = model_and_opt()
    s2 = State(model=m2, optimizer=opt2, step=0).persist(str(tmp_path), every=2)
    assert s2.step == 4 and s2.commits == 4  # the 4th commit was the last one written
    with pytest.raises(ValueError):
        State().persist(str(tmp_path), every=0)


def test_outside_a_cluster_run_is_a_plain_call_that_commits_first():
    calls = []

    @run(max_failures=2)
    def train(state, n):
        calls.append(state.commits)
        return n * 2

    s = State(step=0)
    assert train(s, 21) == 42 and calls == [1]
    with pytest.raises(TypeError, match="nbdist.elastic.State"):
        train(object(), 1)
    with pytest.raises(ValueError):
        run(max_failures=-1)(lambda s: None)


def test_state_pickles_without_its_commit():
    s = State(step=3, name="x")
    s.commit()
    back = pickle.loads(pickle.dumps(s))
    assert back.step == 3 and back.name == "x" and back.committed() is None
    assert back.commits == 1


def test_what_the_loop_reads_and_sets_on_a_state_is_its_public_api():
    m, _ = model_and_opt()
    s = State(model=m, step=0)
    s.unfinished = True  # the State's own flag: not an object a commit records
    assert s.names == ("model", "step") and s.unfinished and s.committed() is None
    s.commit()
    peer = State(model=torch.nn.Linear(4, 2), step=0)
    peer.step = 7
    peer.commit()
    peer.commit()
    s.adopt(peer.committed())  # a commit from a live peer, as healing brings it
    assert s.commits == 2 and s.restore() == 2 and s.step == 7
    torch.testing.assert_close(s.model.weight, peer.model.weight, rtol=0, atol=0)
    with pytest.raises(AttributeError, match="State.names is part of State itself"):
        State(names=["a"])  # the user's object would hide the State's API: said at once


def test_a_model_in_transit_is_committed_through_its_module():
    m, _ = model_and_opt()
    s = State(model=Wrapped(m, {}))
    s.commit()
    kind, snap = s.committed()[1]["model"]
    assert kind == "state_dict" and set(snap) == {"weight", "bias"}
