"""display() and plt.show() inside a cell become the rank's events; outside, the libraries' own."""

from __future__ import annotations

import base64

import pytest

from nbdist.runtime import rich_output
from nbdist.telemetry.events import DISPLAY


class Sink:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)


class Rich:
    def _repr_html_(self) -> str:
        return "<b>rich</b>"


def test_display_its_handle_and_update_become_events():
    display_functions = pytest.importorskip("IPython.core.display_functions")
    sink = Sink()
    with rich_output.capturing(sink):  # type: ignore[arg-type]
        from IPython.display import display

        display(Rich())
        handle = display(Rich(), display_id=True)
        handle.update({"text/plain": "raw"}, raw=True)
    assert [e["kind"] for e in sink.events] == [DISPLAY] * 3
    first, made, updated = sink.events
    assert first["data"]["text/html"] == "<b>rich</b>" and first["display_id"] is None
    assert made["display_id"] == updated["display_id"] == handle.display_id
    assert updated["update"] and updated["data"] == {"text/plain": "raw"}
    assert display_functions.display.__wrapped__ is not None


def test_outside_a_cell_display_is_ipython_s(capsys):
    pytest.importorskip("IPython")
    rich_output.install()
    from IPython.display import display

    display("plain")  # no shell in this process: IPython prints it
    assert "plain" in capsys.readouterr().out


def test_plt_show_sends_each_open_figure_as_png_and_closes_it():
    pytest.importorskip("matplotlib")
    rich_output.install()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sink = Sink()
    with rich_output.capturing(sink):  # type: ignore[arg-type]
        plt.plot([1, 2])
        plt.figure().gca().plot([3, 1])
        plt.show()
    assert len(sink.events) == 2 and plt.get_fignums() == []
    for event in sink.events:
        assert base64.b64decode(event["data"]["image/png"]).startswith(b"\x89PNG")


def test_a_display_too_large_is_a_line_saying_so(monkeypatch):
    sink = Sink()
    monkeypatch.setattr(rich_output, "MAX_BYTES", 10)
    with rich_output.capturing(sink):  # type: ignore[arg-type]
        rich_output.send({"text/plain": "x" * 100})
    assert "was not sent" in sink.events[0]["data"]["text/plain"]
