"""Accelerate on 2 ranks, as a user writes it, with no nbdist line in the code: ``prepare``,
``backward``, ``gather_for_metrics`` and ``end_training`` in a ``%%distributed`` cell, the cell
run again (a second ``Accelerator()`` after ``end_training``, which destroyed the process
group), and the same through ``%nbdist run``, give the same weights and gathered predictions,
bit for bit, as the same script under a real ``torchrun --nproc_per_node=2``; the dashboard's
record has what ``accelerator.log`` logged on every rank and the prepared model's steps. One
cluster per engine for the module.

(Under torchrun a second ``Accelerator()`` in the same process after ``end_training`` fails:
Accelerate's state outlives the group it destroyed. In a notebook the next cell is where the
second one is made, and the ranks' group is formed again for it.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torchrun_runs
from clusters import ENGINES, start_session

pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(600)

STEPS = 8  # batches of 8 of 128 samples, on 2 ranks

TRAIN = '''
import os
import sys
import torch
from accelerate import Accelerator


def train(out):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(128, 4, generator=g),
                                          torch.randn(128, 1, generator=g))
    test = torch.utils.data.TensorDataset(torch.randn(13, 4, generator=g))  # uneven: padded
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    test_loader = torch.utils.data.DataLoader(test, batch_size=4)
    model, opt, loader, test_loader = acc.prepare(model, opt, loader, test_loader)
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        acc.log({"loss": loss.detach(), "lr": opt.param_groups[0]["lr"]})
    model.eval()
    with torch.no_grad():
        preds = torch.cat([acc.gather_for_metrics(model(x)) for (x,) in test_loader])
    acc.wait_for_everyone()
    if acc.is_main_process:
        os.makedirs(out, exist_ok=True)
        torch.save({"weights": acc.unwrap_model(model).state_dict(), "preds": preds},
                   os.path.join(out, "result.pt"))
    acc.end_training()
    return preds
'''

MAIN = '''
if __name__ == "__main__":
    train(sys.argv[1])
'''


def result(out: Path) -> dict:
    return torch.load(out / "result.pt")


def assert_same(got: dict, want: dict) -> None:
    assert got["preds"].shape == (13, 1)  # gather_for_metrics dropped the padding
    assert torch.equal(got["preds"], want["preds"])
    assert got["weights"].keys() == want["weights"].keys()
    assert all(torch.equal(got["weights"][k], want["weights"][k]) for k in want["weights"])


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("accelerate") / "train.py"
    path.write_text(TRAIN + MAIN)
    return path


@pytest.fixture(scope="module")
def under_torchrun(script) -> dict:
    out = script.parent / "torchrun"
    torchrun_runs.under_torchrun(script, out)
    return result(out)


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param, 2)
    try:
        yield s
    finally:
        s.stop()


def test_accelerate_in_a_cell_trains_torchruns_weights_and_logs_to_the_dashboard(
        session, script, under_torchrun, tmp_path):
    for attempt in ("first", "again"):  # again: a second Accelerator after end_training
        out = tmp_path / attempt
        session.run_cell(TRAIN + f"\npreds = train({str(out)!r})\n", output="quiet",
                         timeout=300)
        assert_same(result(out), under_torchrun)
        run = session.last_run
        assert run is not None and run.steps == STEPS
        loss = run.scalar_series.get("loss", {})
        assert set(loss) == {0, 1} and all(len(v) == STEPS for v in loss.values())
        assert {v for _, v in run.scalar_series["lr"][1]} == {0.1}
        assert all(r.samples_per_s and r.samples_per_s > 0 for r in run.ranks)


def test_accelerate_through_nbdist_run_trains_torchruns_weights_and_logs_to_the_dashboard(
        session, script, under_torchrun, tmp_path):
    before = session.cells.runs[-1] if session.cells.runs else None
    session.run_script(str(script), [str(tmp_path)], timeout=300, output="quiet")
    assert_same(result(tmp_path), under_torchrun)
    assert session.cells.runs and session.cells.runs[-1] is not before, "the run recorded nothing"
    run = session.last_run
    assert run is not None and run.steps == STEPS
    loss = run.scalar_series.get("loss", {})
    assert set(loss) == {0, 1} and all(len(v) == STEPS for v in loss.values())
    assert {v for _, v in run.scalar_series["lr"][1]} == {0.1}
