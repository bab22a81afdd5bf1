"""The elastic training the elastic tests share (on local clusters, on GPUs, under a real Slurm
and over SSH), and the single-process run its result is checked against.

The training is deterministic and does not depend on the world size: every step takes a fixed
global batch of 16 rows, each rank a strided share, and the summed gradients are all-reduced.
So whatever the group looked like at each step, the final parameters must equal those of plain
training on one process — exactly the commits, nothing applied twice, nothing skipped.
"""

from __future__ import annotations

import torch

STEPS = 60

SETUP = '''
import os, time, torch, torch.distributed as dist, nbdist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = torch.nn.Linear(8, 1).to(device)
model = DDP(net) if USE_DDP else net
opt = torch.optim.SGD(net.parameters(), lr=0.05)
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1)).to(device)
Y = X.sum(1, keepdim=True)
state = nbdist.elastic.State(model=model, optimizer=opt, step=0)

def wait_for_full_width(state):
    """Commit (the same state) until a replacement is in — it joins at a commit — then check
    with one collective that every member is really there (a failure re-runs train)."""
    deadline = time.time() + 120
    while dist.get_world_size() < 2 and time.time() < deadline:
        time.sleep(0.1)
        state.commit()
    dist.all_reduce(torch.ones(1, device=device))

@nbdist.elastic.run
def train(state, steps, kill=(), pause=0.05):
    """kill: (step, rank, flag file) triples: that rank SIGKILLs itself after committing
    that step, once (the flag file says it happened), with the group at full width."""
    while state.step < steps:
        w, r = dist.get_world_size(), dist.get_rank()
        b = torch.arange(16) + (state.step * 16) % 64
        xb, yb = X[b][r::w], Y[b][r::w]
        loss = ((state.model(xb) - yb) ** 2).sum() / 16 * (w if USE_DDP else 1)
        state.optimizer.zero_grad()
        loss.backward()
        if not USE_DDP:
            for p in state.model.parameters():
                dist.all_reduce(p.grad)
        state.optimizer.step()
        state.step += 1
        state.commit()
        time.sleep(pause)
        for step, victim, flag in kill:
            if state.step >= step and not os.path.exists(flag):
                wait_for_full_width(state)
                if dist.get_rank() == victim:
                    open(flag, "w").close()
                    os.kill(os.getpid(), 9)
    if kill:
        wait_for_full_width(state)
'''


def reference(steps: int = STEPS) -> torch.nn.Linear:
    """The same steps on one process, no failures."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    Y = X.sum(1, keepdim=True)
    for step in range(steps):
        b = torch.arange(16) + (step * 16) % 64
        loss = ((net(X[b]) - Y[b]) ** 2).sum() / 16
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


def assert_trained_like_reference(s, steps: int = STEPS) -> None:
    model = s.pull("state.model")
    model = getattr(model, "module", model)
    ref = reference(steps)
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.bias, ref.bias, rtol=1e-5, atol=1e-6)
    assert repr(s.run_cell("state.step")) == str(steps)
