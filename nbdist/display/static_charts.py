"""The charts of a saved notebook: each SVG chart of :mod:`nbdist.display.html` drawn again as
a PNG image, with its words as HTML text laid over it.

A saved notebook is shown by viewers that sanitize HTML: JupyterLab and Notebook 7 for an
untrusted notebook, code hosts' previews. They drop ``<svg>`` but keep the text of its
``<title>`` elements, which then reads as a page of prose where the charts were; an ``<img>``
with a ``data:image/png`` source and positioned ``<span>``\\ s survive them. The live widget
keeps the SVG (it hovers, and a redraw is only a string).

The PNG is written with the standard library (:mod:`zlib`): the charts are rectangles, lines
and triangles, which need no plotting library, so a saved notebook looks the same whether or
not matplotlib is installed, and a run's end costs no import of one. It is drawn at twice the
chart's size, so that it stays sharp on high-density screens. Hover text (``<title>``) is not
carried over: an image has none to leak.
"""

from __future__ import annotations

import base64
import math
import re
import struct
import xml.etree.ElementTree as ET
import zlib
from html import escape
from typing import Optional

from ..table_layout import AXIS

#: pixels per SVG unit in the image (it is shown at the SVG's size)
SCALE = 2

Colour = tuple[int, int, int, int]


def parse_colour(value: Optional[str]) -> Optional[Colour]:
    """``#rgb`` or ``#rrggbb`` as RGBA; ``currentColor`` as the axes' grey (an image cannot
    follow the page's colour); None for ``none``, a missing value or anything else."""
    if value == "currentColor":
        value = AXIS
    if not value or not re.fullmatch(r"#[0-9a-fA-F]{3}|#[0-9a-fA-F]{6}", value):
        return None
    digits = value[1:]
    if len(digits) == 3:
        digits = "".join(c * 2 for c in digits)
    return (int(digits[0:2], 16), int(digits[2:4], 16), int(digits[4:6], 16), 255)


def png(width: int, height: int, rgba: bytes) -> bytes:
    """A PNG file of ``width`` x ``height`` pixels (8-bit RGBA, rows top to bottom)."""
    if len(rgba) != width * height * 4:
        raise ValueError(f"{len(rgba)} bytes do not make {width}x{height} RGBA pixels")
    stride = width * 4
    raw = b"".join(b"\x00" + rgba[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


class Canvas:
    """Transparent RGBA pixels, drawn on in SVG units (``scale`` pixels each)."""

    def __init__(self, width: float, height: float, scale: int = SCALE):
        self.scale = scale
        self.width, self.height = max(1, round(width * scale)), max(1, round(height * scale))
        self.pixels = bytearray(self.width * self.height * 4)

    def _span(self, y: int, x0: int, x1: int, colour: Colour) -> None:
        x0, x1 = max(0, x0), min(self.width, x1)
        if 0 <= y < self.height and x1 > x0:
            at = (y * self.width + x0) * 4
            self.pixels[at:at + (x1 - x0) * 4] = bytes(colour) * (x1 - x0)

    def rect(self, x: float, y: float, w: float, h: float, colour: Colour) -> None:
        """Fill a rectangle; one at least a pixel wide and high when it has any size."""
        if w <= 0 or h <= 0:
            return
        s = self.scale
        x0, y0 = math.floor(x * s), math.floor(y * s)
        x1, y1 = max(x0 + 1, round((x + w) * s)), max(y0 + 1, round((y + h) * s))
        for row in range(y0, y1):
            self._span(row, x0, x1, colour)

    def line(self, points: list[tuple[float, float]], colour: Colour, width: float = 1.0,
             dash: tuple[float, ...] = ()) -> None:
        """A polyline ``width`` units thick (``dash``: on and off lengths, repeated)."""
        s = self.scale
        half = max(1.0, width * s) / 2
        period = sum(dash) * s
        walked = 0.0
        for (ax, ay), (bx, by) in zip(points, points[1:]):
            if not dash and (ax == bx or ay == by):  # an axis or a rule: a thin rectangle
                w = half * 2 / s
                self.rect(min(ax, bx) - w / 2, min(ay, by) - w / 2, abs(bx - ax) + w,
                          abs(by - ay) + w, colour)
                continue
            ax, ay, bx, by = ax * s, ay * s, bx * s, by * s
            length = math.hypot(bx - ax, by - ay)
            n = max(1, math.ceil(length))  # a dot a pixel: the brush is two pixels wide
            for i in range(n + 1):
                t = i / n
                if period and (walked + t * length) % period >= dash[0] * s:
                    continue
                cx, cy = ax + (bx - ax) * t, ay + (by - ay) * t
                for row in range(math.floor(cy - half), math.ceil(cy + half)):
                    self._span(row, math.floor(cx - half), math.ceil(cx + half), colour)
            walked += length

    def polygon(self, points: list[tuple[float, float]], colour: Colour) -> None:
        """Fill a polygon (even-odd), pixel centres inside."""
        s = self.scale
        pts = [(x * s, y * s) for x, y in points]
        ys = [y for _, y in pts]
        for row in range(max(0, math.floor(min(ys))), min(self.height, math.ceil(max(ys)))):
            cy = row + 0.5
            xs = sorted(ax + (cy - ay) * (bx - ax) / (by - ay)
                        for (ax, ay), (bx, by) in zip(pts, pts[1:] + pts[:1])
                        if (ay <= cy < by) or (by <= cy < ay))
            for left, right in zip(xs[::2], xs[1::2]):
                self._span(row, math.ceil(left - 0.5), math.floor(right - 0.5) + 1, colour)

    def png(self) -> bytes:
        return png(self.width, self.height, bytes(self.pixels))


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _numbers(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?[0-9]*\.?[0-9]+(?:e-?[0-9]+)?", text)]


def _pairs(values: list[float]) -> list[tuple[float, float]]:
    return list(zip(values[::2], values[1::2]))


def _draw(canvas: Canvas, el: ET.Element) -> None:
    tag, a = _local(el.tag), el.attrib
    if tag == "rect":
        fill = parse_colour(a.get("fill"))
        if fill:
            canvas.rect(*(float(a.get(k, 0)) for k in ("x", "y", "width", "height")), fill)
    elif tag in ("line", "polyline"):
        stroke = parse_colour(a.get("stroke"))
        if stroke is None:
            return
        pts = ([(float(a["x1"]), float(a["y1"])), (float(a["x2"]), float(a["y2"]))]
               if tag == "line" else _pairs(_numbers(a.get("points", ""))))
        dash = tuple(_numbers(a.get("stroke-dasharray", "")))
        canvas.line(pts, stroke, float(a.get("stroke-width", 1)), dash if len(dash) == 2 else ())
    elif tag == "path":  # the cut-bar marks: one closed polygon of straight segments
        fill = parse_colour(a.get("fill"))
        pts = _pairs(_numbers(a.get("d", "")))
        if fill and len(pts) >= 3:
            canvas.polygon(pts, fill)


def _words(el: ET.Element) -> str:
    """A ``<text>``'s words as HTML, each ``<tspan fill>`` in its colour."""
    out = escape(el.text or "")
    for child in el:
        colour = parse_colour(child.get("fill"))
        inner = escape("".join(child.itertext()))
        out += (f"<span style='color:{child.get('fill')}'>{inner}</span>" if colour
                else inner) + escape(child.tail or "")
    return out


def _label(el: ET.Element, width: float) -> str:
    x, y = float(el.get("x", 0)), float(el.get("y", 0))
    side = (f"right:{width - x:g}px" if el.get("text-anchor") == "end" else f"left:{x:g}px")
    colour = el.get("fill")
    colour_css = f";color:{colour}" if parse_colour(colour) and colour != "currentColor" else ""
    return (f"<span class='nbdist-chart-label' style='position:absolute;{side};"
            f"top:{y - 10:g}px;line-height:12px;white-space:nowrap{colour_css}'>"
            f"{_words(el)}</span>")


def static_chart(svg: str) -> str:
    """One chart of :mod:`nbdist.display.html` (an ``<svg>`` string) as HTML that survives
    sanitizing: its shapes in a PNG ``<img>``, its words in spans laid over the image, the
    same CSS class on the box; its hover text left out.

    Raises
    ------
    ValueError
        ``svg`` is not a chart's SVG (no width and height).
    """
    root = ET.fromstring(svg)
    try:
        width, height = float(root.attrib["width"]), float(root.attrib["height"])
    except KeyError as exc:
        raise ValueError("a chart's SVG has a width and a height") from exc
    canvas = Canvas(width, height)
    labels, title = [], ""
    for el in root.iter():
        if _local(el.tag) == "text":
            labels.append(_label(el, width))
            title = title or "".join(el.itertext())
        else:
            _draw(canvas, el)
    data = base64.b64encode(canvas.png()).decode("ascii")
    return (f"<div class='{escape(root.get('class', ''))} nbdist-static-chart' "
            f"style='position:relative;display:inline-block;width:{width:g}px;"
            f"height:{height:g}px;font-family:sans-serif;font-size:10px'>"
            f"<img src='data:image/png;base64,{data}' width='{width:g}' height='{height:g}' "
            f"alt='{escape(title)}' style='display:block;width:{width:g}px;"
            f"height:{height:g}px;margin:0'>{''.join(labels)}</div>")
