"""``%%distributed --tune`` and the verdicts on real 2-rank gloo groups: trials of a small MLP
cut at their step budget on every rank (none left in a collective), the table, the chosen
setting on a later cell's DDP model, the cell's own argument winning, reset; the same on Dask;
and the verdicts of real runs (ZeRO-1's memory against its formula, heavy exposed
communication, a compute-bound run)."""

from __future__ import annotations

import textwrap

import pytest
from clusters import start_session

from nbdist.errors import TuneError
from nbdist.runtime.measure.spec import DDPSettings
from nbdist.tuning import TRIAL_PREFIX

pytestmark = pytest.mark.timeout(300)

STEPS = 6
SETUP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def make(width=1024):  # 12.6 MiB of gradients: each bucket size tried buckets it apart
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
"""
# A collective right after every optimizer step, and another after the loop: a trial cut on
# one rank but not the other would leave that rank waiting in one of them.
TRAIN = """
model = DDP(make())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for k in range(200):
    loss = model(torch.randn(16, 1024)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    dist.all_reduce(loss.detach().clone())
dist.barrier()
"""
LATER = """
m = DDP(make(){args})
cap = m.bucket_bytes_cap
"""


def mib(cap: int) -> float:
    return cap / 2**20


@pytest.fixture(scope="module")
def ipp():
    s = start_session("ipyparallel")
    try:
        s.run_cell(SETUP)
        yield s
    finally:
        s.stop()


def test_tune_tries_bucket_sizes_cuts_every_trial_and_its_choice_applies_later(ipp, capsys):
    s = ipp
    generation = s.generation
    result = s.tune(TRAIN, STEPS)
    said = capsys.readouterr().out
    frame = result.to_pandas()
    assert {1, 5, 25, 100} <= set(frame["bucket_cap_mb"].dropna())  # torch's 25: the reference
    assert not frame.loc["bucket_cap_mb=1", "note"].startswith("skipped")
    assert result.rows[0].samples_per_s and result.trials >= len(frame)
    assert said.count("nbdist: tune trial") == result.trials
    assert "--tune chose " in said or "--tune kept " in said
    # every trial stopped at its budget on every rank; none left the group broken
    trials = [n for n in s.named if n.startswith(TRIAL_PREFIX)]
    assert TRIAL_PREFIX + "bucket_cap_mb=1" in trials
    for name in trials:
        t = s.named[name].snapshot().trial
        assert t is not None and t.cut and t.steps == STEPS, name
    assert s.generation == generation
    assert s.run_cell("t = torch.ones(1); dist.all_reduce(t); t.item()").data[
        "text/plain"] == "2.0"
    assert set(trials) <= set(s.compare().to_pandas().index)
    # the chosen setting goes on the next DDP model; a value the cell passes wins
    chosen = s.tune_settings()
    assert chosen.label == result.chosen or (result.chosen == "torch's defaults"
                                             and not chosen.given())
    s.run_cell(LATER.format(args=""))
    assert mib(s.pull("cap")) == (chosen.bucket_cap_mb or 25)
    s.run_cell(LATER.format(args=", bucket_cap_mb=2"))
    assert mib(s.pull("cap")) == 2
    assert "dropped the tuned DDP setting" in s.tune_reset()
    s.run_cell(LATER.format(args=""))
    assert mib(s.pull("cap")) == 25


def test_a_profile_setting_applies_with_a_note_and_the_cells_argument_wins(ipp, capsys):
    from dataclasses import replace

    s = ipp
    before = s.defaults
    s.defaults = replace(before, measure=replace(before.measure,
                                                 ddp=DDPSettings(bucket_cap_mb=5.0)))
    try:
        s.run_cell(LATER.format(args=""))
        assert mib(s.pull("cap")) == 5
        assert "the profile's (training.ddp) DDP setting applied: bucket_cap_mb=5" in \
            capsys.readouterr().out
        s.run_cell(LATER.format(args=", bucket_cap_mb=1"))
        assert mib(s.pull("cap")) == 1
        assert "the cell's own bucket_cap_mb kept" in capsys.readouterr().out
    finally:
        s.defaults = before


@pytest.mark.parametrize("cell, message", [
    ("x = sum(range(10))", "built no DistributedDataParallel model"),
    (TRAIN.replace("range(200)", "range(3)"), "ended after 3 optimizer steps, before the 6"),
], ids=["no-ddp", "too-short"])
def test_a_cell_that_cannot_be_tuned_gets_one_line(ipp, cell, message):
    with pytest.raises(TuneError, match=message):
        ipp.tune(cell, STEPS)
    assert ipp.tuning.chosen is None


def test_tune_on_dask_chooses_and_applies():
    s = start_session("dask")
    try:
        s.run_cell(SETUP)
        # a small model (one bucket at every size): views, static graph and compression
        small = TRAIN.replace("make()", "make(64)").replace("randn(16, 1024)", "randn(16, 64)")
        result = s.tune(small, 5, quiet=True)
        assert len([r for r in result.rows if r.samples_per_s]) >= 4
        assert sum(r.note.startswith("skipped: one bucket") for r in result.rows) == 3
        s.run_cell(LATER.format(args=""))
        assert mib(s.pull("cap")) == (s.tune_settings().bucket_cap_mb or 25)
    finally:
        s.stop()


# ----------------------------------------------------------------- verdicts of real runs
ZERO_UNEVEN = """
from torch.distributed.optim import ZeroRedundancyOptimizer
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))  # 4160 + 130
zm = DDP(net)
zopt = ZeroRedundancyOptimizer(zm.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
for k in range(6):
    loss = zm(torch.randn(8, 64)).pow(2).mean()
    zopt.zero_grad(); loss.backward(); zopt.step()
"""
COMM_BOUND = """
big = DDP(torch.nn.Linear(1024, 1024))
bopt = torch.optim.SGD(big.parameters(), lr=1e-3)
for k in range(12):
    loss = big(torch.randn(1, 1024)).sum()
    bopt.zero_grad(); loss.backward(); bopt.step()
"""
COMPUTE_BOUND = """
small = DDP(torch.nn.Linear(8, 8))
sopt = torch.optim.SGD(small.parameters(), lr=1e-3)
for k in range(8):
    a = torch.randn(768, 768)
    for _ in range(4):
        a = torch.tanh(a @ a.T / 768)   # the step's compute, outside DDP's backward
    loss = small(a[:4, :8]).sum()
    sopt.zero_grad(); loss.backward(); sopt.step()
"""


def test_zero1_memory_verdict_states_the_formula_and_why_it_is_off(ipp):
    ipp.run_cell(ZERO_UNEVEN, output="quiet")
    [v] = [v for v in ipp.last_run.verdicts if v.rule == "memory"]
    psi = 64 * 64 + 64 + 64 * 2 + 2
    k = v.figure("state_per_param")
    assert k == pytest.approx(8, rel=0.01)  # Adam: two fp32 moments (and a step counter)
    assert v.figure("psi") == psi and v.figure("predicted") == pytest.approx(k * psi / 2)
    assert "ZeRO-1's model predicts" in v.text and "whole tensors" in v.text


def test_heavy_exposed_communication_gets_a_verdict_and_compute_bound_none(ipp):
    ipp.run_cell(COMM_BOUND, output="quiet")
    assert "exposed" in [v.rule for v in ipp.last_run.verdicts]
    ipp.run_cell(COMPUTE_BOUND, output="quiet")
    assert "exposed" not in [v.rule for v in ipp.last_run.verdicts]


def test_the_summary_text_shows_the_verdicts(ipp, capsys):
    ipp.run_cell(COMM_BOUND)
    out = capsys.readouterr().out
    assert "verdict: " in out and "--tune" in textwrap.dedent(out)
