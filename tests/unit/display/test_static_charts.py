"""What a saved notebook keeps of a run (:mod:`nbdist.display.static_charts`): the charts as PNG
images whose pixels are the SVG's shapes, their words over them, and a summary that renders
whole under the sanitizers that viewers of untrusted notebooks use, with no hover text
spilled as prose, and through ``nbconvert --to html``."""

from __future__ import annotations

import re
import struct
import zlib
from html.parser import HTMLParser

import bleach
import nbformat
import pytest
from bleach.css_sanitizer import CSSSanitizer
from nbconvert import HTMLExporter
from synthetic import training_events

from nbdist.display import html as H
from nbdist.display.static_charts import SCALE, png, static_chart
from nbdist.display.summary import summary_bundle
from nbdist.table_layout import AXIS, COMPUTE, rank_colour
from nbdist.telemetry.run import Run


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGBA rows) of an 8-bit RGBA PNG, every chunk's CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat, size = 8, b"", None
    while at < len(data):
        (n,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + n]
        assert struct.unpack(">I", data[at + 8 + n:at + 12 + n])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">IIBBBBB", body)
            assert size[2:] == (8, 6, 0, 0, 0)  # 8-bit RGBA, no interlace
        elif kind == b"IDAT":
            idat += body
        at += 12 + n
    w, h = size[0], size[1]
    raw = zlib.decompress(idat)
    rows = [raw[y * (w * 4 + 1):(y + 1) * (w * 4 + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)  # filter "none" on every row
    return w, h, b"".join(r[1:] for r in rows)


def pixel(img: tuple[int, int, bytes], x: float, y: float) -> tuple[int, ...]:
    """The pixel at SVG coordinates (x, y)."""
    w, _, rgba = img
    at = (int(y * SCALE) * w + int(x * SCALE)) * 4
    return tuple(rgba[at:at + 4])


def rgba(hex_colour: str) -> tuple[int, ...]:
    h = hex_colour.lstrip("#")
    h = "".join(c * 2 for c in h) if len(h) == 3 else h
    return (int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16), 255)


def image_of(html: str) -> tuple[int, int, bytes]:
    import base64

    (data,) = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)
    return decode_png(base64.b64decode(data))


def finished_snapshot(steps: int = 30):
    run = Run("cell", [0, 1], world_size=2)
    run.feed([{"rank": r, "seq": 1, "events": training_events(steps, slow=r == 1)}
              for r in (0, 1)])
    run.finish()
    return run.snapshot()


def test_png_round_trips_pixels_and_refuses_a_wrong_size():
    pixels = bytes(range(256)) * 3  # 8 x 24 RGBA pixels
    assert decode_png(png(8, 24, pixels)) == (8, 24, pixels)
    with pytest.raises(ValueError, match="do not make 8x25 RGBA pixels"):
        png(8, 25, pixels)


def test_a_step_chart_keeps_its_bars_axes_and_words_and_drops_its_hover_text():
    snap = finished_snapshot()
    svg = H.step_chart_svg(snap.series)
    html = static_chart(svg)
    assert "<svg" not in html and "<title" not in html and "that ran it" not in html
    assert "class='nbdist-step-chart nbdist-static-chart'" in html
    img = image_of(html)
    assert img[:2] == (420 * SCALE, 120 * SCALE)
    # the first bar's compute part, read from the SVG's own rectangle
    x, y, w, h = (float(v) for v in re.search(
        rf"<rect x='([0-9.]+)' y='([0-9.]+)' width='([0-9.]+)' height='([0-9.]+)' "
        rf"fill='{COMPUTE}'/>", svg).groups())
    assert pixel(img, x + w / 2, y + h / 2) == rgba(COMPUTE)
    assert pixel(img, 56, 60) == rgba(AXIS)  # the y axis
    assert pixel(img, 20, 60)[3] == 0  # transparent: the page's background shows
    labels = re.findall(r"class='nbdist-chart-label'[^>]*>(.*?)</span>(?=<span|</div>)", html)
    words = [re.sub(r"<[^>]+>", "", label) for label in labels]
    assert "step 0" in words and "step 29" in words and "0" in words
    assert any(w.startswith("time per step, mean of 2 ranks") for w in words), words


def test_a_scalar_chart_draws_each_rank_in_its_colour_named_over_it():
    by_rank = {0: ((0.0, 1.0), (10.0, 0.5)), 1: ((0.0, 2.0), (10.0, 1.0))}
    html = static_chart(H.scalar_chart_svg("loss", by_rank))
    w, h, data = image_of(html)
    colours = {tuple(data[i:i + 4]) for i in range(0, len(data), 4)}
    assert rgba(rank_colour(0)) in colours and rgba(rank_colour(1)) in colours
    assert f"<span style='color:{rank_colour(1)}'>rank 1</span>" in html


class Visible(HTMLParser):
    """The text a browser shows of some HTML (what is outside tags)."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.images: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs).get("src") or "")


def visible(html: str) -> Visible:
    v = Visible()
    v.feed(html)
    return v


#: the rules JupyterLab's and Notebook 7's sanitizer applies to untrusted output (its tags,
#: its style properties, ``data:`` kept in an image's source), written for bleach; tags it
#: does not know are dropped and their text kept, as sanitize-html does
JUPYTERLAB = dict(
    tags={"a", "b", "br", "caption", "code", "details", "div", "i", "img", "li", "pre",
          "small", "span", "strong", "summary", "table", "tbody", "td", "th", "thead", "tr",
          "ul"},
    attributes={"*": ["class", "style", "title"], "img": ["src", "alt", "width", "height"]},
    protocols={"http", "https", "data"},
    css_sanitizer=CSSSanitizer(allowed_css_properties=[
        "background", "border-bottom", "box-sizing", "caption-side", "color", "cursor",
        "display", "font-family", "font-size", "font-weight", "height", "left", "line-height",
        "margin", "margin-left", "max-width", "overflow", "overflow-x", "padding",
        "padding-left", "position", "right", "table-layout", "text-align", "text-overflow",
        "top", "vertical-align", "white-space", "width"]),
    strip=True)


def test_the_saved_summary_survives_the_sanitizer_whole_where_svg_spilled_its_hover_text():
    snap = finished_snapshot()
    html = summary_bundle(snap)["text/html"]
    clean = bleach.clean(html, **JUPYTERLAB)
    shown = visible(clean)
    text = "".join(shown.parts)
    # the charts: two images, their data intact, their words still positioned
    assert len(shown.images) == 2 and all(s.startswith("data:image/png;base64,")
                                          for s in shown.images)
    assert clean.count("position:absolute") == html.count("position:absolute") > 0
    for src in shown.images:
        w, h, _ = decode_png(__import__("base64").b64decode(src.split(",", 1)[1]))
        assert w > 0 and h > 0
    assert "that ran it" not in text and "exposed communication, split" not in text
    assert "step 29" in text and "rank" in text
    # the same summary with the live charts' SVG, as the saved notebook used to hold it:
    # the sanitizer drops the drawing and shows every bar's hover text as prose
    spilled = "".join(visible(bleach.clean(html.replace(H.charts(snap, static=True),
                                                        H.charts(snap)), **JUPYTERLAB)).parts)
    assert "mean of the 2 ranks that ran it" in spilled
    assert len(spilled) - len(text) > 30 * 100  # a hundred characters a bar, at least


def test_nbconvert_html_of_the_saved_run_shows_the_summary_and_no_widget_error():
    snap = finished_snapshot()
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "%%distributed\ntrain()", outputs=[nbformat.v4.new_output(
            "display_data", data=summary_bundle(snap), metadata={})]))
    for sanitize in (False, True):
        body, _ = HTMLExporter(template_name="lab", sanitize_html=sanitize).from_notebook_node(nb)
        assert "Error displaying widget" not in body
        assert "that ran it" not in body
        if not sanitize:  # nbconvert's own sanitizer keeps a short list of tags, without img
            assert len(re.findall(r"<img [^>]*src=.data:image/png;base64,", body)) == 2
            assert "nbdist-summary" in body and "step 29" in body
