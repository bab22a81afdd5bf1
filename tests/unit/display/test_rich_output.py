"""What ranks displayed, as the notebook shows it: labelled, by the printed lines' rule."""

from __future__ import annotations

import io

from nbdist.display import rich_output
from nbdist.display.rich_output import RichOutput, labelled
from nbdist.telemetry.events import display


def test_a_label_in_the_text_above_the_html_and_above_an_image():
    html = labelled(2, {"text/plain": "<HTML>", "text/html": "<b>x</b>"})
    assert html["text/plain"] == "[2] <HTML>"
    assert html["text/html"].endswith("<b>x</b>") and "[2]" in html["text/html"]
    image = labelled(0, {"text/plain": "<Figure>", "image/png": "iVBORw0KGgo="})
    assert image["image/png"] == "iVBORw0KGgo="  # the image itself, for other frontends
    assert 'src="data:image/png;base64,iVBORw0KGgo="' in image["text/html"]
    assert "[0]" in image["text/html"]


def test_the_shown_ranks_follow_the_printed_lines_rule_and_print_without_a_shell(monkeypatch):
    monkeypatch.setattr(rich_output, "_shell_display", lambda: None)  # plain Python
    out = io.StringIO()
    rank0 = RichOutput("rank0", shown_rank=1, stdout=out)
    rank0.feed(0, display({"text/plain": "zero"}))
    rank0.feed(1, display({"text/plain": "one"}))
    assert out.getvalue() == "[1] one\n" and rank0.shown == 1
    everyone = RichOutput("all", stdout=out)
    assert everyone.wanted(0) and everyone.wanted(5)
    quiet = RichOutput("quiet", stdout=out)
    assert not quiet.wanted(0)
