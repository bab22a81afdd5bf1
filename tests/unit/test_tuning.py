"""``%%distributed --tune``'s notebook half on scripted trials: the grid, successive halving,
the choice, the table, the session's default and its notes; and a trial's figures from its
events. The workers' half, and real trials: tests/integration/runtime/measure/test_tuning.py
and tests/integration/test_tuning.py."""

from __future__ import annotations

import sys

import pytest
from synthetic import T0

from nbdist.errors import (
    CellTimeoutError,
    DistributedError,
    OptionError,
    RankFailure,
    TuneError,
)
from nbdist.options import CellDefaults
from nbdist.records import TuneResult
from nbdist.runtime.measure.spec import DDPSettings, Measure
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.trials import figures, steps_of, warmup
from nbdist.tuning import (
    BUCKET_SIZES_MB,
    CHOOSE_MIN_GAIN,
    MIN_STEPS,
    TRIAL_PREFIX,
    TRIAL_TIMEOUT_MIN_S,
    Search,
    Tuning,
    candidates,
)

STEPS = 10


class FakeRun:
    """What a trial's record gives the tuner: the events of two DDP ranks whose steps take
    ``step_s``, and the snapshot they fold into."""

    def __init__(self, setting: DDPSettings, step_s: float, *, done: int = STEPS,
                 budget: int = STEPS, ddp: bool = True, explicit: tuple[str, ...] = ()):
        cap = setting.bucket_cap_mb if "bucket_cap_mb" not in explicit else 1.0
        self.evs = {}
        for r in (0, 1):
            evs = []
            if ddp:
                evs.append(ev.ddp_model(T0, model=0, params=4 * 2**20, tensors=4,
                                        nbytes=16 * 2**20, bucket_cap_mb=cap or 25.0,
                                        gradient_as_bucket_view=False, static_graph=False,
                                        comm_hook=setting.comm_hook,
                                        applied=list(setting.given()), explicit=list(explicit)))
            for n in range(done):
                t = T0 + n * step_s
                evs.append(ev.step(n, t, t + step_s, samples=8, comm_exposed_s=step_s / 4,
                                   comm_bytes=1000))
            evs.append(ev.memory(T0 + 9, params=1, grads=1, optimizer=0, rss=10, peak=100 + r))
            evs.append(ev.trial(T0 + 9, steps=done, cut=done >= budget, budget=budget))
            self.evs[r] = evs

    def events(self):
        return self.evs

    def snapshot(self):
        state = RunState([0, 1])
        state.feed([{"rank": r, "seq": 1, "events": evs} for r, evs in self.evs.items()])
        return state.snapshot()


def scripted(speeds: dict[str, float], default: float = 0.010, **kw):
    """A trial function: each setting's step time by label; the calls it got, in order."""
    calls: list[tuple[str, str]] = []

    def trial(setting: DDPSettings, name: str, timeout) -> FakeRun:
        calls.append((setting.label, name))
        return FakeRun(setting, speeds.get(setting.label, default), **kw)

    return trial, calls


def labels(grid):
    return [s.label for s in grid[0]]


MIB = 2**20


def test_the_grid_tries_bucket_sizes_views_static_graph_and_this_backends_hooks():
    gloo = labels(candidates("nccl", 16 * MIB))
    assert gloo[0] == "torch's defaults" and len(set(gloo)) == len(gloo)
    assert {f"bucket_cap_mb={mb}" for mb in BUCKET_SIZES_MB if mb != 25} <= set(gloo)
    assert {"gradient_as_bucket_view=True", "static_graph=True", "comm_hook=fp16",
            "comm_hook=powersgd", "comm_hook=bf16"} <= set(gloo)
    assert "comm_hook=bf16" not in labels(candidates("gloo", 16 * MIB))
    # PowerSGD stalls on gloo past one bucket: a larger model leaves it out, saying why
    big, left_out = candidates("gloo", 8 * MIB)
    assert "comm_hook=powersgd" not in [s.label for s in big]
    assert "stalls once gradients span more than one bucket (8 MiB of gradients)" in \
        left_out[DDPSettings(comm_hook="powersgd")]
    assert "comm_hook=powersgd" in labels(candidates("gloo", MIB // 2))


@pytest.mark.parametrize("grad_mib, tried, why", [
    (0.5, [], {1: "one bucket, as with torch's defaults (0.5 MiB of gradients)",
               5: "one bucket, as with torch's defaults", 100: "as with torch's defaults"}),
    (3, [1, 5], {100: "one bucket, as with bucket_cap_mb=5 (3 MiB of gradients)"}),
    (40, [1, 5, 100], {}),
])
def test_bucket_sizes_that_give_the_same_buckets_are_tried_once(grad_mib, tried, why):
    grid, left_out = candidates("nccl", int(grad_mib * MIB))
    assert [s.bucket_cap_mb for s in grid if s.bucket_cap_mb] == tried
    for mb, reason in why.items():
        assert reason in left_out[DDPSettings(bucket_cap_mb=float(mb))]


def test_successive_halving_keeps_the_faster_half_and_the_reference_and_combines():
    trial, calls = scripted({"bucket_cap_mb=5": 0.006, "gradient_as_bucket_view=True": 0.008,
                             "bucket_cap_mb=5, gradient_as_bucket_view=True": 0.005,
                             "comm_hook=fp16": 0.004, "static_graph=True": 0.02})
    said: list[str] = []
    t = Tuning()
    result = t.tune(trial, STEPS, "gloo", say=said.append)
    tried = [label for label, _ in calls]
    n1 = len(candidates("gloo", 16 * MIB)[0])
    assert tried[0] == "torch's defaults"  # the warm-up and check
    round1, rest = tried[1:1 + n1], tried[1 + n1:]
    assert sorted(round1) == sorted(labels(candidates("gloo", 16 * MIB)))
    assert "static_graph=True" not in rest and "bucket_cap_mb=100" not in rest  # halved
    assert "bucket_cap_mb=5, gradient_as_bucket_view=True" in rest  # combined after round 1
    assert rest.count("torch's defaults") >= 1  # the reference stays in every round
    assert all(name == TRIAL_PREFIX + label for label, name in calls)
    # fp16 was fastest, but it changes the gradients: the fastest exact setting is chosen
    assert t.chosen == DDPSettings(bucket_cap_mb=5.0, gradient_as_bucket_view=True)
    assert result.chosen == t.chosen.label and result.speedup == pytest.approx(2.0, rel=1e-3)
    assert result.rows[0].setting == "comm_hook=fp16" and result.rows[0].lossy
    assert any("chose bucket_cap_mb=5, gradient_as_bucket_view=True: 2.00x" in s for s in said)
    assert any("comm_hook=fp16 measured 2.50x but changes the gradients" in s for s in said)
    assert len([s for s in said if "tune trial" in s]) == result.trials == len(calls) - 1
    assert "untimed run with torch's defaults" in said[0]


def test_torch_defaults_stay_when_nothing_beats_them_by_the_margin():
    near = 0.010 / (1 + CHOOSE_MIN_GAIN / 2)
    trial, _ = scripted({"bucket_cap_mb=5": near})
    said: list[str] = []
    t = Tuning()
    result = t.tune(trial, STEPS, "gloo", say=said.append)
    assert t.chosen == DDPSettings() and result.chosen == "torch's defaults"
    assert "kept torch's defaults" in said[-1]
    assert t.tuned is not None and t.tuned.speedup is None and t.tuned.knobs == ()


def test_a_trial_that_fails_or_hangs_is_shown_and_the_search_goes_on():
    limits = []

    def trial(setting, name, timeout):
        limits.append(timeout)
        if setting.static_graph:
            failure = RankFailure(0, "h", "RuntimeError", "static graph: the graph changed",
                                  traceback="", communication=False)
            raise DistributedError([failure])
        if setting.comm_hook == "powersgd":
            raise CellTimeoutError(timeout, [0, 1])
        return FakeRun(setting, 0.01)

    said: list[str] = []
    result = Tuning().tune(trial, STEPS, "nccl", say=said.append)  # PowerSGD runs on NCCL
    [row] = [r for r in result.rows if r.setting == "static_graph=True"]
    assert row.note.startswith("failed: ") and "static graph" in row.note
    assert any("static_graph=True): failed" in s for s in said)
    [row] = [r for r in result.rows if r.setting == "comm_hook=powersgd"]
    assert f"ran past {TRIAL_TIMEOUT_MIN_S:.3g} s and was interrupted" in row.note
    assert limits[0] is None and set(limits[1:]) == {TRIAL_TIMEOUT_MIN_S}


def test_the_cell_failing_with_torch_defaults_raises_its_own_error():
    def trial(setting, name, timeout):
        raise DistributedError([RankFailure(0, "h", "ValueError", "bad data", traceback="")])

    with pytest.raises(DistributedError, match="bad data"):
        Tuning().tune(trial, STEPS, "gloo", say=lambda s: None)


@pytest.mark.parametrize("kw, message", [
    ({"ddp": False}, "built no DistributedDataParallel model"),
    ({"done": 4}, "ended after 4 optimizer steps, before the 10"),
])
def test_a_cell_that_cannot_be_tuned_gets_one_line_and_nothing_changes(kw, message):
    trial, calls = scripted({}, **kw)
    t = Tuning()
    with pytest.raises(TuneError, match=message) as info:
        t.tune(trial, STEPS, "gloo", say=lambda s: None)
    assert "\n" not in str(info.value) and len(calls) == 1 and t.chosen is None


def test_too_few_steps_is_a_usage_error():
    with pytest.raises(OptionError, match=f"at least {MIN_STEPS}"):
        Tuning().tune(scripted({})[0], 0, "gloo")


def test_settings_on_knobs_the_cell_sets_itself_are_skipped():
    trial, calls = scripted({}, explicit=("bucket_cap_mb",))
    result = Tuning().tune(trial, STEPS, "gloo", say=lambda s: None)
    assert not any(label.startswith("bucket_cap_mb") for label, _ in calls)
    skipped = [r for r in result.rows if "sets bucket_cap_mb" in r.note]
    assert {r.setting for r in skipped} == {"bucket_cap_mb=1", "bucket_cap_mb=5",
                                            "bucket_cap_mb=100"}
    assert "the cell sets bucket_cap_mb itself" in skipped[0].note


def test_the_chosen_setting_is_the_sessions_default_until_reset():
    t = Tuning()
    profile = CellDefaults(measure=Measure(ddp=DDPSettings(static_graph=True)))
    assert t.defaults(profile) is profile and "profile's training.ddp" in t.show(profile)
    t.tune(scripted({"bucket_cap_mb=5": 0.005})[0], STEPS, "gloo", say=lambda s: None)
    assert t.defaults(profile).measure.ddp == DDPSettings(bucket_cap_mb=5.0)
    assert "bucket_cap_mb=5 (tuned by %%distributed --tune: 2.00x" in t.show(profile)
    said = t.reset(profile)
    assert "dropped the tuned DDP setting (bucket_cap_mb=5)" in said
    assert "the profile's training.ddp (static_graph=True)" in said
    assert t.defaults(profile) is profile
    assert "nothing was tuned" in t.reset(CellDefaults())


def test_a_later_cell_gets_a_note_when_the_setting_applied_or_the_cell_kept_its_own():
    t = Tuning()
    t.tune(scripted({"bucket_cap_mb=5": 0.005})[0], STEPS, "gloo", say=lambda s: None)

    def later(applied=(), explicit=()):
        evs = [ev.ddp_model(T0, model=0, params=10, tensors=2, nbytes=40, bucket_cap_mb=5.0,
                            gradient_as_bucket_view=False, static_graph=False, comm_hook=None,
                            applied=list(applied), explicit=list(explicit))]
        state = RunState([0])
        state.feed([{"rank": 0, "seq": 1, "events": evs}])
        return state.snapshot()

    note = t.note(later(applied=["bucket_cap_mb"]), CellDefaults())
    assert note is not None and "the tuned DDP setting applied: bucket_cap_mb=5" in note
    note = t.note(later(explicit=["bucket_cap_mb"]), CellDefaults())
    assert note is not None and "the cell's own bucket_cap_mb kept" in note
    assert t.note(later(), CellDefaults()) is None  # nothing set by nbdist, nothing to say


def test_the_table_is_fastest_first_as_text_html_and_dataframe():
    result = Tuning().tune(scripted({"bucket_cap_mb=5": 0.005})[0], STEPS, "gloo",
                           say=lambda s: None)
    assert isinstance(result, TuneResult)
    speeds = [r.samples_per_s for r in result.rows if r.samples_per_s]
    assert speeds == sorted(speeds, reverse=True)
    text = repr(result)
    assert "chose bucket_cap_mb=5" in text and "spread (IQR)" in text and "5 MiB" in text
    assert "<table" in result._repr_html_()
    frame = result.to_pandas()
    assert frame.index[0] == "bucket_cap_mb=5"
    assert frame.loc["bucket_cap_mb=5", "note"] == "chosen"
    assert frame.loc["bucket_cap_mb=5", "samples/s"] == pytest.approx(16 / 0.005, rel=1e-3)
    assert frame.loc["torch's defaults", "bucket_cap_mb"] == 25
    assert frame.loc["comm_hook=fp16", "note"] == "lossy"


def test_without_pandas_the_table_is_the_record(monkeypatch):
    result = Tuning().tune(scripted({})[0], STEPS, "gloo", say=lambda s: None)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError):
        result.to_pandas()


# ----------------------------------------------------------------- a trial's figures
def test_trial_figures_skip_warm_up_and_take_the_slowest_rank_per_step():
    run = FakeRun(DDPSettings(), 0.01)
    run.evs[1] = [dict(e, t1=e["t1"] + 0.01) if e["kind"] == "step" else e for e in run.evs[1]]
    steps = steps_of(run.events(), warmup(STEPS))
    assert len(steps.step_s) == STEPS - warmup(STEPS)
    assert steps.step_s[0] == pytest.approx(0.02) and steps.samples[0] == 16
    assert steps.peak_memory == 101 and steps.nbytes[0] == 1000
    f = figures([steps, steps])
    assert f is not None and f.steps == 2 * len(steps.step_s)
    assert f.samples_per_s == pytest.approx(16 / 0.02) and f.spread_s == pytest.approx(0)
    assert f.exposed_fraction == pytest.approx(0.25 * 0.01 / 0.02 * 0.5 + 0.25 * 0.5)
    assert figures([]) is None


def test_search_rounds_alternate_their_order_and_stop():
    s = Search(candidates("gloo", 16 * MIB)[0])
    first = s.next_round()
    assert first[0].label == "torch's defaults"
    for k, setting in enumerate(first):
        s.record(setting, steps_of(FakeRun(setting, 0.01 + k * 0.001).events(), 2))
    s.advance()
    second = s.next_round()
    assert second[-1].label == "torch's defaults" and len(second) < len(first)
    rounds = 2
    while True:
        for setting in second:
            s.record(setting, steps_of(FakeRun(setting, 0.01).events(), 2))
        s.advance()
        second = s.next_round()
        if not second:
            break
        rounds += 1
    assert rounds <= 3
