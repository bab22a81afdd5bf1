"""DeepSpeed ZeRO-2 on 2 CPU ranks, as a user writes it (``deepspeed.initialize`` with a
``zero_optimization`` stage 2 config over the job's gloo group), with no nbdist line in the
code: in a ``%%distributed`` cell and through ``%nbdist run`` it trains the same weights, bit
for bit, as the same script under a real ``torchrun --nproc_per_node=2``, the cell run again
does too, and the dashboard's record has the engine's optimizer steps, the loss it was given and
its learning rate. DeepSpeed's first initialize on a machine compiles its CPU communication
extension (minutes on a small machine): a fixture builds it once, before anything is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torchrun_runs
from clusters import ENGINES, start_session

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(1500)

STEPS = 3

TRAIN = f'''
import sys
import torch
import deepspeed

CONFIG = {{"train_micro_batch_size_per_gpu": 4,
          "optimizer": {{"type": "Adam", "params": {{"lr": 1e-2, "torch_adam": True}}}},
          "zero_optimization": {{"stage": 2}}}}


def train(out):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                           config=CONFIG)
    rank = torch.distributed.get_rank()
    losses = []
    for step in range({STEPS}):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        torch.save(engine.module.state_dict(), f"{{out}}/weights.pt")
    return losses
'''

MAIN = '''
if __name__ == "__main__":
    train(sys.argv[1])
'''


def weights(out: Path) -> dict:
    return torch.load(out / "weights.pt", weights_only=True)


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"weights differ from torchrun's: {differ}"


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("deepspeed") / "train.py"
    path.write_text(TRAIN + MAIN)
    # its JIT extension, built once here (a no-op once built): ranks that build it meanwhile
    # would wait on its lock, which a killed build leaves behind
    torchrun_runs.run_to_end(
        [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        path.parent, 1200, "building DeepSpeed's CPU communication extension")
    return path


@pytest.fixture(scope="module")
def under_torchrun(script) -> dict:
    """The weights the script saves under torchrun, 2 ranks on this host."""
    out = script.parent / "torchrun"
    out.mkdir()
    torchrun_runs.under_torchrun(script, out)
    return weights(out)


@pytest.fixture(scope="module", params=ENGINES)
def session(request, script):
    s = start_session(request.param, 2)
    try:
        yield s
    finally:
        s.stop()


def test_zero2_in_a_cell_trains_torchruns_weights_and_shows_its_steps_and_loss(
        session, under_torchrun, tmp_path):
    for attempt in ("first", "again"):  # the training cell run again
        out = tmp_path / attempt
        out.mkdir()
        session.run_cell(TRAIN + f"\nlosses = train({str(out)!r})\n", output="quiet",
                         timeout=300)
        assert_same(weights(out), under_torchrun)
        snap = session.last_run
        assert snap is not None and snap.steps == STEPS
        for rank in (0, 1):
            losses = session.pull("losses", rank=rank)
            # read at most every 0.1 s: the first step's loss is always among them
            logged = dict(snap.scalar_series["loss"][rank])
            assert logged and set(logged.values()) <= set(losses)
            assert losses[0] in logged.values()
            assert [v for _, v in snap.scalar_series["lr"][rank]] == [1e-2] * STEPS


def test_zero2_through_nbdist_run_trains_torchruns_weights_and_shows_its_steps_and_loss(
        session, script, under_torchrun, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    before = session.cells.runs[-1] if session.cells.runs else None
    session.run_script(str(script), [str(out)], timeout=300, output="quiet")
    assert_same(weights(out), under_torchrun)
    assert session.cells.runs and session.cells.runs[-1] is not before, "the run recorded nothing"
    snap = session.last_run
    assert snap is not None and snap.steps == STEPS
    for rank in (0, 1):
        assert snap.scalar_series["loss"][rank]  # read at most every 0.1 s
        assert [v for _, v in snap.scalar_series["lr"][rank]] == [1e-2] * STEPS
