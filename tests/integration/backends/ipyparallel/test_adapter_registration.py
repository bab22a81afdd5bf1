"""A local ipyparallel start where one engine is slow to finish registering, on real engines.

An engine registers, then starts its nanny and kernel, and only then its heart; the controller
counts it at its first heart beat. Here a ``sitecustomize`` on the engines' path holds the heart
of the second engine to get that far: past ipyparallel's 30 s (the start still counts it), or
for ever (the start's error names its process).
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from nbdist.errors import WorkersDidNotStart
from nbdist.session import Session

#: Imported by every Python process the start runs (the template, the controller, the
#: engines): the first engine to start its heart goes on, the second waits LATE_HEART_S.
SITECUSTOMIZE = textwrap.dedent("""\
    import os, time
    import ipyparallel.engine.app as app

    _start = app.IPEngine.start_heartbeat

    def start_heartbeat(self, *args, **kw):
        try:
            os.close(os.open(os.environ["LATE_HEART_FLAG"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            time.sleep(float(os.environ["LATE_HEART_S"]))
        return _start(self, *args, **kw)

    app.IPEngine.start_heartbeat = start_heartbeat
""")


@pytest.fixture
def late_heart(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("LATE_HEART_FLAG", str(tmp_path / "first"))
    monkeypatch.syspath_prepend(str(tmp_path))  # not imported here: sys.modules has none
    sys.modules.pop("sitecustomize", None)

    def hold(seconds: float) -> None:
        monkeypatch.setenv("LATE_HEART_S", str(seconds))

    return hold


@pytest.mark.timeout(180)
def test_an_engine_whose_heart_starts_after_30_s_is_still_counted(late_heart):
    # ipyparallel's controller would drop its registration at 30 s and ignore it for good:
    # "only 1 of 2 workers started" after any timeout, its process running on.
    late_heart(33)
    s = Session()
    try:
        s.start(2, engine="ipyparallel", timeout=120)
        assert s.world_size == 2
        s.run_cell("import torch.distributed as dist\nr = dist.get_rank()", output="quiet")
        assert [s.pull("r", rank=r) for r in (0, 1)] == [0, 1]
    finally:
        s.stop()


@pytest.mark.timeout(120)
def test_a_start_that_times_out_names_the_engine_that_never_registered(late_heart):
    late_heart(3600)
    s = Session()
    with pytest.raises(WorkersDidNotStart) as info:
        s.start(2, engine="ipyparallel", timeout=15)
    text = str(info.value)
    assert "only 1 of 2 ipyparallel workers started within 15 s" in text
    assert "2 workers not ready in 15 s; engine process " in text
    assert text.count("engine process ") == 1 and "still running, not registered" in text
