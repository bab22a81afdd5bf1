"""The debugger's notebook half and faults on purpose, on a scripted session: the console that
answers the ranks' prompts (one at a time, the rank named, the waiting ranks said, the time
given back to --timeout), ``%nbdist debug``'s choice of rank and its refusals, the hang
doctor's verdict while a rank is in the debugger, and ``%nbdist kill`` / ``hang``."""

from __future__ import annotations

import json
import signal
import time

import pytest
from fakes import FakeStore, Scripted, ScriptedBackend

from nbdist.debugger import console as debugging
from nbdist.debugger.console import STICKY_S, Console, where
from nbdist.debugger.faults import signal_number
from nbdist.errors import (
    DebuggerQuit,
    DebuggerUnavailable,
    DistributedError,
    NoClusterError,
    NothingToDebug,
    OptionError,
    RankFailure,
    cell_error,
)
from nbdist.session import Session
from nbdist.telemetry import events as ev
from nbdist.telemetry.aggregate import RunState
from nbdist.telemetry.stall.words import headline, where_lines

CELL = "<distributed cell [5]>"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(rank: int, n: int, *, mode: str = "pdb", line: int = 3, text: str = "") -> dict:
    p = f"(Pdb rank {rank}) " if mode == "pdb" else f"[rank {rank}] name? "
    return {"rank": rank, "seq": n, "events": [
        ev.input_request(n, p, text=text, mode=mode, file=CELL, line=line, func="<module>")]}


class User:
    """Types the scripted lines; the console's store and screen, in memory."""

    def __init__(self, clock: Clock, lines: list, typing_s: float = 0.0) -> None:
        self.clock, self.lines, self.typing_s = clock, list(lines), typing_s
        self.asked: list[str] = []
        self.said: list[str] = []
        self.store: dict[str, dict] = {}

    def ask(self, text: str):
        self.asked.append(text)
        self.clock.now += self.typing_s
        return self.lines.pop(0)

    def say(self, text: str, end: str = "\n") -> None:
        self.said.append(text + end)

    def answer(self, key: str, value: bytes) -> None:
        self.store[key] = json.loads(value)

    def console(self, **kw) -> Console:
        return Console("k", self.answer, ask=self.ask, say=self.say, clock=self.clock, **kw)


def test_prompts_are_asked_one_at_a_time_the_rank_named_and_the_waiting_ranks_said():
    clock = Clock()
    user = User(clock, ["p x", "c", "c"])
    c = user.console(group_timeout=300)
    c.feed([prompt(1, 1, text="> cell(3)\n"), prompt(0, 1)])
    c.tick({0, 1})
    assert user.asked == ["(Pdb rank 1) "]  # the oldest first; one prompt per pass
    assert user.store == {"k/1/1": {"line": "p x"}}
    assert user.said[0].startswith("nbdist: rank 1 is in the debugger at In [5], line 3. Ranks "
                                   "that wait for it in a collective give up after the process "
                                   "group's timeout (300 s")
    assert user.said[1] == ("nbdist: rank 0 also waits for the debugger; each gets its turn "
                            "when rank 1 carries on\n")
    assert user.said[2] == "> cell(3)\n"  # what pdb printed, before its prompt
    # rank 1 answered last: its next prompt may be on its way, so rank 0 waits a moment
    c.tick({0, 1})
    assert len(user.asked) == 1
    c.feed([prompt(1, 2)])
    c.tick({0, 1})
    assert user.asked[-1] == "(Pdb rank 1) " and user.store["k/1/2"] == {"line": "c"}
    c.tick({0, 1})
    assert len(user.asked) == 2  # rank 1 went on; rank 0 is next once the moment passed
    clock.now += STICKY_S
    c.tick({0, 1})
    assert user.asked[-1] == "(Pdb rank 0) " and user.store["k/0/1"] == {"line": "c"}
    assert user.said[-1] == "nbdist: rank 0 is in the debugger at In [5], line 3\n"
    assert c.waiting() == []


def test_time_at_a_prompt_is_given_back_to_the_cells_timeout():
    clock = Clock()
    user = User(clock, ["c", "c"], typing_s=5.0)
    c = user.console()
    assert c.paused() == 0
    c.feed([prompt(1, 1), prompt(2, 1)])
    clock.now += 1.0  # waiting in the queue counts as paused too
    assert c.paused() == 1.0
    c.tick({1, 2})
    assert c.paused() == 6.0  # still open: rank 2 waits
    clock.now += STICKY_S
    c.tick({1, 2})
    assert c.paused() == 6.0 + STICKY_S + 5.0 and not c.open
    clock.now += 10
    assert c.paused() == 6.0 + STICKY_S + 5.0  # nothing open: the clock runs again


def test_without_stdin_every_prompt_gets_no_answer_and_dead_ranks_are_dropped():
    clock = Clock()
    user = User(clock, [None])
    c = user.console()
    c.feed([prompt(0, 1), prompt(1, 1, mode="input")])
    c.tick({0, 1})
    assert user.store == {"k/0/1": {"line": None}} and not c.stdin
    c.tick({0, 1})  # rank 1's prompt gets no answer, at once and without asking
    assert user.store["k/1/1"] == {"line": None} and user.asked == ["(Pdb rank 0) "]
    c.feed([prompt(3, 1)])
    c.tick({0, 1})  # rank 3 is not running any more: its prompt goes, unasked
    assert not c.open and "k/3/1" not in user.store


def test_a_passed_breakpoint_is_one_line_naming_the_rank_and_the_line():
    user = User(Clock(), [])
    c = user.console(why="no stdin here")
    c.feed([{"rank": 1, "seq": 1, "events": [
        ev.debugger("skip", 0.0, file=CELL, line=4, func="train", text="breakpoint()"),
        ev.debugger("leave", 0.0, text="bye\n")]}])
    assert user.said == ["nbdist: rank 1 passed breakpoint() at In [5], line 4, in train: no "
                         "one can answer (no stdin here); it carries on, as with "
                         "PYTHONBREAKPOINT=0\n", "bye\n"]


def test_places_read_as_the_editor_numbers_them():
    assert where(CELL, 3) == "In [5], line 3"
    assert where("<distributed cell 2>", 3, "<module>") == "cell line 3"
    assert where("/x/train.py", 9, "step") == "/x/train.py, line 9, in step"


# ----------------------------------------------------------------- on a scripted session
@pytest.fixture
def backend() -> ScriptedBackend:
    return ScriptedBackend(2)


@pytest.fixture
def session(backend) -> Session:
    s = Session(backends=lambda engine: backend, stores=None).start(2, timeout=5)
    s.membership.store = FakeStore()  # as if the notebook hosted the job's store
    return s


def test_a_cell_with_a_prompt_open_is_not_timed_out_for_it(session, backend, monkeypatch):
    store = session.membership.store
    monkeypatch.setattr(debugging, "stdin_state", lambda: (True, ""))

    def typed_slowly(text: str) -> str:
        time.sleep(0.6)  # the user reads, thinks, types: longer than the cell's --timeout
        return "c"

    monkeypatch.setattr(debugging, "ask_user", typed_slowly)
    answered = lambda: any(k.endswith("/1/1") for k in store.values)  # noqa: E731
    backend.script(r1=Scripted(batches=[prompt(1, 1)], until=answered))
    t0 = time.monotonic()
    session.run_cell("breakpoint()", timeout=0.3)  # no CellTimeoutError
    assert time.monotonic() - t0 >= 0.6
    link = backend.submitted[-1].kwargs["link"]
    [key] = [k for k in store.values if k.startswith(link.key)]  # besides ranks' end marks
    assert json.loads(store.values[key]) == {"line": "c"}
    assert link.stdin


def test_no_one_can_answer_without_stdin_or_the_notebooks_store(session, backend,
                                                                 monkeypatch):
    session.run_cell("x = 1")
    assert not backend.submitted[-1].kwargs["link"].stdin  # pytest's captured stdin
    with pytest.raises(DebuggerUnavailable, match="runs without a front end"):
        monkeypatch.setattr(debugging, "stdin_state",
                            lambda: (False, debugging.NO_KERNEL_STDIN))
        session.debug()
    session.membership.store = None  # rank 0's worker hosts the store
    monkeypatch.setattr(debugging, "stdin_state", lambda: (True, ""))
    session.run_cell("x = 1")
    link = backend.submitted[-1].kwargs["link"]
    assert not link.stdin and link.why == debugging.NO_STORE
    with pytest.raises(DebuggerUnavailable, match="rank 0's worker hosts it"):
        session.debug()


def failure(t: float, *, communication: bool = False, by_peer: bool = False) -> dict:
    return {"ename": "ValueError", "evalue": "bad", "line": 4, "file": CELL,
            "communication": communication, "caused_by_peer": by_peer, "t": t}


def test_debug_opens_on_the_first_rank_that_failed(session, backend, monkeypatch, capsys):
    monkeypatch.setattr(debugging, "stdin_state", lambda: (True, ""))
    w0, w1 = backend.ids
    with pytest.raises(NothingToDebug, match="nothing to debug: no rank's last cell failed"):
        session.debug()
    # rank 0 failed first, but only because it lost its peer: rank 1 is the one to inspect
    backend.failures = {w0: failure(1.0, communication=True, by_peer=True), w1: failure(2.0)}
    store = session.membership.store
    backend.script(r1=Scripted(batches=[prompt(1, 1)],
                               until=lambda: any(k.endswith("/1/1") for k in store.values)))
    monkeypatch.setattr(debugging, "ask_user", lambda text: "q")
    assert session.debug() == 1
    assert backend.submitted[-1].fn.__name__ == "post_mortem"
    assert backend.submitted[-1].worker == w1
    assert "nbdist: post-mortem of rank 1: ValueError: bad at In [5], line 4" in \
        capsys.readouterr().out
    backend.failures = {w1: failure(2.0)}
    with pytest.raises(NothingToDebug, match=r"rank 0 has no failure to inspect; rank with "
                                             r"one: 1 \(%nbdist debug 1\)"):
        session.debug(0)
    with pytest.raises(OptionError):
        session.debug(5)


def test_q_is_raised_as_debugger_quit_naming_the_rank():
    quit_ = RankFailure(1, "h", "DebuggerQuit", "rank 1 quit the debugger (q)", line=3)
    lost = RankFailure(0, "h", "RuntimeError", "Connection closed by peer",
                       communication=True, caused_by_peer=True)
    err = cell_error([quit_, lost])
    assert type(err) is DebuggerQuit and isinstance(err, DistributedError)
    assert str(err).startswith("cell failed on rank 1: DebuggerQuit: rank 1 quit the debugger")
    assert type(cell_error([RankFailure(1, "h", "ValueError", "x")])) is DistributedError


# ----------------------------------------------------------------- the hang doctor
def stall_waiting(rank: int, t: float) -> dict:
    return ev.stack(t, "stall", 30.0, [{"file": CELL, "line": 4, "name": "<module>",
                                        "cell": True, "code": "dist.all_reduce(x)"}],
                    collective={"op": "all_reduce", "seq": 1, "bytes": 4, "dtype": "float32",
                                "since": t - 30})


def test_a_rank_in_the_debugger_is_said_at_once_and_is_no_hang():
    state = RunState([0, 1], started=0.0, stall_after=2)
    state.feed([{"rank": 1, "seq": 1, "events": [
        ev.debugger("enter", 1.0, file=CELL, line=3, func="<module>")]}])
    v = state.stall_report(1.5)  # before any threshold: the run waits for the user
    assert v is not None and [s.describe() for s in v.stopped] == \
        ["rank 1 is in the debugger (line 3)"]
    # rank 0 waits in its all_reduce far past --stall-after: still no hang verdict
    state.feed([{"rank": 0, "seq": 1, "events": [stall_waiting(0, 40.0)]}])
    v = state.stall_report(40.0)
    assert not v.hang and v.missing == () and v.rank(1).status == "debugging"
    assert headline(v).startswith("rank 1 is in the debugger (line 3); rank 0 waits in "
                                  "all_reduce")
    assert "rank 1: in the debugger at In [5], line 3" in where_lines(v, "In [5]")
    # it goes on: the time it spent there is not time without progress
    state.feed([{"rank": 1, "seq": 2, "events": [ev.debugger("leave", 41.0)]}])
    assert state.stall_report(42.0) is None
    state.feed([{"rank": 0, "seq": 2, "events": [stall_waiting(0, 43.0)]}])
    v = state.stall_report(43.5)  # then the stall clock runs again, from when it went on
    assert v is not None and not v.stopped and 2.0 < v.idle_s < 3.0


# ----------------------------------------------------------------- faults on purpose
def test_signals_are_read_by_name_or_number():
    assert signal_number("SIGKILL") == signal_number("kill") == signal_number("9") == 9
    assert signal_number("term") == signal.SIGTERM
    with pytest.raises(OptionError, match="no signal named 'SIGNOPE'"):
        signal_number("SIGNOPE")


def test_kill_now_or_some_seconds_into_the_next_cell(session, backend, capsys):
    w0, w1 = backend.ids
    assert session.kill(1) == f"sent SIGKILL to rank 1 (pid {w1} on hostA)"
    assert backend.signals == [(w1, signal.SIGKILL, w1)]
    assert "gets SIGTERM 0.05 s into the next" in session.kill(0, "SIGTERM", after=0.05)
    backend.script(r0=Scripted(until=lambda: len(backend.signals) == 2),
                   r1=Scripted(until=lambda: len(backend.signals) == 2))
    session.run_cell("train()")
    assert backend.signals[-1] == (w0, signal.SIGTERM, w0)
    assert "nbdist: sent SIGTERM to rank 0" in capsys.readouterr().out
    session.kill(1, after=60)
    session.run_cell("x = 1")  # over before it was due: nothing sent, and said so
    assert len(backend.signals) == 2
    assert "the cell ended before rank 1's SIGKILL was due" in capsys.readouterr().out
    session.run_cell("x = 1")  # a kill is for one cell only
    assert len(backend.signals) == 2
    with pytest.raises(OptionError):
        session.kill(2)


def test_hang_arms_the_rank_and_refuses_nonsense(session, backend):
    assert session.hang(1, 5) == "rank 1 holds at its next collective for 5 s"
    call = backend.submitted[-1]
    assert (call.fn.__name__, call.worker, call.args) == ("arm", backend.ids[1], (5,))
    with pytest.raises(OptionError):
        session.hang(1, 0)


def test_the_debugger_and_fault_verbs_need_a_job(backend):
    s = Session(backends=lambda engine: backend, stores=None)
    for verb in (s.debug, lambda: s.kill(0), lambda: s.kill(0, after=1.0),
                 lambda: s.hang(0, 5)):
        with pytest.raises(NoClusterError, match="nbdist start"):
            verb()
    assert s.faults.pending == []  # nothing is left due in a later cell
