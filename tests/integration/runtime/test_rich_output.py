"""``display()`` and matplotlib figures on ranks reach the notebook, on both engines: captured
as a kernel's frontend gets them (IPython's display publisher), labelled with the rank."""

from __future__ import annotations

import base64
import textwrap

import pytest
from clusters import ENGINES, start_session
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(600)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param, 2)
    yield s
    s.stop()


def shown(session, code: str, **kw):
    """The rich outputs (data, metadata, transient, update) a cell published in the kernel."""
    InteractiveShell.instance()
    with capture_output() as captured:
        value = session.run_cell(textwrap.dedent(code), timeout=120, **kw)
    return [(o.data, o.metadata, o.transient, o.update) for o in captured.outputs], value


def test_display_and_its_updates_from_the_shown_rank(session):
    outputs, _ = shown(session, """
        from IPython.display import HTML, display
        display(HTML(f"<b>from {rank}</b>"))
        handle = display(HTML("<i>first</i>"), display_id=True)
        handle.update(HTML("<i>second</i>"))
    """)
    assert len(outputs) == 3, outputs
    (first, meta, _, update), (made, _, made_t, made_u), (updated, _, upd_t, upd_u) = outputs
    assert "<b>from 0</b>" in first["text/html"] and "[0]" in first["text/html"]
    assert meta["nbdist"] == {"rank": 0} and not update
    assert "<i>first</i>" in made["text/html"] and not made_u
    assert "<i>second</i>" in updated["text/html"] and upd_u
    assert made_t["display_id"] == upd_t["display_id"]
    assert made_t["display_id"].startswith("nbdist-0-")


def test_every_rank_under_all_output_and_the_selected_one_under_ranks(session):
    code = 'from IPython.display import HTML, display\ndisplay(HTML(f"<b>{rank}</b>"))\n'
    everyone, _ = shown(session, code, output="all")
    assert sorted(m["nbdist"]["rank"] for _, m, _, _ in everyone) == [0, 1]
    for data, meta, _, _ in everyone:
        r = meta["nbdist"]["rank"]
        assert f"<b>{r}</b>" in data["text/html"] and data["text/plain"].startswith(f"[{r}] ")
    one, _ = shown(session, code, ranks="1")
    assert [m["nbdist"]["rank"] for _, m, _, _ in one] == [1]
    assert shown(session, code, output="quiet")[0] == []


def test_a_matplotlib_figure_shown_on_rank_0_is_an_image(session):
    outputs, _ = shown(session, """
        import matplotlib.pyplot as plt
        plt.plot([0, 1, 4])
        plt.show()
        open_after_show = plt.get_fignums()
    """)
    [(data, meta, _, _)] = outputs
    assert base64.b64decode(data["image/png"]).startswith(PNG) and meta["nbdist"]["rank"] == 0
    assert session.pull("open_after_show", rank=0) == []  # shown figures close, as inline
    _, value = shown(session, """
        fig = plt.figure()
        fig.gca().plot([1, 2])
        fig
    """)
    assert base64.b64decode(value.data["image/png"]).startswith(PNG)
    assert value._repr_html_() is None  # the image is what a frontend shows
