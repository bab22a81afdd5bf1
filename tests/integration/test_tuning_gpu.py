"""``%%distributed --tune`` on GPU workers (NCCL): bf16 compression joins the grid, the trials
run on the GPUs, and a compression hook set for the session sits in the slot nbdist's GPU
timing hook calls, where the cell's own hook replaces it.

Skipped where no GPU is visible; run them on a GPU host with ``pytest -m gpu``.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest

from nbdist.runtime.env import count_local_gpus
from nbdist.runtime.measure.spec import DDPSettings
from nbdist.session import Session

GPUS = count_local_gpus()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (nvidia-smi finds none)"),
]

SETUP = textwrap.dedent("""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def make():  # 12.6 MiB of gradients: each bucket size tried buckets it apart
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)]).to(device)
""")
TRAIN = textwrap.dedent("""
    model = DDP(make(), device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for k in range(10_000):
        loss = model(torch.randn(64, 1024, device=device)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
""")


@pytest.fixture(scope="module")
def gpu_session():
    s = Session().start(timeout=120)  # one worker per GPU, NCCL
    try:
        s.run_cell(SETUP)
        yield s
    finally:
        s.stop()


def test_tune_on_gpus_tries_bf16_and_its_choice_applies(gpu_session):
    s = gpu_session
    frame = s.tune(TRAIN, 8, quiet=True).to_pandas()
    assert "comm_hook=bf16" in frame.index
    assert {1, 5, 25, 100} <= set(frame["bucket_cap_mb"].dropna())  # none skipped: 12.6 MiB
    s.run_cell("cap = DDP(make(), device_ids=[device.index]).bucket_bytes_cap")
    assert s.pull("cap") / 2**20 == (s.tune_settings().bucket_cap_mb or 25)
    s.tune_reset()


def test_a_session_hook_on_a_gpu_model_gives_way_to_the_cells_own(gpu_session):
    s = gpu_session
    before = s.defaults
    s.defaults = replace(before, measure=replace(before.measure,
                                                 ddp=DDPSettings(comm_hook="fp16")))
    try:
        s.run_cell(textwrap.dedent("""
            m = DDP(make(), device_ids=[device.index])
            first = [h.__name__ for h, _ in m._comm_hooks if h.__name__ != "_timed_hook"]
            m.register_comm_hook(None, default_hooks.bf16_compress_hook)
            then = [h.__name__ for h, _ in m._comm_hooks if h.__name__ != "_timed_hook"]
            m(torch.randn(8, 1024, device=device)).sum().backward()
        """), output="quiet")
        assert s.pull("first") == ["fp16_compress_hook"]
        assert s.pull("then") == ["bf16_compress_hook"]
        [model] = s.last_run.models
        assert model.comm_hook == "bf16" and model.explicit == ("comm_hook",)
    finally:
        s.defaults = before
