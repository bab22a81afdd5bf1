"""``%%distributed --tune`` and ``%nbdist tune show|reset`` in a real IPython shell on a
scripted session: what they pass down, what they show, and bad lines as usage errors."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402

import nbdist  # noqa: E402
from nbdist.records import TrialRow, TuneResult  # noqa: E402
from nbdist.runtime.measure.spec import DDPSettings  # noqa: E402
from nbdist.tuning import DEFAULT_STEPS, MIN_STEPS  # noqa: E402


def result() -> TuneResult:
    return TuneResult([TrialRow("bucket_cap_mb=5", 100.0, 0.01, 0.001, 0.3, 1e6, 10**8,
                                trials=2, steps=12, bucket_cap_mb=5.0),
                       TrialRow("torch's defaults", 80.0, 0.0125, 0.002, 0.4, 1e6, 10**8,
                                trials=2, steps=12, bucket_cap_mb=25.0)],
                      chosen="bucket_cap_mb=5", speedup=1.25, steps=8, trials=5)


@pytest.mark.parametrize("line, steps", [("--tune", DEFAULT_STEPS), ("--tune 8", 8),
                                         ("--tune 8 --timeout 30  # tune it", 8)])
def test_the_cell_magic_tunes_and_returns_the_table(shell, session, monkeypatch, line, steps):
    seen = []
    monkeypatch.setattr(session, "tune", lambda code, n, **kw: seen.append((code, n, kw))
                        or result())
    frame = shell.run_cell_magic("distributed", line, "train()\n")
    [(code, n, kw)] = seen
    assert code == "train()\n" and n == steps and kw["first_line"] == 2
    assert list(frame.index) == ["bucket_cap_mb=5", "torch's defaults"]
    assert frame.loc["bucket_cap_mb=5", "note"] == "chosen"


@pytest.mark.parametrize("line, message", [
    ("--tune 0", f"at least {MIN_STEPS} optimizer steps"),
    ("--tune --ranks 0", "leave out --ranks"),
    ("--tune 10 --name x --no-telemetry", "leave out --name, --no-telemetry"),
    ("--tune many", "invalid int value"),
])
def test_bad_tune_lines_are_usage_errors(shell, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_cell_magic("distributed", line, "train()\n")


def test_tune_show_and_reset_say_what_applies(shell, session, capsys):
    shell.run_line_magic("nbdist", "tune show")
    assert "DDP setting: torch's defaults; nothing tuned yet" in capsys.readouterr().out
    session.tuning.chosen = DDPSettings(bucket_cap_mb=5.0)
    shell.run_line_magic("nbdist", "tune show")
    assert "DDP setting: bucket_cap_mb=5 (tuned" in capsys.readouterr().out
    assert nbdist.tune_settings() == DDPSettings(bucket_cap_mb=5.0)
    shell.run_line_magic("nbdist", "tune reset")
    assert "dropped the tuned DDP setting (bucket_cap_mb=5)" in capsys.readouterr().out
    assert nbdist.tune_settings() == DDPSettings()
    assert "nothing was tuned" in nbdist.tune_reset()
    with pytest.raises(UsageError, match="invalid choice"):
        shell.run_line_magic("nbdist", "tune forget")


def test_the_python_twin_returns_the_dataframe(session, monkeypatch):
    monkeypatch.setattr(session, "tune", lambda code, n, **kw: result())
    frame = nbdist.tune("train()", 8)
    assert frame.loc["torch's defaults", "samples/s"] == 80.0


def test_a_saved_profile_carries_the_tuned_setting(session, tmp_path):
    from nbdist.profiles import load_profile

    session.tuning.chosen = DDPSettings(bucket_cap_mb=5.0, gradient_as_bucket_view=True)
    path = session.save_profile(str(tmp_path / "tuned.yaml"))
    assert load_profile(path).defaults.measure.ddp == session.tuning.chosen
