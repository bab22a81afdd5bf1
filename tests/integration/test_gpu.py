"""GPU workers, on each engine: one GPU per rank with NCCL, ranks sharing a GPU with gloo, and
a kernel that never touches CUDA; DDP against ground truth, telemetry from CUDA events, each
cell's GPU memory peak, elastic healing and the hang doctor's reading of NCCL's Flight
Recorder.

Skipped where no GPU is visible, and the tests that need a GPU per rank where fewer than two
are; run them on a GPU host with ``pytest -m gpu``.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch
from clusters import ENGINES, start_session
from elastic_training import SETUP, reference

from nbdist.errors import CellTimeoutError, ClusterError
from nbdist.runtime.env import count_local_gpus
from nbdist.session import Session

GPUS = count_local_gpus()  # nvidia-smi / CUDA_VISIBLE_DEVICES: no CUDA init in this process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (nvidia-smi finds none)"),
]
#: for tests whose point is a collective between GPUs, one per rank
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, one per rank; {GPUS} visible")


@pytest.fixture(scope="module", params=ENGINES)
def gpu_session(request):
    s = start_session(request.param, n=None, timeout=120)  # default: one worker per GPU
    try:
        yield s
    finally:
        s.stop()


def cell(session, code, **kw):
    kw.setdefault("output", "quiet")
    return session.run_cell(textwrap.dedent(code), **kw)


def test_one_worker_per_gpu_with_nccl_and_no_cuda_in_the_kernel(gpu_session):
    assert gpu_session.world_size == GPUS
    cell(gpu_session, """
        import os, torch, torch.distributed as dist
        t = torch.ones(4, device=device) * (rank + 1)
        dist.all_reduce(t)
        info = dict(backend=dist.get_backend(), device=str(device),
                    current=torch.cuda.current_device(), total=t[0].item(),
                    local_rank=int(os.environ["LOCAL_RANK"]),
                    errors=os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"])
    """)
    for r in range(GPUS):
        info = gpu_session.pull("info", rank=r)
        assert info["backend"] == "nccl"
        assert info["device"] == f"cuda:{r}" and info["current"] == r == info["local_rank"]
        assert info["total"] == GPUS * (GPUS + 1) / 2
        assert info["errors"] == "2"  # an NCCL error fails the cell, not the worker
    assert gpu_session.status().dist_backend == "nccl"
    assert not torch.cuda.is_initialized(), "the notebook side must never initialize CUDA"


def ddp_matches_union_batch(session, steps=3, per_rank=4):
    """DDP on the ranks' GPUs, each rank on its slice of each step's batch, against the
    ground truth: one CPU process trained on the union of the slices."""
    world = session.world_size
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(steps, per_rank * world, 8), torch.randn(steps, per_rank * world, 1)
    session.push({"init": net.state_dict(), "x": x, "y": y, "per_rank": per_rank})
    cell(session, f"""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        m.load_state_dict(init)
        ddp = DDP(m.to(device), device_ids=[device.index])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for s in range({steps}):
            lo = rank * per_rank
            xs, ys = x[s, lo:lo + per_rank], y[s, lo:lo + per_rank]
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(xs.to(device)), ys.to(device)).backward()
            opt.step()
    """)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[s]), y[s]).backward()
        opt.step()
    pulled = [session.pull("m", rank=r) for r in range(world)]  # moved to CPU by pull
    for r, model in enumerate(pulled):
        for (k, v), w in zip(net.state_dict().items(), model.state_dict().values()):
            assert w.device.type == "cpu"
            assert torch.allclose(v, w, atol=1e-5), f"rank {r}: {k} differs from ground truth"


def test_ddp_on_nccl_matches_single_process_training_on_the_union_batch(gpu_session):
    ddp_matches_union_batch(gpu_session)


def test_telemetry_times_gpu_buckets_with_cuda_events(gpu_session):
    cell(gpu_session, """
        import torch, nbdist
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 4)).to(device)
        grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
        ddp = DDP(net, bucket_cap_mb=0.02)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for x in nbdist.progress([torch.randn(16, 32) for _ in range(6)], desc="train"):
            loss = ddp(x.to(device)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            nbdist.log(loss=loss)  # .item(): the host waits for the step, events complete
    """)
    grad_bytes = gpu_session.pull("grad_bytes")
    for rank, evs in gpu_session.runs[-1].events().items():
        steps = [e for e in evs if e["kind"] == "step"]
        assert [e["step"] for e in steps] == list(range(6)), rank
        buckets = [e for e in evs if e["kind"] == "comm" and e["bucket"] is not None]
        for n in range(6):
            mine = [b for b in buckets if b["step"] == n]
            assert sum(b["bytes"] for b in mine) == grad_bytes
            # GPU models go through nbdist's hook; CUDA events time every bucket
            assert all(b["measured"] == "wire" and b["t1"] > b["t0"] for b in mine), mine
        assert all(0 <= e["comm_exposed_s"] <= e["t1"] - e["t0"] for e in steps)
    assert all(r.steps == 6 and r.bandwidth for r in gpu_session.last_run.ranks)


def test_the_gpu_memory_peak_is_each_cells_own(gpu_session):
    big = 256 << 20
    train = """
        import torch
        m = torch.nn.Linear(64, 64).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        {extra}
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(8, 64, device=device)).sum().backward()
            opt.step()
    """
    cell(gpu_session, train.format(extra=f"scratch = torch.empty({big}, dtype=torch.uint8, "
                                         "device=device); del scratch"))
    first = [r.memory.device_peak for r in gpu_session.last_run.ranks]
    cell(gpu_session, train.format(extra=""))
    second = [r.memory.device_peak for r in gpu_session.last_run.ranks]
    assert all(p is not None and p >= big for p in first), first
    assert all(p is not None and 0 < p < big for p in second), second  # not the first's


@two_gpus
def test_a_rank_killed_mid_training_on_gpus_heals_and_the_result_matches(gpu_session, tmp_path,
                                                                         capsys):
    """Rank 0 dies: the survivor keeps its GPU (1) as the new rank 0, and the replacement
    takes the GPU that came free (0), not a GPU by its local rank (1, taken)."""
    if gpu_session.world_size != 2:
        pytest.skip("the kill and its ground truth are written for two ranks")
    gpu_session.run_cell("USE_DDP = True\n" + SETUP, output="quiet")
    flag = str(tmp_path / "k")
    gpu_session.run_cell(f"train(state, 60, kill=[(5, 0, {flag!r})])\n"
                         "done = (rank, world_size, state.step, str(device))")
    out = capsys.readouterr().out
    assert os.path.exists(flag) and "died: SIGKILL" in out and "world 1 -> 2" in out, out
    done = sorted(eval(repr(gpu_session.run_cell("done", ranks=str(r)))) for r in range(2))
    assert [d[:3] for d in done] == [(0, 2, 60), (1, 2, 60)]
    assert sorted(d[3] for d in done) == ["cuda:0", "cuda:1"]  # one GPU each, still
    model = gpu_session.pull("state.model")
    model, ref = getattr(model, "module", model), reference(60)
    # cuBLAS sums in another order than the CPU: equal to float32 rounding over 60 steps
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.bias, ref.bias, rtol=1e-4, atol=1e-5)


HANG = """\
import time, torch, torch.distributed as dist
t = torch.ones(4, device=device)
if rank == 1:
    for _ in range(1200):
        time.sleep(0.05)
dist.all_reduce(t)
torch.cuda.synchronize()
"""


@two_gpus
def test_the_hang_doctor_reads_nccls_flight_recorder(gpu_session):
    """On NCCL ``all_reduce`` returns at once; rank 0 then waits in ``synchronize``, and the
    collective it waits for is read from NCCL's own Flight Recorder."""
    t0 = time.monotonic()
    with pytest.raises(CellTimeoutError) as info:
        gpu_session.run_cell(HANG, timeout=6, stall_after=2)
    assert time.monotonic() - t0 < 60  # not NCCL's collective timeout
    where = info.value.where
    assert where.missing == (1,), str(info.value)
    c = where.rank(0).collective
    assert c.op == "all_reduce" and c.group == "default_pg" and c.size == "float32 [4]"
    assert where.rank(0).line == 7 and where.rank(1).line == 5
    # the next cell runs at once (on Dask a rank that did not stop has a fresh process)
    value = gpu_session.run_cell("import torch, torch.distributed as dist\n"
                                 "t = torch.ones(1, device=device) * (rank + 1)\n"
                                 "dist.all_reduce(t)\nt.item()")
    assert repr(value) == str(float(sum(range(1, gpu_session.world_size + 1))))


def test_ranks_that_share_a_gpu_train_with_gloo_and_nccl_there_is_refused(capsys):
    """``-n GPUS + 1``: two ranks on GPU 0. ``auto`` forms gloo and says so in one line, the
    ranks compute on the GPU and DDP still equals ground truth; ``nccl`` is refused."""
    with pytest.raises(ClusterError, match=r"--dist-backend nccl, but ranks 0, \d+ share GPU 0"):
        Session().start(GPUS + 1, dist_backend="nccl", timeout=120)
    capsys.readouterr()
    s = Session().start(GPUS + 1, timeout=120)
    try:
        out = capsys.readouterr().out
        assert "NCCL needs one GPU per rank: the process group uses gloo" in out, out
        status = s.status()
        assert status.dist_backend == "gloo"
        assert all(row.device.startswith("cuda:") for row in status.rows)
        ddp_matches_union_batch(s)
    finally:
        s.stop()
