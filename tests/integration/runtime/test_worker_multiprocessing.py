"""A rank's own child processes, on both engines, as in a plain Python process (torchrun's):
the default multiprocessing start method is the platform's, and DataLoader workers over a
Dataset class defined in a cell run and compute the right sum, with no notice of nbdist's
worker template for the user's forks."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

DATALOADER = """\
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return torch.tensor(float(i * i + rank))

total = sum(b.sum().item() for b in DataLoader(Squares(), batch_size=3, num_workers=2))
total
"""

POOL = """\
import multiprocessing

class Doubler:
    def __call__(self, x):
        return 2 * x + rank

with multiprocessing.Pool(2) as pool:
    doubled = pool.map(Doubler(), range(6))
doubled
"""


def test_the_default_start_method_is_a_plain_processs(cluster):
    plain = subprocess.run([sys.executable, "-c",
                            "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    for r in range(cluster.world_size):
        got = cluster.run_cell("import multiprocessing\nmultiprocessing.get_start_method()",
                               ranks=str(r))
        assert repr(got) == repr(plain), (r, got, plain)


def test_dataloader_workers_over_a_dataset_class_defined_in_the_cell(cluster, capfd):
    for r in range(cluster.world_size):
        got = cluster.run_cell(DATALOADER, ranks=str(r), timeout=120)
        truth = sum(float(i * i + r) for i in range(20))
        assert repr(got) == repr(truth), (r, got, truth)
    out, err = capfd.readouterr()
    assert "worker template" not in out + err and "fresh process" not in out + err


def test_a_pool_over_a_class_defined_in_the_cell(cluster):
    for r in range(cluster.world_size):
        got = cluster.run_cell(POOL, ranks=str(r), timeout=120)
        assert repr(got) == repr([2 * x + r for x in range(6)]), (r, got)
