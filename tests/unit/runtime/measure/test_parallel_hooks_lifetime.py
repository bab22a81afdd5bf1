"""What :mod:`nbdist.runtime.measure.parallel_hooks` attaches for model parallelism (FSDP2's
root forward, ``parallelize_module``'s sample count, meshes' dimension names) lives no longer
than the user's own references, and changes nothing the model computes.

Real FSDP2 and tensor parallelism on a one-rank gloo group in this process, with nbdist's
patches installed as a worker installs them and each cell opened and closed as the worker
does. FSDP2's own state holds reference cycles, so a model is freed by the garbage collector,
not at once: the tests compare with a run without nbdist's patches, model for model.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from synthetic import Sink
from torch.distributed.device_mesh import init_device_mesh

from nbdist.runtime.measure import ddp_hooks, parallel_hooks
from nbdist.runtime.measure.model import measurements
from nbdist.runtime.measure.spec import Measure


@pytest.fixture
def group(tmp_path) -> Iterator[None]:
    """A one-rank gloo group in this process."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def patched() -> Iterator[None]:
    installed_here = not parallel_hooks._original
    parallel_hooks.install()
    try:
        yield
    finally:
        if installed_here:
            parallel_hooks.uninstall()


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train_fsdp(measure: Measure | None) -> tuple[weakref.ref, torch.Tensor]:
    """An FSDP2 model trained 3 steps (in a measured cell where ``measure`` is given): a weak
    reference to it, dropped, and its first weight after training."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    sink = Sink()
    if measure is not None:
        measurements.begin_cell(sink, measure)
    try:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
            opt.step()
    finally:
        if measure is not None:
            measurements.end_cell()
    if measure is not None and measure.telemetry:  # the instrumented path ran
        steps = sink.kinds("step")
        assert len(steps) == 3 and all(e.get("samples") == 5 for e in steps), steps
    weight = model[0].weight.full_tensor().detach().clone()
    ref = weakref.ref(model)
    del model, opt
    return ref, weight


def test_an_fsdp2_model_the_cell_dropped_is_freed_and_trains_as_without_nbdist(group):
    plain, expected = _train_fsdp(None)
    gc.collect()
    assert plain() is None  # FSDP2 alone: freed by the collector
    installed_here = not parallel_hooks._original and not ddp_hooks._original
    parallel_hooks.install()  # as a worker installs them: steps are counted at the optimizer
    ddp_hooks.install()
    try:
        ref, weight = _train_fsdp(Measure(telemetry=True))
        gc.collect()
        assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
        torch.testing.assert_close(weight, expected, rtol=0, atol=0)
    finally:
        if installed_here:
            ddp_hooks.uninstall()
            parallel_hooks.uninstall()


def test_a_tensor_parallel_module_counted_for_samples_is_not_kept(group, patched):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    sink = Sink()
    measurements.begin_cell(sink, Measure(telemetry=True))
    try:
        model = parallelize_module(_model(), mesh, {"0": ColwiseParallel(),
                                                    "2": RowwiseParallel()})
        model(torch.randn(5, 4)).sum().backward()
    finally:
        measurements.end_cell()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
