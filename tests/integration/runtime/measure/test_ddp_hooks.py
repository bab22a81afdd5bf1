"""What nbdist attaches to a DDP model changes nothing the notebook's cells compute or raise, on
both engines, 2 real workers each.

The case: a model with a head its forward never uses fails the first cell with DDP's own
"Expected to have finished reduction" (as under torchrun); the next cell does what that error
says, re-creates DDP on the same module with ``find_unused_parameters=True``, and trains. The
first wrapper's last reference went with the rebinding of ``ddp``: it must be gone then, or
its reducer's hooks on the parameters fire in the new model's backward ("marked as ready
twice"). Under torchrun the wrapper goes when its last reference does (DDP has no reference
cycle), whenever the garbage collector runs: the ranks run these cells with the collector
off, so that they show the same whatever its timing. The second cell's result is checked
against the ground truth, one process trained with the same optimizer on the union of the
ranks' batches.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from nbdist.errors import DistributedError

pytestmark = pytest.mark.timeout(240)

BUILD = """
    import gc, torch, weakref
    gc.disable()  # the cells below see what reference counting alone frees
    from torch.nn.parallel import DistributedDataParallel as DDP

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 8)
            self.head_a = torch.nn.Linear(8, 1)   # never used by forward
            self.head_b = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head_b(torch.tanh(self.body(x)))

    torch.manual_seed(0)
    model = TwoHeads()

    def train(ddp, steps):
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        for s in range(steps):
            lo = rank * per_rank
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(data_x[s, lo:lo + per_rank]),
                                                data_y[s, lo:lo + per_rank])
            loss.backward()
            opt.step()
"""
FIRST = """
    ddp = DDP(model)
    first = weakref.ref(ddp)
    train(ddp, steps)
"""
SECOND = """
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ddp = DDP(model, find_unused_parameters=True)
    first_alive = first() is not None
    train(ddp, steps)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
"""

MODES = {"ddp-timer": {}, "bucket-hook": {"bucket_timing": True}}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_ddp_rebuilt_after_the_unused_parameter_error_trains_as_the_union_batch(cluster, mode):
    s = cluster
    world, steps, per_rank, lr = s.world_size, 4, 6, 0.1
    g = torch.Generator().manual_seed(1)
    data_x = torch.randn(steps, world * per_rank, 4, generator=g)
    data_y = torch.randn(steps, world * per_rank, 1, generator=g)
    s.push({"data_x": data_x, "data_y": data_y, "steps": steps, "per_rank": per_rank,
            "lr": lr})
    try:
        s.run_cell(textwrap.dedent(BUILD), output="quiet", timeout=120, **mode)
        with pytest.raises(DistributedError) as info:
            s.run_cell(textwrap.dedent(FIRST), output="quiet", timeout=120, **mode)
        assert sorted(f.rank for f in info.value.failures) == list(range(world))
        assert all("Expected to have finished reduction" in f.evalue
                   for f in info.value.failures), [f.evalue[:200] for f in info.value.failures]
        s.run_cell(textwrap.dedent(SECOND), output="quiet", timeout=120, **mode)
    finally:
        s.run_cell("import gc\ngc.enable()", output="quiet", timeout=60)
    assert [s.pull("first_alive", rank=r) for r in range(world)] == [False] * world

    start = s.pull("start", rank=0)
    finals = [s.pull("final", rank=r) for r in range(world)]
    truth = torch.nn.ModuleDict({"body": torch.nn.Linear(4, 8), "head_a": torch.nn.Linear(8, 1),
                                 "head_b": torch.nn.Linear(8, 1)})
    truth.load_state_dict(start)
    opt = torch.optim.SGD(truth.parameters(), lr=lr)
    for n in range(steps):
        opt.zero_grad()
        out = truth["head_b"](torch.tanh(truth["body"](data_x[n])))
        torch.nn.functional.mse_loss(out, data_y[n]).backward()
        opt.step()
    for k, v in truth.state_dict().items():
        for r in range(1, world):
            assert torch.equal(finals[0][k], finals[r][k]), f"ranks 0 and {r} disagree on {k}"
        torch.testing.assert_close(finals[0][k], v, msg=f"DDP differs from the truth on {k}")
    assert not torch.equal(finals[0]["body.weight"], start["body.weight"]), "it did not train"
    assert torch.equal(finals[0]["head_a.weight"], start["head_a.weight"])  # no gradient
