"""A rank's record of the cell line it runs (:class:`nbdist.runtime.fd_output.LineRecord`),
what is left when no stack dump runs (SIGKILL, the out-of-memory killer, ``os._exit``): a look
writes the innermost cell frame's line of the cell's thread, only when it changed; the cell's
start and end say so; ``os._exit`` writes the line of its own call; and what the notebook's
host reads of a dead process (:func:`~nbdist.runtime.fd_output.last_words`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nbdist.backends.base import poll_until
from nbdist.runtime import fd_output, last_words

CELL = "<distributed cell [7]>"


@pytest.fixture
def record(tmp_path):
    rec = fd_output.LineRecord(fd_output.paths(os.getpid(), str(tmp_path))["line"])
    yield rec
    rec.close()


def in_cell(record, source, started, release):
    """Run ``source`` as cell ``CELL`` on a thread that started ``record`` (``release`` is
    in its namespace, to wait on)."""
    record.start(CELL)
    started.set()
    exec(compile(source, CELL, "exec"), {"release": release, "time": time})


def held_cell(record, source):
    started, release = threading.Event(), threading.Event()
    t = threading.Thread(target=in_cell, args=(record, source, started, release))
    t.start()
    assert started.wait(10)
    return t, release


def read(tmp_path):
    return last_words.read_line(os.getpid(), str(tmp_path))


def test_a_look_writes_the_line_of_the_cells_thread_in_the_cell(record, tmp_path):
    # line 4 calls f, defined in the cell, which waits at line 3: the innermost cell frame
    t, release = held_cell(record, "x = 1\ndef f():\n    release.wait(10)\nf()\n")
    try:
        assert poll_until(lambda: (record.look(), read(tmp_path))[1]
                          == ("line 3 of In [7]", False), 10)
        assert open(record.path).read().strip() == f"seen 3 {CELL}"
    finally:
        release.set()
        t.join()


def test_the_cells_start_is_recorded_and_its_end_clears_it(record, tmp_path):
    threading.Thread(target=record.start, args=(CELL,)).start()
    assert poll_until(lambda: read(tmp_path) == ("the start of In [7]", False), 10)
    record.clear()
    assert read(tmp_path) is None
    record.look()  # no cell: nothing written
    assert read(tmp_path) is None


def test_an_unchanged_line_is_not_written_again(record, tmp_path, monkeypatch):
    t, release = held_cell(record, "release.wait(10)\n")
    try:
        assert poll_until(lambda: (record.look(), read(tmp_path))[1] is not None
                          and read(tmp_path)[0] == "line 1 of In [7]", 10)
        writes = []
        real = os.pwrite
        monkeypatch.setattr(os, "pwrite", lambda *a: writes.append(a) or real(*a))
        for _ in range(20):
            record.look()
        assert writes == []
    finally:
        release.set()
        t.join()


def test_a_shorter_record_leaves_no_trace_of_a_longer_one(record, tmp_path):
    record.start("<distributed cell [123456]>")
    record.start(CELL)
    assert read(tmp_path) == ("the start of In [7]", False)


def test_a_record_of_no_cell_says_nothing(tmp_path):
    path = fd_output.paths(4242, str(tmp_path))["line"]
    assert last_words.read_line(4242, str(tmp_path)) is None  # no file
    for text in ("", "seen 3 /home/u/train.py", "seen x <distributed cell 2>", "garbage"):
        with open(path, "w") as f:
            f.write(text)
        assert last_words.read_line(4242, str(tmp_path)) is None, text
    with open(path, "w") as f:
        f.write("at 9 <distributed cell 2>   ")
    assert last_words.read_line(4242, str(tmp_path)) == ("line 9 of <distributed cell 2>", True)


RANK = """\
import os, sys, time
from nbdist.runtime import fd_output
cap = fd_output.install(sys.argv[1])
cap.begin(lambda name, text: None, {cell!r})
exec(compile(sys.stdin.read(), {cell!r}, "exec"), {{"os": os, "time": time}})
"""


def rank_process(tmp_path, cell_source):
    """A process that captures its output into ``tmp_path`` and runs ``cell_source`` as a
    cell, with the reading thread's ticks as a rank has them."""
    proc = subprocess.Popen([sys.executable, "-c", RANK.format(cell=CELL), str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    proc.stdin.write(textwrap.dedent(cell_source).encode())
    proc.stdin.close()
    return proc


def test_os_exit_writes_the_line_of_its_call_before_the_process_ends(tmp_path):
    # no tick can see line 3: the cell gets there at once and the process ends there
    proc = rank_process(tmp_path, "x = 1\nif x:\n    os._exit(3)\ntime.sleep(30)\n")
    assert proc.wait(60) == 3
    assert last_words.read_line(proc.pid, str(tmp_path)) == ("line 3 of In [7]", True)


def test_after_sigkill_the_line_last_seen_is_left(tmp_path):
    proc = rank_process(tmp_path, "x = 1\nwhile True:\n    time.sleep(0.01)\n")
    try:
        seen = poll_until(lambda: last_words.read_line(proc.pid, str(tmp_path)), 30)
        assert poll_until(lambda: last_words.read_line(proc.pid, str(tmp_path))
                          == ("line 3 of In [7]", False), 30), seen
    finally:
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    assert last_words.read_line(proc.pid, str(tmp_path)) == ("line 3 of In [7]", False)


def test_last_words_of_a_dead_process_are_read_then_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(fd_output.tempfile, "gettempdir", lambda: str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    files = fd_output.paths(proc.pid)
    os.makedirs(os.path.dirname(files["line"]), exist_ok=True)
    with open(files["stderr"], "w") as f:
        f.write("last words\n")
    with open(files["line"], "w") as f:
        f.write(f"seen 5 {CELL}")
    assert last_words.last_words(proc.pid, host="not-" + socket.gethostname()) is None
    assert os.path.exists(files["line"])  # another host's answer: nothing read or removed
    assert last_words.last_words(proc.pid) == {"tail": ["last words"],
                                              "line": ("line 5 of In [7]", False)}
    assert not any(os.path.exists(p) for p in files.values())
    assert last_words.last_words(proc.pid) is None  # nothing left


def test_a_running_process_keeps_its_files(tmp_path, monkeypatch):
    monkeypatch.setattr(fd_output.tempfile, "gettempdir", lambda: str(tmp_path))
    files = fd_output.paths(os.getpid())
    os.makedirs(os.path.dirname(files["stderr"]), exist_ok=True)
    with open(files["stderr"], "w") as f:
        f.write("alive\n")
    assert last_words.last_words(os.getpid()) is None
    assert os.path.exists(files["stderr"])


def test_a_function_an_earlier_cell_defined_is_followed_into_that_cell(record, tmp_path):
    earlier: dict = {}
    exec(compile("def train(release):\n    x = 1\n    release.wait(10)\n",
                 "<distributed cell [6]>", "exec"), earlier)
    started, release = threading.Event(), threading.Event()

    def cell():
        record.start(CELL)
        started.set()
        exec(compile("train(release)\n", CELL, "exec"), {"train": earlier["train"],
                                                         "release": release})

    t = threading.Thread(target=cell)
    t.start()
    try:
        assert started.wait(10)
        assert poll_until(lambda: (record.look(), read(tmp_path))[1]
                          == ("line 3 of In [6]", False), 10), read(tmp_path)
    finally:
        release.set()
        t.join()
