"""Ranks hand frames to their node's forwarder through spool files: in order, bounded, and a
lagging forwarder costs the rank dropped batches, counted, never a wait. A spool directory
a killed forwarder left is removed by the next one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from nbdist.agent import wire
from nbdist.agent.spool import SpoolReader, SpoolWriter


def _messages(reader):
    return [(pid, wire.decode(frame[4:])) for pid, frame in reader.read()]


def test_frames_arrive_in_order_across_segments_and_read_segments_go(tmp_path):
    w = SpoolWriter(str(tmp_path), pid=11, segment=100, max_segments=1000)
    reader = SpoolReader(str(tmp_path))
    for i in range(30):
        assert w.write(wire.encode({"i": i, "pad": "x" * 20}))
    got = _messages(reader)
    assert [m["i"] for _, m in got] == list(range(30)) and {p for p, _ in got} == {11}
    # every segment but the one still written was read to its end and removed
    assert sorted(os.listdir(tmp_path)) == [f"11.{w._n}"]
    w.write(wire.encode({"i": 30}))
    assert [m["i"] for _, m in _messages(reader)] == [30]


def test_two_processes_are_read_apart(tmp_path):
    a, b = SpoolWriter(str(tmp_path), pid=1), SpoolWriter(str(tmp_path), pid=2)
    a.write(wire.encode({"who": "a"}))
    b.write(wire.encode({"who": "b"}))
    assert _messages(SpoolReader(str(tmp_path))) == [(1, {"who": "a"}), (2, {"who": "b"})]


def test_a_frame_half_written_waits_for_its_rest(tmp_path):
    frame = wire.encode({"x": 1})
    with open(tmp_path / "5.0", "wb") as f:
        f.write(frame[:6])
    reader = SpoolReader(str(tmp_path))
    assert reader.read() == []
    with open(tmp_path / "5.0", "ab") as f:
        f.write(frame[6:])
    assert reader.read() == [(5, frame)]


def test_a_lagging_forwarder_makes_the_rank_drop_and_count_batches_not_wait(tmp_path):
    w = SpoolWriter(str(tmp_path), pid=3, segment=50, max_segments=2)
    sent = [w.write(wire.encode({"i": i, "pad": "x" * 40})) for i in range(10)]
    # no reader: two segments are written, then batches are dropped and counted
    assert sent[:2] == [True, True] and not any(sent[2:])
    assert w.dropped == 8
    assert w.write(wire.encode({"type": "exit"}), droppable=False)  # its end always goes
    got = [m for _, m in _messages(SpoolReader(str(tmp_path)))]
    assert [m.get("i") for m in got] == [0, 1, None] and got[-1] == {"type": "exit"}
    # the forwarder caught up: the rank writes again
    assert w.write(wire.encode({"i": 99}))
    assert w.dropped == 8


def test_commands_are_seen_once_whole_and_never_as_frames(tmp_path):
    from nbdist.agent.spool import read_commands, write_command

    seen: set[str] = set()
    assert read_commands(str(tmp_path), seen) == []
    write_command(str(tmp_path), {"type": "stacks", "id": 1, "job": "j", "rank": None})
    (tmp_path / "cmd-stacks-2.tmp").write_bytes(b"half")  # being written: not yet a command
    assert read_commands(str(tmp_path), seen) == [{"type": "stacks", "id": 1, "job": "j",
                                                   "rank": None}]
    assert read_commands(str(tmp_path), seen) == []
    assert SpoolReader(str(tmp_path)).read() == []  # the forwarder does not read them back


LAUNCHER = """
import sys, tempfile, time
from nbdist.agent import wire
from nbdist.agent.forwarder import Forwarder
d = tempfile.mkdtemp(prefix="nbdist-attach-", dir=sys.argv[1])
Forwarder(wire.parse("tcp://127.0.0.1:9/t"), d).start()
print(d, flush=True)
time.sleep(120)
"""


def test_a_killed_forwarders_directory_is_removed_by_the_next_forwarder(tmp_path):
    """A launcher SIGKILLed (its exit never runs) leaves its spool directory; the next
    forwarder to start removes it, and only what is stale: a directory whose forwarder runs,
    or one a rank still writes to, stays."""
    from nbdist.agent.forwarder import Forwarder

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        left = launcher.stdout.readline().strip()
        assert os.path.isdir(left) and os.path.dirname(left) == str(tmp_path)
        # a rank of a job whose forwarder died writes on; a pid now someone else's
        writing = tmp_path / "nbdist-attach-writing"
        reused = tmp_path / "nbdist-attach-reused"
        for d in (writing, reused):
            d.mkdir()
        (writing / "owner").write_text(f"{_dead_pid()} 1\n")
        (writing / f"{os.getpid()}.0").write_bytes(b"")
        (reused / "owner").write_text(f"{os.getpid()} 1\n")  # another process's start
        (tmp_path / "nbdist-attach-foreign").mkdir()  # no owner: not one of these
        address = wire.parse("tcp://127.0.0.1:9/t")
        first = Forwarder(address, str(tmp_path / "nbdist-attach-a"))
        (tmp_path / "nbdist-attach-a").mkdir()
        first.start()
        assert os.path.isdir(left)  # its launcher runs
        assert not reused.exists() and writing.is_dir()
        launcher.kill()
        launcher.wait(timeout=30)
        assert os.path.isdir(left)  # killed: its exit did not remove it
        (tmp_path / "nbdist-attach-b").mkdir()
        second = Forwarder(address, str(tmp_path / "nbdist-attach-b")).start()
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "nbdist-attach-a", "nbdist-attach-b", "nbdist-attach-foreign",
            "nbdist-attach-writing"]
        for f in (first, second):
            f.close(timeout=0.1)
        assert not (tmp_path / "nbdist-attach-a").exists()  # each removes its own at exit
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    return int(done.stdout)


#: a rank whose end only its exit status tells: it writes its end aside, forks a child that
#: exits 7 (its status must not be taken for the rank's), waits for a line, and raises
#: SystemExit(4) itself
ENDS_ASIDE = """
import os, sys
from nbdist.agent import wire
from nbdist.agent.spool import SpoolWriter
w = SpoolWriter(sys.argv[1])
assert w.record_exit_status()
w.write(wire.encode({"type": "rank", "rank": 1}))
w.end_aside(wire.encode({"type": "exit", "rank": 1, "ok": True, "error": None}))
child = os.fork()
if child == 0:
    sys.exit(7)
assert os.waitpid(child, 0)[1] >> 8 == 7
print("ready", flush=True)
sys.stdin.readline()
raise SystemExit(4)
"""


def test_an_end_written_aside_is_read_when_the_process_ended_with_its_exit_status(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", ENDS_ASIDE, str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "ready\n"
        reader = SpoolReader(str(tmp_path))
        # running: its end is not known yet, the frames before it are read
        assert [m["type"] for _, m in _messages(reader)] == ["rank"]
        rank.stdin.write("\n")
        rank.stdin.close()
        assert rank.wait(timeout=60) == 4
        ((pid, end),) = _messages(reader)
        assert pid == rank.pid and end["type"] == "exit"
        assert end["ok"] is False and end["error"] == "exited with status 4"
        assert end["failed_at"] is not None
        assert sorted(os.listdir(tmp_path)) == [f"{rank.pid}.0"]  # the end's files taken
        assert _messages(reader) == []  # once
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def test_a_directory_that_names_no_forwarder_is_removed_once_it_is_old_and_nobody_writes(
        tmp_path):
    """A launcher killed between making its directory and claiming it (or an nbdist from
    before owners) leaves a directory with rank files only: swept after
    ``UNCLAIMED_AFTER`` seconds untouched, once none of its ranks runs; a new one may be
    about to be claimed and stays."""
    from nbdist.agent.spool import UNCLAIMED_AFTER, sweep

    old, new, busy = (tmp_path / f"nbdist-attach-{n}" for n in ("old", "new", "busy"))
    for d in (old, new, busy):
        d.mkdir()
    (old / f"{_dead_pid()}.0").write_bytes(b"x")
    (busy / f"{os.getpid()}.0").write_bytes(b"x")  # a rank that still runs writes here
    past = time.time() - UNCLAIMED_AFTER - 60
    for d in (old, busy):
        os.utime(d, (past, past))
    assert sweep(str(tmp_path)) == [str(old)]
    assert not old.exists() and new.is_dir() and busy.is_dir()
