"""Lightning's Trainer and Fabric on 2 ranks, as a user writes them (``strategy="ddp"``,
``devices=2``, ``accelerator="cpu"``), with no nbdist line in the code: in a ``%%distributed``
cell and through ``%nbdist run`` they train the same weights, bit for bit, as the same script
under a real ``torchrun --nproc_per_node=2`` (fit, validate, a checkpoint; Fabric's loop and
``fabric.save``), the cell run again does too, and the dashboard's record has what
``self.log`` and ``fabric.log`` logged, the optimizer steps and the fit's progress. DDP over
gloo on the CPU sums the same gradients in the same order in both, so the weights are equal,
not close. A tiny linear model, fixed data; one cluster per engine for the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torchrun_runs
from clusters import ENGINES, start_session

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(600)

EPOCHS, BATCHES, FABRIC_STEPS = 2, 4, 3  # 32 samples, batches of 4 per rank, 2 ranks

TRAIN = f'''
import sys
import torch
import lightning as L


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data():
    g = torch.Generator().manual_seed(1)
    xy = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g),
                                        torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(xy, batch_size=4)


def fit(out):
    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs={EPOCHS},
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out)
    model = Regression()
    trainer.fit(model, data(), data())
    metrics = trainer.validate(model, data(), verbose=False)
    trainer.save_checkpoint(f"{{out}}/trainer.ckpt")
    return metrics[0]


def fabric_fit(out):
    fabric = L.Fabric(strategy="ddp", devices=2, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = fabric.setup(net, opt)
    losses = []
    for step in range({FABRIC_STEPS}):
        g = torch.Generator().manual_seed(100 * step + fabric.global_rank)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        fabric.log("loss", loss)
        losses.append(loss.item())
    fabric.save(f"{{out}}/fabric.ckpt", {{"model": net}})
    return losses
'''

MAIN = '''
if __name__ == "__main__":
    fit(sys.argv[1])
    fabric_fit(sys.argv[1])
'''


def weights_of_trainer(out: Path) -> dict:
    state = torch.load(out / "trainer.ckpt", weights_only=False)["state_dict"]
    return {f"trainer.{k}": v for k, v in state.items()}


def weights(out: Path) -> dict:
    """The Trainer's and Fabric's saved weights (rank 0 writes both checkpoints)."""
    fabric = torch.load(out / "fabric.ckpt", weights_only=False)["model"]
    return {**weights_of_trainer(out), **{f"fabric.{k}": v for k, v in fabric.items()}}


def assert_same(got: dict, want: dict, which: str) -> None:
    got = {k: v for k, v in got.items() if k.startswith(which)}
    want = {k: v for k, v in want.items() if k.startswith(which)}
    assert got.keys() == want.keys() and got
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"weights differ from torchrun's: {differ}"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lightning") / "train.py"
    path.write_text(TRAIN + MAIN)
    return path


@pytest.fixture(scope="module")
def under_torchrun(script) -> dict:
    """The weights the script saves under torchrun, 2 ranks on this host."""
    out = script.parent / "torchrun"
    torchrun_runs.under_torchrun(script, out)
    return weights(out)


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param, 2)
    try:
        yield s
    finally:
        s.stop()


def test_the_trainer_in_a_cell_trains_torchruns_weights_and_lights_up_the_dashboard(
        session, script, under_torchrun, tmp_path):
    for attempt in ("first", "again"):  # the training cell run again
        out = tmp_path / attempt
        session.run_cell(TRAIN + f"\nmetrics = fit({str(out)!r})\n", output="quiet",
                         timeout=300)
        # fit's last weights (in the checkpoint) are torchrun's
        assert_same(weights_of_trainer(out), under_torchrun, "trainer.")
        run = session.last_run
        assert run is not None and run.steps == EPOCHS * BATCHES
        for name in ("train_loss", "val_loss"):
            assert set(run.scalar_series.get(name, {})) == {0, 1}, name  # every rank's
        validated = session.pull("metrics", rank=0)["val_loss"]
        assert run.scalar_series["val_loss"][0][-1][1] == pytest.approx(validated)
        for r in run.ranks:  # no tqdm bar drawn: the fit's steps are each rank's progress
            assert r.bar is not None and (r.bar.n, r.bar.total) == (EPOCHS * BATCHES,) * 2
            assert r.samples_per_s and r.samples_per_s > 0


def test_fabric_in_a_cell_trains_torchruns_weights_and_logs_to_the_dashboard(
        session, under_torchrun, tmp_path):
    for attempt in ("first", "again"):
        out = tmp_path / attempt
        out.mkdir()
        session.run_cell(TRAIN + f"\nlosses = fabric_fit({str(out)!r})\n", output="quiet",
                         timeout=300)
        state = torch.load(out / "fabric.ckpt", weights_only=False)["model"]
        assert_same({f"fabric.{k}": v for k, v in state.items()}, under_torchrun, "fabric.")
        run = session.last_run
        assert run is not None and run.steps == FABRIC_STEPS
        for rank in (0, 1):  # each rank's own losses, one per fabric.log
            logged = [v for _, v in run.scalar_series["loss"][rank]]
            assert logged == pytest.approx(session.pull("losses", rank=rank))


def test_the_script_through_nbdist_run_trains_torchruns_weights_and_logs_to_the_dashboard(
        session, script, under_torchrun, tmp_path):
    out = tmp_path / "run"
    before = session.cells.runs[-1] if session.cells.runs else None
    session.run_script(str(script), [str(out)], timeout=300, output="quiet")
    got = weights(out)
    assert_same(got, under_torchrun, "trainer.")
    assert_same(got, under_torchrun, "fabric.")
    assert session.cells.runs and session.cells.runs[-1] is not before, "the run recorded nothing"
    run = session.last_run
    assert run is not None and run.steps == EPOCHS * BATCHES + FABRIC_STEPS  # fit, then Fabric
    for name in ("train_loss", "val_loss", "loss"):  # self.log's, then fabric.log's
        assert set(run.scalar_series.get(name, {})) == {0, 1}, name  # every rank's
    assert all(r.samples_per_s and r.samples_per_s > 0 for r in run.ranks)
