"""A rank that no interrupt stops, on both engines: where the engine restarts its worker
(Dask: ``time.sleep`` in a worker's thread), the fresh process gets the old one's imports
back under the same names, and the error lists only the names really lost; where the
interrupt stops it (ipyparallel's SIGINT ends the sleep), the namespace is whole."""

from __future__ import annotations

import pytest

from nbdist.errors import CellTimeoutError

pytestmark = pytest.mark.timeout(240)

HANGS = """\
import time, torch
import numpy as np
import torch.distributed as dist
from torch import nn
t = torch.ones(2) * rank
if rank == 1:
    time.sleep(600)
"""

USES_THE_IMPORTS = """\
y = torch.from_numpy(np.arange(3.0)) * (rank + 1)
dist.all_reduce(y)
(y.tolist(), type(nn.Linear(1, 1)).__name__, time.__name__)
"""


def test_a_restarted_rank_gets_its_imports_back_and_the_error_lists_what_was_lost(cluster):
    engine = cluster.backend.name
    with pytest.raises(CellTimeoutError) as info:
        cluster.run_cell(HANGS, timeout=3)
    text = str(info.value)
    r = info.value.restarted
    if engine == "dask":
        assert r is not None and r.ranks == (1,) and not r.removed and not r.not_reformed
        assert "Rank 1's namespace is lost (it held: t); its imports are restored: dist, nn, " \
               "np, time, torch." in text, text
    else:
        assert r is None and "namespace is lost" not in text
    # every rank uses the imports, rank 1 included: the sum over ranks of (rank + 1) * [0, 1, 2]
    world = cluster.world_size
    scale = sum(k + 1 for k in range(world))
    value = cluster.run_cell(USES_THE_IMPORTS, timeout=60)
    assert repr(value) == repr(([0.0, scale * 1.0, scale * 2.0], "Linear", "time"))
    for k in range(world):
        held_t = cluster.run_cell("'t' in globals()", ranks=str(k))
        assert repr(held_t) == repr(not (engine == "dask" and k == 1)), (k, held_t)
