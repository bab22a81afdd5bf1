"""GPU workers: one GPU per rank, NCCL by default, and a kernel that never touches CUDA.

Skipped where no GPU is visible; run them on a GPU host with ``pytest -m gpu``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from nbdist.errors import ClusterError
from nbdist.runtime.env import count_local_gpus
from nbdist.session import Session

GPUS = count_local_gpus()  # nvidia-smi / CUDA_VISIBLE_DEVICES: no CUDA init in this process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (nvidia-smi finds none)"),
]


@pytest.fixture(scope="module")
def gpu_session():
    s = Session().start(timeout=120)  # default: one worker per GPU
    try:
        yield s
    finally:
        s.stop()


def test_one_worker_per_gpu_with_nccl_and_no_cuda_in_the_kernel(gpu_session):
    assert gpu_session.world_size == GPUS
    gpu_session.run_cell(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        t = torch.ones(4, device=device) * (rank + 1)
        dist.all_reduce(t)
        info = dict(backend=dist.get_backend(), device=str(device),
                    current=torch.cuda.current_device(), total=t[0].item(),
                    local_rank=int(os.environ["LOCAL_RANK"]))
    """), output="quiet")
    for r in range(GPUS):
        info = gpu_session.pull("info", rank=r)
        assert info["backend"] == "nccl"
        assert info["device"] == f"cuda:{r}" and info["current"] == r == info["local_rank"]
        assert info["total"] == GPUS * (GPUS + 1) / 2
    assert not torch.cuda.is_initialized(), "the notebook side must never initialize CUDA"


def test_ddp_on_gpus_matches_cpu_ground_truth(gpu_session):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(3, 4 * GPUS, 8), torch.randn(3, 4 * GPUS, 1)
    gpu_session.push({"init": net.state_dict(), "x": x, "y": y})
    gpu_session.run_cell(textwrap.dedent("""
        from torch.nn.parallel import DistributedDataParallel as DDP
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        m.load_state_dict(init)
        ddp = DDP(m.to(device), device_ids=[device.index])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for s in range(3):
            xs, ys = x[s, rank * 4:(rank + 1) * 4], y[s, rank * 4:(rank + 1) * 4]
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(xs.to(device)), ys.to(device)).backward()
            opt.step()
    """), output="quiet")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[s]), y[s]).backward()
        opt.step()
    pulled = gpu_session.pull("m")  # moved to CPU by pull
    for (k, v), w in zip(net.state_dict().items(), pulled.state_dict().values()):
        assert w.device.type == "cpu"
        assert torch.allclose(v, w, atol=1e-5), k


def test_more_workers_than_gpus_is_refused_for_nccl():
    with pytest.raises(ClusterError, match="one GPU per rank"):
        Session().start(GPUS + 1, timeout=120)
