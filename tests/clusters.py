"""Starting real clusters for tests: the engines, and a session on one of them."""

from __future__ import annotations

import textwrap

import pytest

from nbdist.backends import registry
from nbdist.session import Session

#: every registered engine: the suites that take ENGINES as a parameter run on each
ENGINES = list(registry.ENGINES)


def engine_available(engine: str) -> bool:
    """Whether the engine's package is installed here (its tests skip where it is not)."""
    return registry.lookup(engine).available()


def start_session(engine: str, n: int = 2, **kw) -> Session:
    if not engine_available(engine):
        pytest.skip(f"the {engine} engine is not available here")
    kw.setdefault("timeout", 60)
    return Session().start(n, engine=engine, **kw)


def check_ddp_matches_union_batch(session: Session, steps: int = 5, per_rank: int = 8,
                                  timeout: float = 120) -> None:
    """Train a small MLP with DDP on every rank of ``session`` (each on its own slice of each
    step's batch) and check the result against the ground truth: one process trained with
    the same optimizer on the union of the slices, which is what DDP's averaged gradients
    compute. Also checks that the ranks agree and that training moved the weights."""
    import torch  # here: the unit tests import this module too, and need no torch

    world, lr = session.world_size, 0.1
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    start = {k: v.clone() for k, v in init.state_dict().items()}
    data_x = torch.randn(steps, world * per_rank, 4)
    data_y = torch.randn(steps, world * per_rank, 1)
    session.push({"init_state": init.state_dict(), "data_x": data_x, "data_y": data_y,
                  "steps": steps, "per_rank": per_rank, "lr": lr})
    session.run_cell(textwrap.dedent("""
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        net.load_state_dict(init_state)
        ddp = DDP(net)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        for s in range(steps):
            lo = rank * per_rank
            x, y = data_x[s, lo:lo + per_rank], data_y[s, lo:lo + per_rank]
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        final = {k: v.detach().clone() for k, v in net.state_dict().items()}
    """), output="quiet", timeout=timeout)
    ref = init
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for s in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(data_x[s]), data_y[s]).backward()
        opt.step()
    finals = [session.pull("final", rank=r) for r in range(world)]
    for k, v in ref.state_dict().items():
        for r in range(1, world):
            assert torch.equal(finals[0][k], finals[r][k]), f"ranks 0 and {r} disagree on {k}"
        assert torch.allclose(finals[0][k], v, atol=1e-6), f"DDP differs from ground truth on {k}"
        assert not torch.equal(v, start[k]), "training did not move the weights"
