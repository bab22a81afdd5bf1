"""The workers' half of tuning on a real one-rank gloo group in this process: a cell's DDP setting
on every model it builds (its own arguments and hooks win), what each model reports, and a
trial cut at its step budget after the outermost optimizer step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from nbdist.runtime.measure import ddp_hooks, tuning  # noqa: E402
from nbdist.runtime.measure.model import measurements  # noqa: E402
from nbdist.runtime.measure.spec import DDPSettings, Measure  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Sink:
    """What a rank's cell emits into, kept in memory."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    ddp_hooks.install()
    yield
    ddp_hooks.uninstall()
    dist.destroy_process_group()


def cell(measure: Measure) -> Sink:
    sink = Sink()
    measurements.begin_cell(sink, measure)
    tuning.begin_cell(sink, measure)
    return sink


def end(sink: Sink) -> list[dict]:
    measurements.end_cell()
    tuning.end_cell()
    return sink.events


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))


def hooks(ddp: DDP) -> list[str]:
    """The comm hooks DDP remembers, less nbdist's timing hook that calls them."""
    return [h.__name__ for h, _ in ddp._comm_hooks if h.__name__ != "_timed_hook"]


def train(ddp: DDP, opt: torch.optim.Optimizer, steps: int) -> int:
    done = 0
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        done += 1
    return done


@pytest.mark.parametrize("telemetry_on", [True, False])
def test_the_cells_setting_goes_on_every_ddp_model_it_builds(group, telemetry_on):
    sink = cell(Measure(telemetry=telemetry_on,
                        ddp=DDPSettings(bucket_cap_mb=5.0, gradient_as_bucket_view=True)))
    ddp = DDP(model())
    assert ddp.bucket_bytes_cap == 5 * 2**20 and ddp.gradient_as_bucket_view
    [built] = sink.kinds("ddp")
    assert built["applied"] == ["bucket_cap_mb", "gradient_as_bucket_view"]
    assert built["explicit"] == [] and built["bucket_cap_mb"] == 5.0
    assert built["params"] == 8 * 8 + 8 + 8 + 1 and built["tensors"] == 4
    assert built["bytes"] == 4 * built["params"]
    end(sink)


def test_what_the_cell_passes_itself_wins(group):
    sink = cell(Measure(ddp=DDPSettings(bucket_cap_mb=5.0, static_graph=True)))
    ddp = DDP(model(), None, None, 0, None, True, None, 1)  # bucket_cap_mb=1, by position
    assert ddp.bucket_bytes_cap == 2**20 and ddp.static_graph
    [built] = sink.kinds("ddp")
    assert built["explicit"] == ["bucket_cap_mb"] and built["applied"] == ["static_graph"]
    end(sink)


@pytest.mark.parametrize("telemetry_on", [True, False])
def test_a_compression_hook_of_the_setting_gives_way_to_the_cells_own(group, telemetry_on):
    sink = cell(Measure(telemetry=telemetry_on, ddp=DDPSettings(comm_hook="fp16")))
    ddp = DDP(model())
    assert hooks(ddp) == ["fp16_compress_hook"]
    assert sink.kinds("ddp")[-1]["comm_hook"] == "fp16"
    assert sink.kinds("ddp")[-1]["applied"] == ["comm_hook"]
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 2)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # not refused: the cell wins
    assert hooks(ddp) == ["allreduce_hook"]
    last = sink.kinds("ddp")[-1]
    assert last["comm_hook"] == "allreduce_hook" and last["explicit"] == ["comm_hook"]
    assert last["applied"] == []
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 2)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's rule still holds
    end(sink)


def test_a_model_without_a_setting_reports_torchs_defaults(group):
    sink = cell(Measure())
    DDP(model())
    [built] = sink.kinds("ddp")
    assert built["bucket_cap_mb"] == 25.0 and built["applied"] == []
    assert built["comm_hook"] is None
    end(sink)


class Nested(torch.optim.SGD):
    """Steps an inner optimizer inside its own step, as ZeRO's does."""

    def __init__(self, params: list, inner: torch.optim.Optimizer) -> None:
        super().__init__(params, lr=0.1)
        self.inner = inner

    def step(self, closure=None):  # type: ignore[override]
        self.inner.step()


def test_a_trial_ends_after_its_budget_of_outermost_optimizer_steps(group):
    sink = cell(Measure(trial_steps=3))
    ddp = DDP(model())
    params = list(ddp.parameters())
    opt = Nested(params, torch.optim.SGD(params, lr=0.1))
    steps = 0
    with pytest.raises(tuning.TrialDone):
        for _ in range(10):
            opt.zero_grad()
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()  # ZeRO steps its inner optimizer inside: one step, not two
            steps += 1
    assert steps == 2  # the third step raised, after it was taken
    [trial] = [e for e in end(sink) if e["kind"] == "trial"]
    assert trial == {"kind": "trial", "t": trial["t"], "steps": 3, "cut": True, "budget": 3}


def test_a_cell_that_ends_first_says_how_far_it_got_and_a_plain_cell_says_nothing(group):
    sink = cell(Measure(trial_steps=5))
    ddp = DDP(model())
    assert train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 2) == 2
    [trial] = [e for e in end(sink) if e["kind"] == "trial"]
    assert trial["steps"] == 2 and not trial["cut"]
    sink = cell(Measure())
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 2)
    assert not [e for e in end(sink) if e["kind"] == "trial"]


def test_hooks_are_named_as_a_setting_names_them():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    assert tuning.hook_name(default_hooks.fp16_compress_hook) == "fp16"
    assert tuning.hook_name(default_hooks.bf16_compress_hook) == "bf16"
    assert tuning.hook_name(powerSGD_hook.powerSGD_hook) == "powersgd"
    assert tuning.hook_name(test_hooks_are_named_as_a_setting_names_them) == \
        "test_hooks_are_named_as_a_setting_names_them"


def test_memory_tells_zeros_model_what_the_cells_own_optimizers_hold(group):
    from nbdist.runtime.measure import memory

    old = torch.nn.Linear(100, 100)
    old_opt = torch.optim.SGD(old.parameters(), lr=0.1)
    sink = cell(Measure())
    old(torch.randn(2, 100)).sum().backward()
    old_opt.step()  # stepped in an earlier cell: held by the rank, not part of the model
    end(sink)
    sink = cell(Measure())
    ddp = DDP(model())
    opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    train(ddp, opt, 1)
    held = memory.held()
    psi = 8 * 8 + 8 + 8 + 1
    assert held["params"] == 4 * (psi + 100 * 100 + 100)  # everything the rank holds
    m = held["model"]
    assert (m["elements"], m["local_elements"], m["state_elements"], m["sharding"]) == (
        psi, psi, psi, "none")
    assert m["params"] == m["grads"] == 4 * psi and m["optimizer"] == 8 * psi + 4 * 4
    end(sink)
    del old_opt
