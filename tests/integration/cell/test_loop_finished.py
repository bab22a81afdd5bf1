"""Uneven inputs on both engines: rank 0 has 5 batches and rank 1 has 3. Without DDP's
``join()`` rank 0 waits in an all-reduce that rank 1, finished, will never call: the cell ends
within seconds (not at the group's timeout) with an error that names the finished rank, the
collective and the remedy, rank 1's row reads done while rank 0 still runs, and the next cell
has a working group. With ``join()`` the same loop trains as torch computes it, the ground
truth being one process that averages each step's gradients over the initial world size.
A barrier only rank 0 calls is named the same way, without DDP's advice; a rank that computes
after its peer finished is left to run."""

from __future__ import annotations

import time

import pytest
import torch

from nbdist.cell import loop as cell_run
from nbdist.display.tables import run_table
from nbdist.errors import RanksFinishedError

pytestmark = pytest.mark.timeout(300)

STEPS = {0: 5, 1: 3}
LR = 0.1
#: far under the group's timeout (60 s, tests/clusters.py) and the cell's, with room for a
#: loaded two-core machine: it ends 2 s after rank 1 finished, plus the interrupt
ENDS_WITHIN_S = 30

TRAIN = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
net = torch.nn.Linear(4, 1)
net.load_state_dict(init_state)
ddp = DDP(net)
opt = torch.optim.SGD(ddp.parameters(), lr=lr)
{join}for i in range(steps[rank]):
{pad}    opt.zero_grad()
{pad}    ddp(data_x[i, rank]).pow(2).mean().backward()
{pad}    opt.step()
final = {{k: v.detach().clone() for k, v in net.state_dict().items()}}
"""
UNEVEN = TRAIN.format(join="", pad="")
JOINED = TRAIN.format(join="with ddp.join():\n    ", pad="    ")

BARRIER = """\
import torch.distributed as dist
if rank == 0:
    dist.barrier()
"""

COMPUTES = """\
import time
import torch
net = torch.nn.Linear(64, 64)
if rank == 0:  # 4 s in torch's code after rank 1 finished, then no collective at all
    until = time.time() + 4
    while time.time() < until:
        net(torch.randn(256, 64))
rank
"""

SUMS = """\
x = torch.arange(3.0) * (rank + 1)
dist.all_reduce(x)
x.tolist()
"""


@pytest.fixture(scope="module")
def data(cluster):
    torch.manual_seed(0)
    init = torch.nn.Linear(4, 1)
    data_x = torch.randn(max(STEPS.values()), len(STEPS), 8, 4)
    cluster.push({"init_state": init.state_dict(), "data_x": data_x, "steps": STEPS,
                  "lr": LR})
    return init.state_dict(), data_x


def rank_1_rows(monkeypatch) -> list[tuple[bool, str]]:
    """Rank 1's row state after each pass of the cell loop, with whether a call still ran."""
    seen: list[tuple[bool, str]] = []
    pump = cell_run.pump

    def watching(job, run, view, *args, **kw):
        pump(job, run, view, *args, **kw)
        [row] = [r for r in run_table(run.snapshot()).rows if r.rank == 1]
        seen.append((bool(job.pending()), row.cells[-1]))

    monkeypatch.setattr(cell_run, "pump", watching)
    return seen


def check_the_group_works(cluster) -> None:
    world = cluster.world_size
    scale = sum(k + 1 for k in range(world))
    value = cluster.run_cell(SUMS, timeout=60)  # the lowest rank's value, as the cell shows it
    assert repr(value) == repr([0.0, scale * 1.0, scale * 2.0])


def test_uneven_inputs_end_the_cell_in_seconds_naming_the_finished_rank_and_join(
        cluster, data, monkeypatch):
    rows = rank_1_rows(monkeypatch)
    start = time.monotonic()
    with pytest.raises(RanksFinishedError) as info:
        cluster.run_cell(UNEVEN, timeout=120, output="quiet")
    took = time.monotonic() - start
    monkeypatch.undo()
    assert took < ENDS_WITHIN_S, took
    e, text = info.value, str(info.value)
    assert (e.finished, e.ranks) == ([1], [0]), text
    assert e.stranded.ddp and e.stranded.waiting[0].collective.op == "all_reduce", text
    assert "Rank 1 finished the cell while rank 0 waits in all_reduce" in text, text
    assert "`with model.join():` (torch.distributed.algorithms.Join)" in text, text
    assert "rank 1: finished the cell" in text and "no report of where" not in text, text
    assert (True, "done") in rows, rows  # while rank 0 still ran
    check_the_group_works(cluster)


def test_a_barrier_only_one_rank_calls_is_named_without_ddp_advice(cluster):
    start = time.monotonic()
    with pytest.raises(RanksFinishedError) as info:
        cluster.run_cell(BARRIER, timeout=120, output="quiet")
    assert time.monotonic() - start < ENDS_WITHIN_S
    text = str(info.value)
    assert "Rank 1 finished the cell while rank 0 waits in barrier" in text, text
    assert "join()" not in text and "called different numbers of collectives" in text, text
    check_the_group_works(cluster)


def test_a_rank_that_computes_after_its_peer_finished_is_left_to_run(cluster):
    value = cluster.run_cell(COMPUTES, timeout=120, output="quiet")
    assert repr(value) == "0"


def test_the_same_loop_under_join_trains_as_torch_computes_it(cluster, data):
    init_state, data_x = data
    cluster.run_cell(JOINED, timeout=120, output="quiet")
    finals = [cluster.pull("final", rank=r) for r in STEPS]
    # the ground truth: one process; each step's gradient is the sum over the ranks that still
    # have a batch, divided by the initial world size (DDP's join() default)
    ref = torch.nn.Linear(4, 1)
    ref.load_state_dict(init_state)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for i in range(max(STEPS.values())):
        opt.zero_grad()
        active = [r for r, n in STEPS.items() if i < n]
        (sum(ref(data_x[i, r]).pow(2).mean() for r in active) / len(STEPS)).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(finals[0][k], finals[1][k]), k
        assert torch.allclose(finals[0][k], v, atol=1e-6), (k, finals[0][k], v)
        assert not torch.equal(v, init_state[k])
