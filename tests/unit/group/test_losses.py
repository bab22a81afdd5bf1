"""How a lost worker is named (:func:`nbdist.group.losses.lost_worker`): the engine's cause,
the out-of-memory killer where this host counted a kill during the cell, and the cell line
from what the rank left (a stack dump where one ran, else its record, "last seen"); read on
this host or through the engine for another host; and the same words in ``status``'s row.
``%nbdist stop`` removes what dead ranks left on this host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any, Optional

import pytest

from nbdist.backends.base import Backend, Call, Outcome, Submission
from nbdist.group import losses
from nbdist.group.membership import Membership
from nbdist.runtime import fd_output
from nbdist.runtime.env import RankPlan

HERE = socket.gethostname()


class Done(Submission):
    def __init__(self, calls: list[Call]):
        self.calls = calls

    def wait(self, timeout: Optional[float]) -> bool:
        return True

    def pending(self) -> list:
        return []

    def outcomes(self) -> list[Outcome]:
        return [Outcome(c.worker, {"hostname": HERE, "pid": 1, "device": "cpu", "rss": 0},
                        None) for c in self.calls]

    def drain_events(self) -> list:
        return []


class Engine(Backend):
    """Two workers, ``w1`` gone: the engine says how it ended, and answers for another
    host with ``words``."""

    name = "fake"

    def __init__(self, cause: Optional[str], words: Optional[dict] = None) -> None:
        super().__init__()
        self.cause, self.words, self.asked = cause, words, []

    def worker_ids(self) -> list:
        return ["w0"]

    def submit(self, calls: Any) -> Done:
        return Done(list(calls))

    def exit_cause(self, worker: Any, pid: Optional[int]) -> Optional[str]:
        return self.cause

    def last_words(self, worker: Any, host: Optional[str], pid: int) -> Optional[dict]:
        self.asked.append((worker, host, pid))
        return self.words

    def describe(self) -> str:
        return "fake engine"

    def _start(self, n: int, timeout: float) -> None: ...
    def connect(self, timeout: float, **target: Any) -> None: ...
    def interrupt(self, workers: Any) -> None: ...
    def transport(self) -> Any: ...


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(fd_output.tempfile, "gettempdir", lambda: str(tmp_path))
    os.makedirs(fd_output.directory(), exist_ok=True)
    return tmp_path


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


def job(engine: Backend, pid: int, host: str = HERE) -> Membership:
    m = Membership(stores=None)
    m.backend = engine
    m.plans = [RankPlan(w, host, r, r, 2, 2, 0, 1, "127.0.0.1", 1, None)
               for r, w in enumerate(("w0", "w1"))]
    m.infos = {"w0": {"hostname": HERE, "pid": os.getpid()},  # type: ignore[typeddict-item]
               "w1": {"hostname": host, "pid": pid}}
    return m


def left(pid: int, stderr: str = "", line: str = "") -> dict[str, str]:
    files = fd_output.paths(pid)
    for name, text in (("stderr", stderr), ("line", line)):
        with open(files[name], "w") as f:
            f.write(text)
    return files


def test_an_oom_kill_is_named_with_the_line_last_seen_and_its_status_row(folder, dead_pid,
                                                                         monkeypatch):
    files = left(dead_pid, "allocating\n", "seen 5 <distributed cell [4]>")
    monkeypatch.setattr(losses, "_oom_kills", lambda fresh_s=0.0: 3)  # 2 before the cell
    m = job(Engine("SIGKILL"), dead_pid)
    lost = losses.lost_worker(m, "w1", 1, oom_before=2, by="nbdist")
    assert lost.reason == ("SIGKILL, by the kernel's out-of-memory killer, last seen at line 5 "
                           "of In [4]")
    assert lost.gone() == f"its worker (pid {dead_pid}) died: {lost.reason}"
    assert lost.said() == "its last lines on stderr:\n    allocating\n"
    assert not any(os.path.exists(p) for p in files.values())  # read, then removed
    # %nbdist status says it in the same words, on the dead rank's row
    [row] = [r for r in m.status().rows if r.rank == 1]
    assert not row.alive and row.state == f"died: {lost.reason}"
    assert f"died: {lost.reason}" in repr(m.status())


def test_no_kill_counted_no_oom_words(folder, dead_pid, monkeypatch):
    left(dead_pid, "", "seen 5 <distributed cell [4]>")
    monkeypatch.setattr(losses, "_oom_kills", lambda fresh_s=0.0: 2)
    lost = losses.lost_worker(job(Engine("SIGKILL"), dead_pid), "w1", 1, oom_before=2)
    assert lost.reason == "SIGKILL, last seen at line 5 of In [4]"


def test_a_dump_names_the_line_it_died_at_over_the_record(folder, dead_pid):
    dump = ("Fatal Python error: Aborted\n\nCurrent thread 0x01 (most recent call first):\n"
            '  File "<distributed cell [4]>", line 3 in <module>\n')
    left(dead_pid, "terminate called\n" + dump, "seen 2 <distributed cell [4]>")
    lost = losses.lost_worker(job(Engine("SIGABRT"), dead_pid), "w1", 1, 0)
    assert lost.reason == "SIGABRT at line 3 of In [4]"
    assert lost.tail == ("terminate called",)


def test_os_exits_line_is_exact(folder, dead_pid):
    left(dead_pid, "", "at 4 <distributed cell [4]>")
    lost = losses.lost_worker(job(Engine("exit status 3"), dead_pid), "w1", 1, 0)
    assert lost.reason == "exit status 3 at line 4 of In [4]"


def test_another_hosts_words_come_through_the_engine(folder):
    words = {"tail": ["far away"], "line": ("line 6 of In [2]", False)}
    engine = Engine("SIGKILL", words)
    lost = losses.lost_worker(job(engine, 777, host="elsewhere"), "w1", 1, 0)
    assert engine.asked == [("w1", "elsewhere", 777)]
    assert lost.reason == "SIGKILL, last seen at line 6 of In [2]"
    assert lost.tail == ("far away",) and lost.kept_at is None


def test_where_the_engine_cannot_read_another_host_the_path_is_named(folder):
    lost = losses.lost_worker(job(Engine("SIGKILL"), 777, host="elsewhere"), "w1", 1, 0)
    assert lost.reason == "SIGKILL" and lost.tail == ()
    assert lost.said() == f"its stderr is kept in elsewhere:{fd_output.paths(777)['stderr']}\n"


def test_stop_removes_dead_ranks_files_on_this_host_and_keeps_running_ones(folder, dead_pid):
    dead = left(dead_pid, "bye\n", "seen 1 <distributed cell [1]>")
    alive = left(os.getpid(), "still here\n")
    losses.remove_leftovers(job(Engine(None), dead_pid))
    assert not any(os.path.exists(p) for p in dead.values())
    assert os.path.exists(alive["stderr"])
