"""What :mod:`nbdist.runtime.measure.ddp_hooks` attaches to a model or an optimizer lives no
longer than the user's own references, and changes nothing the user's code computes or raises.

Real DDP on a one-rank gloo group in this process (a FileStore in the test's folder), with
nbdist's patches installed as a worker installs them and each cell opened and closed as the
worker opens and closes it. DDP frees a model when its last reference goes (no reference
cycle of its own), and so must nbdist: the reducer of a model kept alive until the garbage
collector runs still has its hooks on the parameters, and they fire in the next model's
backward ("marked as ready twice"). So the tests look with the collector off.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from synthetic import Sink
from torch.nn.parallel import DistributedDataParallel as DDP

from nbdist.runtime.measure import ddp_hooks, memory, tuning
from nbdist.runtime.measure.model import measurements
from nbdist.runtime.measure.spec import Measure


class TwoHeads(torch.nn.Module):
    """A body and two heads, of which the forward uses one: ``head_a`` gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head_a = torch.nn.Linear(8, 2)
        self.head_b = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_b(torch.relu(self.body(x)))


@pytest.fixture
def group(tmp_path) -> Iterator[None]:
    """A one-rank gloo group and nbdist's DDP patches, as on a worker; gc off meanwhile."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    installed_here = not ddp_hooks._original
    ddp_hooks.install()
    # The first DDP of a process imports parts of torch lazily, and torch keeps frames of that
    # import, the new model's among them: the worker builds one before its first cell too.
    warm = DDP(torch.nn.Linear(2, 2))
    warm(torch.zeros(1, 2)).sum().backward()
    del warm
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        if installed_here:
            ddp_hooks.uninstall()
        dist.destroy_process_group()


class Cell:
    """Opens and closes measurement around a cell's code as the worker's ``run_cell`` does."""

    def __init__(self, measure: Measure) -> None:
        self.measure = measure
        self.sink = Sink()

    def __enter__(self) -> Sink:
        measurements.begin_cell(self.sink, self.measure)
        tuning.begin_cell(self.sink, self.measure)
        return self.sink

    def __exit__(self, *exc: Any) -> None:
        measurements.end_cell()
        tuning.end_cell()


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


MEASURES = {"ddp-timer": Measure(telemetry=True),  # a CPU model timed by DDP's own timer
            "bucket-hook": Measure(telemetry=True, buckets=True),  # nbdist's comm hook
            "telemetry-off": Measure(telemetry=False)}


@pytest.mark.parametrize("measure", MEASURES.values(), ids=MEASURES.keys())
def test_a_ddp_model_the_cell_dropped_is_freed_at_once(group, measure):
    model = TwoHeads()
    with Cell(measure) as sink:
        ddp = DDP(model, find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train(ddp, opt, batches(3))
    if measure.telemetry:  # the model was measured: the test saw the instrumented path
        assert sink.kinds("step")
    wrapper, reducer = weakref.ref(ddp), weakref.ref(ddp.reducer)
    del ddp
    assert wrapper() is None and reducer() is None  # with the collector off, as DDP alone
    assert model.body.weight.grad is not None  # the user's module itself is untouched


@pytest.mark.parametrize("measure", MEASURES.values(), ids=MEASURES.keys())
def test_rebuilding_ddp_after_a_failed_cell_trains_as_without_nbdist(group, measure):
    """An unused head fails the first cell with DDP's own error; the second cell rebuilds DDP
    with ``find_unused_parameters=True`` on the same module and trains it exactly as a plain
    local model (one rank: DDP's average is the rank's own gradient)."""
    model = TwoHeads()
    xs = batches(5)
    with Cell(measure):
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
            train(ddp, opt, xs[:2])
    start = copy.deepcopy(model.state_dict())
    with Cell(measure):
        ddp = DDP(model, find_unused_parameters=True)  # the old wrapper's last reference
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train(ddp, opt, xs)
    truth = TwoHeads()
    truth.load_state_dict(start)
    train(truth, torch.optim.SGD(truth.parameters(), lr=0.1), xs)
    for (name, p), q in zip(model.named_parameters(), truth.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert not torch.equal(model.body.weight, start["body.weight"])  # it did train


def test_an_optimizer_counted_for_steps_is_not_kept(group):
    model = torch.nn.Linear(4, 2)
    with Cell(MEASURES["ddp-timer"]) as sink:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt, batches(2))
    assert [s["source"] for s in sink.kinds("step")] == ["optim", "optim"]
    assert opt in memory.optimizers  # counted for the memory samples, weakly
    ref = weakref.ref(opt)
    del opt
    gc.collect()  # a stepped optimizer is in a cycle of torch's own: the collector frees it
    assert ref() is None and len([o for o in memory.optimizers if o is ref()]) == 0


@pytest.mark.parametrize("measure", MEASURES.values(), ids=MEASURES.keys())
def test_a_measured_model_pickles_and_copies_as_without_nbdist(group, measure):
    with Cell(measure):
        ddp = DDP(TwoHeads(), find_unused_parameters=True)
        train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches(1))
        twin = copy.deepcopy(ddp)
        blob = pickle.dumps(ddp)
        train(twin, torch.optim.SGD(twin.parameters(), lr=0.1), batches(2))
    restored = pickle.loads(blob)
    torch.testing.assert_close(restored(batches(1)[0]), ddp(batches(1)[0]))
    assert getattr(twin, "_nbdist_timer", None) is None  # the copy's reducer is its own
    assert getattr(twin, "_nbdist_slot", None) is None


class Keyword(torch.nn.Module):
    """Takes its batch as a keyword, as Hugging Face models do (``model(**batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, return_dict: bool = True) -> torch.Tensor:
        return self.lin(input_ids)


def test_a_batch_given_as_a_keyword_counts_its_samples(group):
    # Hugging Face's Trainer calls model(**inputs): without the keywords a step has no samples
    # and samples/s reads 0.
    with Cell(Measure(telemetry=True)) as sink:
        model = DDP(Keyword())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in batches(3):
            opt.zero_grad()
            model(input_ids=x, return_dict=True).pow(2).mean().backward()
            opt.step()
    steps = sink.kinds("step")
    assert [s["samples"] for s in steps] == [5, 5, 5]
