"""Pure views and error records: stream prefixing, status tables, multi-rank errors."""

import io

from nbdist.errors import DistributedError, RankFailure
from nbdist.records import ClusterStatus, RemoteValue, WorkerRow
from nbdist.runtime.capture import _coalesce
from nbdist.runtime.execute import format_error, mimebundle, run_code
from nbdist.telemetry.events import stream


def batch(rank, seq, *events):
    return {"rank": rank, "seq": seq, "events": list(events)}


def test_stream_view_prefixes_lines_and_filters_ranks():
    from nbdist.display.text import StreamView

    out, err = io.StringIO(), io.StringIO()
    view = StreamView("rank0", stdout=out, stderr=err)
    view.feed([batch(0, 1, stream("stdout", "a\nb")), batch(1, 1, stream("stdout", "hidden\n"))])
    view.feed([batch(0, 2, stream("stdout", "c\n"), stream("stderr", "warn\n"))])
    view.close()
    assert out.getvalue() == "[0] a\n[0] bc\n"
    assert err.getvalue() == "[0] warn\n"


def test_stream_view_all_and_quiet():
    from nbdist.display.text import StreamView

    out = io.StringIO()
    view = StreamView("all", stdout=out)
    view.feed([batch(1, 1, stream("stdout", "x\n")), batch(0, 1, stream("stdout", "y"))])
    view.close()
    assert sorted(out.getvalue().splitlines()) == ["[0] y", "[1] x"]
    quiet = io.StringIO()
    v = StreamView("quiet", stdout=quiet)
    v.feed([batch(0, 1, stream("stdout", "x\n"))])
    assert quiet.getvalue() == ""


def test_coalesce_merges_consecutive_chunks_of_one_stream():
    evs = [stream("stdout", "a"), stream("stdout", "b"), stream("stderr", "c"),
           stream("stdout", "d")]
    assert _coalesce(evs) == [stream("stdout", "ab"), stream("stderr", "c"),
                              stream("stdout", "d")]


def test_distributed_error_names_cause_and_consequences():
    cause = RankFailure(1, "hostB", "ZeroDivisionError", "division by zero",
                        "Traceback...\n  File \"<distributed cell 3>\", line 2\n", line=2)
    peer = RankFailure(0, "hostA", "RuntimeError", "[pair.cc:553] Connection closed by peer")
    err = DistributedError([peer, cause])
    assert err.ranks == [0, 1]
    assert err.causes == [cause]
    assert "rank 1" in str(err) and "ZeroDivisionError" in str(err)
    assert "rank 0 stopped because of it" in str(err)
    rendered = "\n".join(err._render_traceback_())
    assert "rank 1 on hostB" in rendered and "cell line 2" in rendered
    assert "<distributed cell 3>" in rendered


def test_run_code_returns_last_expression_and_keeps_namespace():
    ns = {"__name__": "__main__"}
    assert run_code("x = 2\nx * 21", "<t1>", ns) == 42
    assert run_code("y = x + 1", "<t2>", ns) is None and ns["y"] == 3
    assert ns["_"] == 42


def test_format_error_keeps_cell_frames_and_line():
    ns = {}
    try:
        run_code("a = 1\n\ndef f():\n    return 1 / 0\nf()", "<cell 9>", ns)
    except ZeroDivisionError as exc:
        info = format_error(exc, "<cell 9>")
    assert info["ename"] == "ZeroDivisionError" and info["line"] == 4
    assert '"<cell 9>", line 5' in info["traceback"]
    assert "return 1 / 0" in info["traceback"]  # the cell's own source line is shown
    assert "execute.py" not in info["traceback"]


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


def test_status_renders_text_and_escaped_html():
    st = ClusterStatus("ipyparallel", 2, (
        WorkerRow(0, "0", "h<1>", 10, "cpu", True, 300.0),
        WorkerRow(1, "1", "h2", None, None, False, None, "gone")))
    text = repr(st)
    assert "1/2 workers alive" in text and "NO" in text
    html = st._repr_html_()
    assert "h&lt;1&gt;" in html and "<table>" in html


def test_communication_failures_are_told_apart_from_code_errors():
    from nbdist.errors import RankFailure

    def failure(ename, evalue):
        return RankFailure(0, "host", ename, evalue)

    assert failure("RuntimeError", "[gloo] Timed out waiting 8000ms for recv").communication
    assert failure("ValueError", "Default process group has not been initialized, "
                   "please make sure to call init_process_group.").communication
    assert failure("RuntimeError", "Connection closed by peer [127.0.0.1]:1").communication
    assert not failure("ValueError", "bad shard on rank one").communication
