"""On both engines, three ranks on one host: during a cell, the two higher ranks hand their
batches of figures to rank 0, which sends them with its own (:mod:`nbdist.runtime.node_relay`);
their output goes straight. Every step and every line of output arrives, each rank's in the
order it was written; when the relay dies, its peers' output still all arrives and their
figures go straight again."""

from __future__ import annotations

import textwrap

import pytest
from clusters import ENGINES, start_session

pytestmark = pytest.mark.timeout(300)

STEPS = 40

CELL = """\
import time, nbdist
import torch.distributed as dist
me = dist.get_rank()
for i in nbdist.progress(range({steps}), desc="steps"):
    if i in (5, 25):
        print(f"rank {{me}} line {{i}}")
    if me == 2 and i == 20:
        print("y" * 400_000)
    time.sleep(0.04)
"""

COUNTS = """\
from nbdist.runtime.worker import current
counts = (current().sink.relayed, current().sink.handed, current().sink.declined)
"""


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param, n=3, timeout=120)  # three engines, under the suite's load
    yield s
    s.stop()


def test_a_hosts_ranks_send_through_its_lowest_and_nothing_is_lost_or_reordered(session,
                                                                                 capsys):
    session.run_cell(textwrap.dedent(CELL.format(steps=STEPS)), output="all")
    out, _ = capsys.readouterr()
    for r in (0, 1, 2):
        mine = [line for line in out.splitlines() if line.startswith(f"[{r}] ")]
        expected = [f"[{r}] rank {r} line {i}" for i in (5, 25)]
        if r == 2:
            expected.insert(1, "[2] " + "y" * 400_000)
        assert mine == expected
    snap = session.runs[-1].snapshot()
    assert [row.bar.n for row in snap.ranks] == [STEPS] * 3

    session.run_cell(COUNTS, output="quiet")
    relayed, handed, declined = zip(*(session.pull("counts", rank=r) for r in (0, 1, 2)))
    # The cell lasted about 1.6 s, a batch every 0.25 s from each rank: rank 0 relayed those
    # of its peers' that held figures only (not the first, which may come before the relay
    # was bound, nor the last, which rides in the result)
    assert relayed[0] >= 4 and relayed[1:] == (0, 0)
    assert handed[0] == 0 and min(handed[1:]) >= 2
    assert relayed[0] == sum(handed)


DIES = """\
import os, time, nbdist
import torch.distributed as dist
me = dist.get_rank()
for i in nbdist.progress(range({steps}), desc="steps"):
    if me == 0 and i == 10:
        os._exit(3)  # the relay dies
    if me > 0 and i % 10 == 9:
        print(f"rank {{me}} line {{i}}")
    time.sleep(0.04)
"""


def test_when_the_relay_dies_its_peers_output_and_steps_still_arrive(session, capsys):
    from nbdist.errors import DistributedError

    with pytest.raises(DistributedError, match="rank 0"):
        session.run_cell(textwrap.dedent(DIES.format(steps=STEPS)), output="all")
    out, _ = capsys.readouterr()
    for r in (1, 2):
        mine = [line for line in out.splitlines() if line.startswith(f"[{r}] ")]
        assert mine == [f"[{r}] rank {r} line {i}" for i in range(9, STEPS, 10)]
    snap = session.runs[-1].snapshot()
    assert [row.bar.n for row in snap.ranks[1:]] == [STEPS] * 2
    # the module's last test for its engine: the fixture stops the job with its dead rank
