"""A rank's file-descriptor output (:mod:`nbdist.runtime.fd_output`), in this process: what a
cell writes to fds 1 and 2 (itself, a child process, a C call) is read at its end in order,
output between cells waits for the next cell (bounded), a full file is replaced without losing
a byte, the files are the rank's own and go at close; and what is read of a dead rank's file:
the cell line of faulthandler's real dump, the lines a person reads."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from nbdist.runtime import fd_output, last_words
from nbdist.runtime.capture import captured_output
from nbdist.telemetry import events as ev


@pytest.fixture
def capture(tmp_path):
    """A capture of this process's fds 1 and 2 into ``tmp_path``, read only when asked."""
    before = [os.fstat(fd).st_ino for fd in (1, 2)]
    cap = fd_output.FdCapture(str(tmp_path), poll_s=0)
    yield cap
    cap.close()
    assert [os.fstat(fd).st_ino for fd in (1, 2)] == before  # 1 and 2 given back


def collect(cap):
    got: list[tuple[str, str]] = []
    cap.begin(lambda name, text: got.append((name, text)))
    return got


def joined(got, name):
    return "".join(t for n, t in got if n == name)


def test_what_a_cell_writes_to_fds_1_and_2_is_read_at_its_end_by_stream(capture):
    got = collect(capture)
    os.write(1, b"fd one\n")
    subprocess.run(["sh", "-c", "echo child out; echo child err >&2"], check=True)
    msg = b"from C\n"
    ctypes.CDLL(None).write(2, msg, len(msg))
    os.system("echo system")
    capture.end()
    assert joined(got, "stdout") == "fd one\nchild out\nsystem\n"
    assert joined(got, "stderr") == "child err\nfrom C\n"


def test_files_are_the_processs_own_and_removed_at_close(tmp_path):
    cap = fd_output.FdCapture(str(tmp_path), poll_s=0)
    files = fd_output.paths(os.getpid(), str(tmp_path))
    for path in files.values():
        assert str(os.getpid()) in os.path.basename(path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    cap.close()
    assert not any(os.path.exists(p) for p in files.values())


def test_between_cells_1_and_2_are_the_workers_own_and_a_childs_output_waits(capture):
    got = collect(capture)
    capture.end()
    assert os.fstat(1).st_ino != os.fstat(capture.streams[0].write_fd).st_ino
    # a child the cell started holds the file: what it writes now goes with the next cell
    os.write(capture.streams[1].write_fd, b"late\n")
    capture.drain()
    assert got == []
    got2 = collect(capture)
    assert got2 == [("stderr", "late\n")]
    capture.end()


def test_output_held_between_cells_is_bounded_and_says_what_it_dropped(capture, monkeypatch):
    monkeypatch.setattr(fd_output, "HELD_CHARS", 10)
    os.write(capture.streams[0].write_fd, b"0123456789abcdef")
    capture.drain()
    got = collect(capture)
    capture.end()
    assert got[0][0] == "stderr" and "6 characters" in got[0][1]
    assert joined(got, "stdout") == "6789abcdef"  # the latest kept


def test_a_full_file_is_replaced_without_losing_a_byte(tmp_path):
    cap = fd_output.FdCapture(str(tmp_path), rotate_bytes=64, poll_s=0)
    try:
        got = collect(cap)
        lines = [f"line {i:03d}\n".encode() for i in range(40)]
        for chunk in lines:
            os.write(2, chunk)
            if chunk.endswith(b"5\n"):
                cap.drain()  # a tick of the reading thread
        cap.end()
        assert joined(got, "stderr") == b"".join(lines).decode()
        path = fd_output.paths(os.getpid(), str(tmp_path))["stderr"]
        assert os.path.getsize(path) < 64 + 9 * 10  # the file stays bounded
        assert os.path.exists(path + ".old")
        # the tail reads the previous file and the current one
        assert last_words.read_tail(os.getpid(), str(tmp_path))[-1] == "line 039"
    finally:
        cap.close()
    assert os.listdir(tmp_path) == []


def test_a_print_and_fd_output_reach_the_sink_in_the_order_they_ran(tmp_path, monkeypatch):
    cap = fd_output.FdCapture(str(tmp_path), poll_s=0)
    monkeypatch.setattr(fd_output, "_capture", cap)

    class Sink:
        events: list = []

        def emit(self, e):
            self.events.append(e)

    try:
        with captured_output(Sink()):
            print("a")
            os.system("echo b")
            print("c")
            os.system("echo d")
    finally:
        cap.close()
    text = "".join(e["text"] for e in Sink.events if e["kind"] == ev.STREAM)
    assert text == "a\nb\nc\nd\n"


DUMP = """\
import faulthandler, os, sys, threading
f = open(sys.argv[1], "w")
faulthandler.enable(file=f, all_threads=True)
threading.Thread(target=threading.Event().wait, daemon=True).start()
os.write(f.fileno(), b"what the library said\\n")
code = "import os\\n\\ndef crash():\\n    os.abort()\\ncrash()\\n"
exec(compile(code, sys.argv[2], "exec"), {})
"""


@pytest.mark.parametrize("filename, line", [("<distributed cell [5]>", "line 4 of In [5]"),
                                            ("<distributed cell 3>",
                                             "line 4 of <distributed cell 3>")])
def test_the_cell_line_is_read_from_faulthandlers_own_dump(tmp_path, filename, line):
    out = tmp_path / "err"
    r = subprocess.run([sys.executable, "-c", DUMP, str(out), filename], timeout=60)
    assert r.returncode == -6  # SIGABRT, as torchrun reports it
    tail = [ln for ln in out.read_text().splitlines() if ln.strip()]
    assert any(filename in ln for ln in tail)
    assert last_words.cell_line(tail) == line
    assert last_words.told(tail) == ["what the library said"]


def test_no_dump_no_cell_line():
    assert last_words.cell_line(["Segmentation fault", 'File "x.py", line 3 in f']) is None
    assert last_words.told(["a", "b", "c"], lines=2) == ["b", "c"]


def test_a_dead_ranks_tail_is_read_then_removed(tmp_path):
    files = fd_output.paths(4242, str(tmp_path))
    with open(files["stderr"], "w") as f:
        f.write(textwrap.dedent("""\
            early

            terminate called after throwing an instance of 'gloo::EnforceNotMet'
        """))
    assert last_words.read_tail(4242, str(tmp_path)) == [
        "early", "terminate called after throwing an instance of 'gloo::EnforceNotMet'"]
    last_words.remove(4242, str(tmp_path))
    assert os.listdir(tmp_path) == []
    assert last_words.read_tail(4242, str(tmp_path)) == []
