"""Integration, per engine: a session started from a profile file; its cells exported as a script
that torchrun runs to the same trained parameters; the same workers fitting an xgboost.dask
model and then running a %%distributed cell."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from clusters import ENGINES, engine_available

from nbdist.errors import DistributedError
from nbdist.profiles import load_profile, to_options
from nbdist.session import Session

pytestmark = pytest.mark.timeout(300)

PROFILE = """\
cluster:
  engine: {engine}
  workers: 2
runtime:
  device: cpu
  threads: 1
  timeout: 60
  env:
    NBDIST_TEST_FLAG: from-profile
  working_dir: {workdir}
training:
  output: quiet
"""


@pytest.fixture(scope="module", params=ENGINES)
def session(request, tmp_path_factory):
    if not engine_available(request.param):
        pytest.skip(f"the {request.param} engine is not available here")
    workdir = tmp_path_factory.mktemp(f"work-{request.param}")
    path = workdir / "profile.yaml"
    path.write_text(PROFILE.format(engine=request.param, workdir=workdir))
    s = Session().start(profile=str(path))
    try:
        yield s
    finally:
        s.stop()


def cell(session: Session, code: str, **kw):
    return session.run_cell(textwrap.dedent(code), **kw)


def test_the_profile_reaches_every_rank(session, tmp_path):
    workdir = session.options.working_dir
    cell(session, """
        import os, torch
        seen = (os.environ["NBDIST_TEST_FLAG"], os.getcwd(), torch.get_num_threads())
    """)
    for r in range(2):
        assert session.pull("seen", rank=r) == ("from-profile", workdir, 1)
    assert session.defaults.output == "quiet"
    saved = session.save_profile(str(tmp_path / "saved.yaml"))
    assert to_options(load_profile(saved)) == (session.options, session.defaults)


def run_torchrun(script: str, cwd: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """torchrun in its own process group, so that a timeout stops its workers too."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           script]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# Export reads only the session's record, which is the same for both engines: one is enough.
@pytest.mark.parametrize("session", ["ipyparallel"], indirect=True)
def test_export_reproduces_training_under_torchrun(session, tmp_path):
    X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    Y = X @ torch.arange(8.0).unsqueeze(1) + 0.5
    final = tmp_path / "final.pt"
    earlier = len(session.history.cells)  # this module's other tests ran cells too
    session.push({"X": X, "Y": Y, "lr": 0.05, "steps": 25, "out_path": str(final)})
    session.push({"unused": 7})
    cell(session, """
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import nbdist
        dist.init_process_group("gloo")  # as torchrun code does; the group exists already
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    """)
    cell(session, """
        xs, ys = X[rank::world_size], Y[rank::world_size]
        for step in nbdist.progress(range(steps), desc="train"):
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            opt.zero_grad(); loss.backward(); opt.step()
            nbdist.log(loss=loss)
    """)
    cell(session, "print('loss on rank 0:', round(loss.item(), 3))", ranks="0")
    with pytest.raises(DistributedError):
        cell(session, "raise RuntimeError('this cell failed and is not exported')")
    cell(session, """
        if rank == 0:
            torch.save(model.module.state_dict(), out_path)
    """)
    notebook = session.pull("model").state_dict()
    torch.manual_seed(0)
    untrained = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1)).state_dict()
    assert not torch.allclose(notebook["2.weight"], untrained["2.weight"])  # it trained

    script = tmp_path / "train.py"
    exported = session.export(str(script))
    assert (exported.cells, exported.pushes) == (earlier + 4, 1)
    assert exported.command == "torchrun --nproc_per_node=2 train.py"
    text = script.read_text()
    assert "not exported" not in text and "unused" in text and "unused = 7" not in text
    final.unlink()

    proc = run_torchrun(str(script), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss on rank 0:" in proc.stdout
    trained = torch.load(final)
    assert trained.keys() == notebook.keys()
    for k in notebook:
        assert torch.allclose(trained[k], notebook[k], atol=1e-6), k


def test_dask_client_fits_xgboost_then_a_cell_runs_on_the_same_workers(session):
    import dask.array as da
    import xgboost as xgb
    import xgboost.dask  # noqa: F401

    client = session.dask_client()
    assert session.dask_client() is client
    pids = sorted(client.run(os.getpid).values())
    assert pids == sorted(row.pid for row in session.status().rows)

    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 3.0])
    dX, dy = da.from_array(X, chunks=(100, 4)), da.from_array(y, chunks=100)
    out = xgb.dask.train(client, {"objective": "reg:squarederror", "max_depth": 3,
                                  "nthread": 1}, xgb.dask.DaskDMatrix(client, dX, dy),
                         num_boost_round=30)
    pred = xgb.dask.predict(client, out["booster"], dX).compute()
    rmse = float(np.sqrt(np.mean((pred - y) ** 2)))
    assert rmse < 0.2 * float(np.std(y)), rmse  # it learned the function

    value = cell(session, """
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        t.item()
    """)
    assert repr(value) == "3.0"
