"""``%%distributed --tune``, the notebook's half: which DDP settings to try, in what order,
which one wins, and the session's tuned default. The workers' half (a setting applied to
every DDP model a cell builds, a trial cut at its step budget) is
:mod:`nbdist.runtime.measure.tuning`.

The search is a small grid with successive halving. Round one runs the cell once with torch's
defaults (the reference: it also shows whether the cell can be tuned at all) and once with
each knob moved off its default alone: ``bucket_cap_mb`` over :data:`BUCKET_SIZES_MB`,
``gradient_as_bucket_view``, ``static_graph``, and the compression hooks this backend has
(fp16 and PowerSGD; bf16 on NCCL only). The better half goes on to the next round, with the
reference and with the exact settings that beat it combined into one; each round runs its
settings again, in the opposite order, and a setting's figures pool the steps of all its
trials, until one setting is left against the reference (:data:`ROUNDS` at most).

The fastest setting that keeps the gradients exact becomes the session's default, if it beats
torch's defaults by :data:`CHOOSE_MIN_GAIN`. A compression hook is measured and shown, never
chosen on its own: it changes what the model learns, which a speed trial cannot judge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

from .errors import (
    TUNE_NO_DDP,
    TUNE_TOO_FEW,
    TUNE_TOO_SHORT,
    CellTimeoutError,
    DistributedError,
    OptionError,
    TuneError,
)
from .options import CellDefaults, CellOptions
from .records import TrialRow, TuneResult
from .runtime.measure.spec import DDPSettings, Measure
from .telemetry.snapshot import ModelPoint, RunSnapshot
from .telemetry.trials import TrialFigures, TrialSteps, figures, steps_of, warmup
from .telemetry.units import fmt_rate, fmt_seconds
from .telemetry.verdicts import Context, Tuned, reference

if TYPE_CHECKING:
    from .telemetry.run import Run

#: optimizer steps per trial when ``--tune`` has no number
DEFAULT_STEPS = 20
#: the fewest a trial may take: its untimed first steps and three timed ones
MIN_STEPS = warmup(5) + 3
#: bucket sizes tried (MiB); 25 is torch's default, tried as the reference
BUCKET_SIZES_MB = (1, 5, 25, 100)
#: rounds of successive halving at most
ROUNDS = 3
#: the share of torch's defaults' samples/s a setting must beat them by to be chosen
CHOOSE_MIN_GAIN = 0.02
#: how tuning trials are named among the session's runs (``nbdist.compare()`` shows them)
TRIAL_PREFIX = "tune: "

#: a trial: the cell run with a setting, named, within a time limit (seconds or None); its
#: record returned (DistributedError if the cell failed, CellTimeoutError past the limit)
Trial = Callable[[DDPSettings, str, Optional[float]], "Run"]


#: the first bucket of torch's defaults (``dist._DEFAULT_FIRST_BUCKET_BYTES``)
FIRST_BUCKET_BYTES = 2**20
#: on gloo, torch's PowerSGD hook stops making progress once the gradients span more than
#: one DDP bucket (docs/strategies.md): larger models skip it there
POWERSGD_GLOO_MAX_BYTES = FIRST_BUCKET_BYTES
#: a trial may take this many times the first trial's wall time (or the cell's --timeout)
TRIAL_TIMEOUT_FACTOR = 10
#: ... and at least this many seconds
TRIAL_TIMEOUT_MIN_S = 60.0


def candidates(dist_backend: str, grad_bytes: int = 0
               ) -> tuple[list[DDPSettings], dict[DDPSettings, str]]:
    """Round one: torch's defaults first, then each knob off its default alone; and the
    settings left out for a model of ``grad_bytes`` of gradients on this backend, with why.

    Bucket sizes that put the model in the very same buckets as another setting are left
    out: they cannot differ but by noise. Torch's default buckets hold 25 MiB after a first
    one of :data:`FIRST_BUCKET_BYTES`; a size given (``bucket_cap_mb=5``) sizes the first
    too. So a model that fits the first bucket is one bucket at every size, and sizes at
    least as large as the whole model all give one bucket.
    """
    grid = [DDPSettings()]
    grid += [DDPSettings(bucket_cap_mb=float(mb)) for mb in BUCKET_SIZES_MB if mb != 25]
    grid += [DDPSettings(gradient_as_bucket_view=True), DDPSettings(static_graph=True),
             DDPSettings(comm_hook="fp16"), DDPSettings(comm_hook="powersgd")]
    if dist_backend == "nccl":
        grid.append(DDPSettings(comm_hook="bf16"))
    size = f"{grad_bytes / 2**20:.3g} MiB of gradients"
    left_out: dict[DDPSettings, str] = {}
    whole = [s for s in grid if s.bucket_cap_mb and s.bucket_cap_mb * 2**20 >= grad_bytes]
    for s in whole:
        if grad_bytes <= FIRST_BUCKET_BYTES:
            left_out[s] = f"one bucket, as with torch's defaults ({size})"
        elif s is not whole[0]:
            left_out[s] = f"one bucket, as with {whole[0].label} ({size})"
    if dist_backend != "nccl" and grad_bytes > POWERSGD_GLOO_MAX_BYTES:
        left_out[DDPSettings(comm_hook="powersgd")] = (
            f"on gloo PowerSGD stalls once gradients span more than one bucket ({size})")
    return [s for s in grid if s not in left_out], left_out


class Search:
    """Successive halving over ``settings`` (the first is the reference, torch's defaults)."""

    def __init__(self, settings: Sequence[DDPSettings]) -> None:
        self.reference = settings[0]
        self.alive = list(settings)
        self.steps: dict[DDPSettings, list[TrialSteps]] = {}
        self.failed: dict[DDPSettings, str] = {}
        self.skipped: dict[DDPSettings, str] = {}
        self.rounds = 0

    def next_round(self) -> list[DDPSettings]:
        """The settings to run in the next round, in the order to run them (each round the
        opposite of the last, so a machine that slows down over time favours no one);
        empty when the search is over."""
        if self.rounds and (self.rounds >= ROUNDS or len(self._contenders()) <= 1):
            return []
        self.rounds += 1
        order = [s for s in self.alive if s not in self.failed and s not in self.skipped]
        return order if self.rounds % 2 else order[::-1]

    def record(self, setting: DDPSettings, steps: TrialSteps) -> None:
        self.steps.setdefault(setting, []).append(steps)

    def fail(self, setting: DDPSettings, why: str) -> None:
        self.failed[setting] = why

    def skip(self, setting: DDPSettings, why: str) -> None:
        self.skipped[setting] = why

    def figures(self, setting: DDPSettings) -> Optional[TrialFigures]:
        return figures(self.steps.get(setting, ()))

    def ranked(self, among: Optional[Sequence[DDPSettings]] = None) -> list[DDPSettings]:
        """Settings measured so far (or ``among`` them), fastest first."""
        def speed(s: DDPSettings) -> float:
            f = self.figures(s)
            if f is None:
                return -math.inf
            return f.samples_per_s if f.samples_per_s is not None else 1 / f.step_s

        pool = [s for s in (among if among is not None else self.steps)
                if s in self.steps and s not in self.failed]
        return sorted(pool, key=speed, reverse=True)

    def _contenders(self) -> list[DDPSettings]:
        return [s for s in self.alive if s != self.reference and s not in self.failed
                and s not in self.skipped]

    def advance(self) -> None:
        """After a round: keep the faster half (and the reference); after round one, add the
        exact settings that beat the reference, combined."""
        ranked = self.ranked(self._contenders())
        keep = ranked[:math.ceil(len(ranked) / 2)]
        if self.rounds == 1:
            combined = self._combined(ranked)
            if combined is not None and combined not in self.alive:
                keep.append(combined)
        self.alive = [self.reference] + keep

    def _combined(self, ranked: Sequence[DDPSettings]) -> Optional[DDPSettings]:
        """One setting from each exact knob's best value, where that beat the reference."""
        ref = self.figures(self.reference)
        if ref is None:
            return None
        chosen: dict[str, object] = {}
        for s in ranked:  # fastest first: the first value of each knob is its best
            f = self.figures(s)
            if s.lossy or f is None or f.step_s >= ref.step_s:
                continue
            for knob, value in s.given().items():
                chosen.setdefault(knob, value)
        return DDPSettings(**chosen) if len(chosen) >= 2 else None  # type: ignore[arg-type]

    def best(self) -> tuple[Optional[DDPSettings], Optional[float]]:
        """The fastest exact setting and its samples/s over the reference's (None: none
        beats the reference by :data:`CHOOSE_MIN_GAIN`; the gain is then the best's)."""
        exact = [s for s in self.ranked() if not s.lossy]
        ref = self.figures(self.reference)
        if not exact or ref is None:
            return None, None
        gain = _gain(self.figures(exact[0]), ref)
        if exact[0] == self.reference or gain is None or gain < 1 + CHOOSE_MIN_GAIN:
            return None, gain
        return exact[0], gain


def _gain(f: Optional[TrialFigures], ref: TrialFigures) -> Optional[float]:
    if f is None:
        return None
    if f.samples_per_s and ref.samples_per_s:
        return f.samples_per_s / ref.samples_per_s
    return ref.step_s / f.step_s if f.step_s else None


class Tuning:
    """The session's tuning: what ``--tune`` found and chose, applied to later cells."""

    def __init__(self) -> None:
        #: the setting ``--tune`` chose (``DDPSettings()``: torch's defaults won); None:
        #: nothing tuned, the profile's ``training.ddp`` applies
        self.chosen: Optional[DDPSettings] = None
        #: the last tuning's table
        self.result: Optional[TuneResult] = None
        self.tuned: Optional[Tuned] = None
        self.trial_names: list[str] = []

    # ------------------------------------------------------------- the session's default
    def defaults(self, defaults: CellDefaults) -> CellDefaults:
        """``defaults`` with the tuned setting in place of the profile's, if one was chosen."""
        if self.chosen is None:
            return defaults
        return replace(defaults, measure=replace(defaults.measure, ddp=self.chosen))

    def show(self, defaults: CellDefaults) -> str:
        """What DDP models built from now on get, and where it comes from."""
        if self.chosen is not None:
            how = "tuned by %%distributed --tune"
            if self.tuned is not None and self.tuned.speedup:
                how += f": {self.tuned.speedup:.2f}x the samples/s of torch's defaults"
            return (f"DDP setting: {self.chosen.label} ({how}); a value the cell passes to "
                    "DDP(...) wins; `%nbdist tune reset` drops it")
        if defaults.measure.ddp.given():
            return (f"DDP setting: {defaults.measure.ddp.label} (the profile's training.ddp); "
                    "nothing tuned yet: `%%distributed --tune` on a training cell")
        return ("DDP setting: torch's defaults; nothing tuned yet: `%%distributed --tune` on a "
                "training cell")

    def reset(self, defaults: CellDefaults) -> str:
        """Drop the tuned setting; say what applies again."""
        had, self.chosen, self.tuned = self.chosen, None, None
        profile = defaults.measure.ddp
        back = (f"the profile's training.ddp ({profile.label})" if profile.given()
                else "torch's defaults")
        if had is None:
            return f"nothing was tuned; DDP models get {back}"
        return (f"dropped the tuned DDP setting ({had.label}); DDP models built from now on "
                f"get {back}")

    def say_note(self, snap: RunSnapshot, defaults: CellDefaults, output: str) -> None:
        """Print :meth:`note` under the cell (unless its output is quiet)."""
        note = self.note(snap, defaults)
        if note is not None and output != "quiet":
            print(note, flush=True)

    def note(self, snap: RunSnapshot, defaults: CellDefaults) -> Optional[str]:
        """The line under a cell whose DDP models got the session's setting (None: none)."""
        models = [m for m in snap.models if m.applied or m.explicit]
        setting = self.defaults(defaults).measure.ddp
        if snap.trial is not None or not models or not setting.given():
            return None
        source = "the tuned" if self.chosen is not None else "the profile's (training.ddp)"
        applied = sorted({k for m in models for k in m.applied})
        kept = sorted({k for m in models for k in m.explicit} & set(setting.given()))
        parts = []
        if applied:
            shown = DDPSettings(**{k: v for k, v in setting.given().items() if k in applied})
            parts.append(f"{source} DDP setting applied: {shown.label}")
        if kept:
            parts.append(f"the cell's own {', '.join(kept)} kept over {source} setting")
        if not parts:
            return None
        n = len(models)
        return (f"nbdist: {'; '.join(parts)} ({n} model{'s' if n > 1 else ''}; "
                "`%nbdist tune show` says more, `%nbdist tune reset` drops a tuned one)")

    def context(self, named: Mapping[str, Run], own: Optional[str] = None) -> Context:
        """What a run (named ``own``) may be compared with by its verdicts: the other named
        runs (tuning trials included) and what tuning found."""
        refs = tuple(r for r in (reference(n, run.snapshot()) for n, run in named.items()
                                 if n != own) if r is not None)
        return Context(refs, (self.tuned,) if self.tuned is not None else ())

    def known(self) -> tuple[Tuned, ...]:
        """What tuning found, for ``compare()``'s verdicts (empty: nothing tuned)."""
        return (self.tuned,) if self.tuned is not None else ()

    # ------------------------------------------------------------- the search
    def trials(self, run: Callable[[CellOptions, Measure], tuple[object, Run]],
               named: dict[str, Run], defaults: CellDefaults, steps: int,
               timeout: Optional[float] = None, time_collectives: Optional[bool] = None,
               bucket_timing: Optional[bool] = None, stall_after: Optional[float] = None
               ) -> tuple[Trial, Optional[float]]:
        """A new tuning of the cell that ``run`` runs (with options and a measure; it returns
        the cell's value and run): its :data:`Trial` and time limit. The last tuning's trials
        leave ``named``. The other arguments are ``run_cell``'s, over ``defaults``."""
        self.forget(named)
        opts = CellOptions(timeout=defaults.timeout if timeout is None else timeout,
                           output="quiet", stall_after=stall_after)
        base = defaults.measure.override(telemetry=True, collectives=time_collectives,
                                         buckets=bucket_timing, stall_after=stall_after)

        def trial(setting: DDPSettings, name: str, limit: Optional[float]) -> Run:
            measure = replace(base, ddp=setting, trial_steps=steps)
            return run(replace(opts, name=name, timeout=limit), measure)[1]

        return trial, opts.timeout

    def forget(self, named: dict[str, Run]) -> None:
        """Take the last tuning's trials out of the session's ``named`` runs."""
        for name in self.trial_names:
            named.pop(name, None)
        self.trial_names.clear()

    def tune(self, trial: Trial, steps: int, dist_backend: str,
             say: Callable[[str], None] = print, timeout: Optional[float] = None
             ) -> TuneResult:
        """Run the search with ``trial`` (each trial ``steps`` optimizer steps, within
        ``timeout`` seconds, else a limit from the first trial's time), choose, and return
        the table. Raises :class:`~nbdist.errors.OptionError` for too few steps and
        :class:`~nbdist.errors.TuneError` for a cell it cannot tune (nothing changes then)."""
        if steps < MIN_STEPS:
            raise OptionError(TUNE_TOO_FEW.format(least=MIN_STEPS, steps=steps))
        skip = warmup(steps)
        # A first run with torch's defaults warms the workers up (first-use costs would
        # count against whichever setting ran first) and shows whether the cell can be tuned.
        say("nbdist: --tune: a first, untimed run with torch's defaults warms the workers up "
            "and checks that the cell can be tuned")
        self.trial_names.append(TRIAL_PREFIX + DDPSettings().label)
        first = trial(DDPSettings(), self.trial_names[-1], timeout)
        snap = first.snapshot()
        model = _check(snap, steps)
        grid, left_out = candidates(dist_backend, model.nbytes)
        search = Search(grid)
        for s, why in left_out.items():
            search.skip(s, why)
        for s in search.alive:
            kept = sorted(set(s.given()) & set(model.explicit))
            if kept:
                search.skip(s, f"the cell sets {', '.join(kept)} itself")
        limit = timeout or max(TRIAL_TIMEOUT_MIN_S, TRIAL_TIMEOUT_FACTOR * (snap.wall_s or 0))
        shown: dict[DDPSettings, ModelPoint] = {search.reference: model}
        count = 0
        while True:
            todo = search.next_round()
            if not todo:
                break
            for setting in todo:
                count += 1
                snap = self._trial(trial, setting, search, skip, limit)
                if snap is None:
                    say(f"nbdist: tune trial {count} ({setting.label}): failed, "
                        f"{search.failed[setting]}")
                    continue
                shown[setting] = snap.models[0]
                f = search.figures(setting)
                say(f"nbdist: tune trial {count} ({setting.label}): "
                    + (f"{fmt_rate(f.samples_per_s, 'samples/s')}, step "
                       f"{fmt_seconds(f.step_s)}" if f is not None else "no step timed"))
            search.advance()
        return self._choose(search, shown, steps, count, say)

    def _trial(self, trial: Trial, setting: DDPSettings, search: Search, skip: int,
               limit: float) -> Optional[RunSnapshot]:
        """Run one trial and keep its steps; None when the cell failed with this setting, or
        took past ``limit`` seconds (with torch's defaults, the error is raised: the cell
        fails as it is)."""
        name = TRIAL_PREFIX + setting.label
        if name not in self.trial_names:
            self.trial_names.append(name)
        try:
            run = trial(setting, name, limit)
        except (DistributedError, CellTimeoutError) as exc:
            if setting == search.reference:
                raise  # the cell fails as it is: that is the user's error, shown whole
            why = str(exc).strip().splitlines()[0]
            search.fail(setting, why if isinstance(exc, DistributedError)
                        else f"ran past {limit:.3g} s and was interrupted")
            return None
        search.record(setting, steps_of(run.events(), skip))
        return run.snapshot()

    def _choose(self, search: Search, shown: Mapping[DDPSettings, ModelPoint], steps: int,
                count: int, say: Callable[[str], None]) -> TuneResult:
        best, gain = search.best()
        ref_model = shown[search.reference]
        self.chosen = best if best is not None else DDPSettings()
        self.tuned = Tuned(ref_model.shape, self.chosen.label, gain if best else None,
                           tuple(self.chosen.given()))
        ranked = search.ranked()
        lossy = next((s for s in ranked if s.lossy), None)
        rows = [_row(s, search, shown.get(s)) for s in ranked]
        rows += [TrialRow(s.label, note=f"skipped: {why}") for s, why in search.skipped.items()]
        rows += [TrialRow(s.label, note=f"failed: {why}") for s, why in search.failed.items()]
        result = self.result = TuneResult(rows, chosen=self.chosen.label, speedup=gain,
                                          steps=steps, trials=count)
        if best is not None:
            say(f"nbdist: --tune chose {best.label}: {gain:.2f}x the samples/s of torch's "
                f"defaults ({count} trials of {steps} optimizer steps); DDP models built from "
                "now on use it (`%nbdist tune reset` drops it)")
        else:
            say(f"nbdist: --tune kept torch's defaults: no exact setting beat them by "
                f"{CHOOSE_MIN_GAIN:.0%} or more ({count} trials of {steps} optimizer steps)")
        lossy_gain = _gain(search.figures(lossy), search.figures(search.reference)) \
            if lossy is not None and search.figures(search.reference) else None
        if lossy is not None and lossy_gain is not None and lossy_gain > (gain or 1):
            say(f"nbdist: {lossy.label} measured {lossy_gain:.2f}x but changes the gradients, "
                "so it is not chosen on its own: register the hook in the cell, or set "
                "training.ddp.comm_hook in a profile")
        return result


def _check(snap: RunSnapshot, steps: int) -> ModelPoint:
    """The reference trial's model; a cell that cannot be tuned raises its one line."""
    if not snap.models:
        raise TuneError(TUNE_NO_DDP)
    if snap.trial is None or not snap.trial.cut:
        done = snap.trial.steps if snap.trial is not None else 0
        raise TuneError(TUNE_TOO_SHORT.format(steps=steps, done=done))
    return snap.models[0]


def _row(setting: DDPSettings, search: Search, model: Optional[ModelPoint]) -> TrialRow:
    f = search.figures(setting)
    assert f is not None
    return TrialRow(
        setting.label, f.samples_per_s, f.step_s, f.spread_s, f.exposed_fraction,
        f.bytes_per_step, f.peak_memory, trials=len(search.steps[setting]), steps=f.steps,
        bucket_cap_mb=model.bucket_cap_mb if model is not None else None,
        lossy=setting.lossy)
