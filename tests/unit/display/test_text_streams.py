"""Workers' output in the notebook: rank prefixes and filtering (:class:`StreamView`)."""

from __future__ import annotations

import io

from nbdist.display.text import StreamView
from nbdist.telemetry.events import stream


def batch(rank, seq, *events):
    return {"rank": rank, "seq": seq, "events": list(events)}


def test_stream_view_prefixes_lines_and_filters_ranks():
    out, err = io.StringIO(), io.StringIO()
    view = StreamView("rank0", stdout=out, stderr=err)
    view.feed([batch(0, 1, stream("stdout", "a\nb")), batch(1, 1, stream("stdout", "hidden\n"))])
    view.feed([batch(0, 2, stream("stdout", "c\n"), stream("stderr", "warn\n"))])
    view.close()
    assert out.getvalue() == "[0] a\n[0] bc\n"
    assert err.getvalue() == "[0] warn\n"


def test_stream_view_all_and_quiet():
    out = io.StringIO()
    view = StreamView("all", stdout=out)
    view.feed([batch(1, 1, stream("stdout", "x\n")), batch(0, 1, stream("stdout", "y"))])
    view.close()
    assert sorted(out.getvalue().splitlines()) == ["[0] y", "[1] x"]
    quiet = io.StringIO()
    v = StreamView("quiet", stdout=quiet)
    v.feed([batch(0, 1, stream("stdout", "x\n"))])
    assert quiet.getvalue() == ""
