"""Running a cell's source on a worker: last expression, namespace, errors, rich values."""

from __future__ import annotations

import linecache

from nbdist.records import RemoteValue
from nbdist.runtime import execute
from nbdist.runtime.execute import mimebundle, run_code
from nbdist.runtime.results import error_info


def test_run_code_returns_last_expression_and_keeps_namespace():
    ns = {"__name__": "__main__"}
    assert run_code("x = 2\nx * 21", "<t1>", ns) == 42
    assert run_code("y = x + 1", "<t2>", ns) is None and ns["y"] == 3
    assert ns["_"] == 42


def test_error_info_keeps_cell_frames_and_line():
    ns = {}
    try:
        run_code("a = 1\n\ndef f():\n    return 1 / 0\nf()", "<cell 9>", ns)
    except ZeroDivisionError as exc:
        info = error_info(exc, "<cell 9>")
    assert info["ename"] == "ZeroDivisionError" and info["line"] == 4
    assert '"<cell 9>", line 5' in info["traceback"]
    assert "return 1 / 0" in info["traceback"]  # the cell's own source line is shown
    assert "execute.py" not in info["traceback"]
    assert not info["communication"]


def test_mimebundle_uses_rich_reprs():
    class Rich:
        def _repr_html_(self):
            return "<b>hi</b>"

        def __repr__(self):
            return "Rich()"

    assert mimebundle(Rich()) == {"text/html": "<b>hi</b>", "text/plain": "Rich()"}
    assert mimebundle(None) is None
    v = RemoteValue(0, {"text/plain": "3"})
    assert repr(v) == "3" and v._repr_mimebundle_() == {"text/plain": "3"}


def test_the_latest_cells_stay_registered_for_tracebacks(monkeypatch):
    monkeypatch.setattr(execute, "MAX_SOURCES", 3)
    monkeypatch.setattr(execute, "_sources", {})
    names = [f"<distributed cell bound {n}>" for n in range(5)]
    try:
        for n, name in enumerate(names):
            execute.compile_cell(f"x = {n}\n", name)
        execute.compile_cell("x = 'again'\n", names[2])  # run again: the newest now
        assert [linecache.getline(name, 1) for name in names] == [
            "", "", "x = 'again'\n", "x = 3\n", "x = 4\n"]
        assert list(execute._sources) == [names[3], names[4], names[2]]
    finally:
        for name in names:
            linecache.cache.pop(name, None)
