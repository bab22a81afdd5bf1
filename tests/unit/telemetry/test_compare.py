"""Named runs side by side: figures from snapshots, the table, the DataFrame, the session."""

from __future__ import annotations

import sys

import pytest
from fakes import Scripted, ScriptedBackend, ok
from synthetic import T0, training_events

from nbdist.errors import NbdistError, OptionError
from nbdist.records import Comparison
from nbdist.session import Session
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.compare import COLUMNS, compare, figures


def run_batches(opt_bytes: tuple[int, int], params: int = 1000, seq: int = 1) -> list[dict]:
    out = []
    for r, opt in enumerate(opt_bytes):
        evs = training_events(8) + [
            ev.memory(T0 + 1, params=params, grads=params, optimizer=opt, rss=5_000_000,
                      peak=6_000_000 + r, step=7),
            ev.scalars({"loss": 0.5 - r * 0.1}, T0 + 1), ev.end(True, T0 + 2)]
        out.append({"rank": r, "seq": seq, "events": evs})
    return out


def snapshot(opt_bytes: tuple[int, int], params: int = 1000):
    state = RunState([0, 1])
    state.feed(run_batches(opt_bytes, params))
    return state.snapshot()


def test_figures_take_rates_over_ranks_and_memory_of_the_fullest_rank():
    f = figures("zero1", snapshot((4000, 2000)))
    assert f.ranks == 2 and f.steps == 8
    assert f.samples_per_s == pytest.approx(2 * 4 / 0.1)  # 4 samples per 0.1 s step, 2 ranks
    assert f.step_s == pytest.approx(0.1)
    assert f.bytes_per_step == 1000  # one 1000-byte all-reduce per step
    assert f.optimizer == 4000 and f.params == 1000 and f.peak_rss == 6_000_001
    assert f.scalars == {"loss": 0.5}  # the lowest rank's latest values


def test_comparison_renders_every_run_as_text_html_and_dataframe():
    runs = compare({"ddp": snapshot((4000, 4000)), "zero<1>": snapshot((2000, 2000))})
    c = Comparison(runs)
    text = repr(c)
    assert "ddp" in text and "zero<1>" in text and "optimizer/rank" in text
    html = c._repr_html_()
    assert "zero&lt;1&gt;" in html and "<svg" in html and "zero<1>" not in html
    frame = c.to_pandas()
    assert list(frame.index) == ["ddp", "zero<1>"]
    assert list(frame.columns) == [label for _, label, _ in COLUMNS] + ["loss", "verdicts"]
    assert frame.loc["zero<1>", "optimizer/rank (MB)"] == pytest.approx(0.002)
    assert frame.loc["ddp", "samples/s"] == pytest.approx(80)


def test_without_pandas_compare_returns_the_html_table(monkeypatch):
    import nbdist

    backend = ScriptedBackend(2)
    s = Session(backends=lambda engine: backend, stores=None).start(2)
    monkeypatch.setattr(nbdist, "current_session", lambda: s)
    backend.script(r0=Scripted(ok(seq=1), batches=run_batches((1, 1))[:1]),
                   r1=Scripted(ok(seq=1), batches=run_batches((1, 1))[1:]))
    s.run_cell("train()", name="ddp")
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if it were not installed
    result = nbdist.compare()
    assert isinstance(result, Comparison) and [r.name for r in result.runs] == ["ddp"]


def test_session_keeps_every_named_run_and_refuses_unknown_names():
    backend = ScriptedBackend(2)
    s = Session(backends=lambda engine: backend, stores=None).start(2)
    with pytest.raises(NbdistError, match="--name"):
        s.compare()
    for name in ("a", "b", "c", "d", "a"):  # more than the 3 latest; "a" re-run
        backend.script(r0=Scripted(ok(seq=1), batches=run_batches((1, 1))[:1]),
                       r1=Scripted(ok(seq=1), batches=run_batches((1, 1))[1:]))
        s.run_cell("train()", name=name)
    assert list(s.named) == ["b", "c", "d", "a"] and len(s.runs) == 3
    assert [r.name for r in s.compare("d", "b").runs] == ["d", "b"]
    with pytest.raises(OptionError, match="no run named 'x'"):
        s.compare("x")
    with pytest.raises(OptionError, match="--name needs a label"):
        s.run_cell("x", name=" ")
