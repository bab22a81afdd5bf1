"""The debugger on a rank, in this process: a cell runs as a worker runs it, with a store that
answers its prompts as the notebook would, line by line from a script.

What pdb shows and does (the prompt naming the rank, the stack starting at the cell, stepping
into the cell's last expression and never into nbdist's frames, assignments that persist, ``q``
as DebuggerQuit, interrupts), ``input()``, ``PYTHONBREAKPOINT``, a headless run, the failure a
worker keeps for ``%nbdist debug``, faults on purpose, and a Dask call's interrupt bookkeeping
that must leave tracing usable.
"""

from __future__ import annotations

import json
import pdb
import sys
import threading
import time
import types
from typing import Optional

import pytest

from nbdist.runtime import debugger, faults, interrupt, results
from nbdist.runtime.execute import run_code
from nbdist.runtime.measure.stall_probe import watch
from nbdist.telemetry import events as ev

CELL = "<distributed cell [5]>"


class Sink:
    """A worker's event sink, in memory."""

    rank = 1

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.flushes = 0

    def emit(self, event: dict) -> None:
        self.events.append(event)

    def flush(self) -> int:
        self.flushes += 1
        return self.flushes

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


class Notebook:
    """The store the answers arrive in, answering each prompt with the next scripted line (None:
    the notebook cannot ask) and keeping the transcript the user would see."""

    def __init__(self, sink: Sink, answers: list[Optional[str]]) -> None:
        self.sink, self.answers = sink, list(answers)
        self.values: dict[str, bytes] = {}
        self.transcript: list[str] = []
        self.held: list[object] = []  # what the hang doctor held at each prompt

    def check(self, keys: list[str]) -> bool:
        if keys[0] not in self.values:
            request = self.sink.kinds(ev.INPUT)[-1]
            assert keys[0] == ev.answer_key("k", request_rank(self.sink), request["n"])
            line = self.answers.pop(0) if self.answers else "c"
            self.held.append(watch.held)
            self.transcript.append(f"{request['text']}{request['prompt']}{line}\n")
            self.values[keys[0]] = json.dumps({"line": line}).encode()
        return True

    def get(self, key: str) -> bytes:
        return self.values[key]

    def delete_key(self, key: str) -> None:
        del self.values[key]

    @property
    def text(self) -> str:
        return "".join(self.transcript)


def request_rank(sink: Sink) -> int:
    return sink.rank


def run(source: str, answers: list[Optional[str]] = (), ns: Optional[dict] = None, *,
        stdin: bool = True, breakpoint_env: Optional[str] = None, filename: str = CELL):
    """Run ``source`` as a cell of rank 1; returns (notebook, sink, namespace, error)."""
    sink = Sink()
    nb = Notebook(sink, list(answers))
    ns = ns if ns is not None else {"__name__": "__main__", "rank": 1}
    link = debugger.Link("k", stdin, "" if stdin else "a headless run", breakpoint_env)
    err = None
    try:
        with debugger.debugging(link, sink, filename, lambda: nb):
            run_code(source, filename, ns)
    except BaseException as exc:  # the cell's error, as run_cell takes it
        err = exc
    assert sys.gettrace() is None  # nothing keeps tracing after the cell
    return nb, sink, ns, err


@pytest.fixture(autouse=True)
def _no_breakpoint_env(monkeypatch):
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)


def test_breakpoint_opens_pdb_named_for_the_rank_and_an_assignment_persists():
    nb, sink, ns, err = run("x = 1\nbreakpoint()\ny = x * 2\n", ["p x", "x = 21", "c"])
    assert err is None and ns["y"] == 42
    assert nb.text.startswith("> <distributed cell [5]>(3)<module>()\n-> y = x * 2\n"
                              "(Pdb rank 1) p x\n1\n(Pdb rank 1) x = 21\n(Pdb rank 1) c\n")
    # each prompt went out at once, and said where the rank stands
    requests = sink.kinds(ev.INPUT)
    assert [r["n"] for r in requests] == [1, 2, 3] and sink.flushes >= 3
    assert {(r["mode"], r["file"], r["line"]) for r in requests} == {("pdb", CELL, 3)}
    states = [(e["state"], e["line"]) for e in sink.kinds(ev.DEBUGGER)]
    assert states == [("enter", 3), ("leave", 3)]
    assert all(h is not None for h in nb.held) and watch.held is None  # held, then let go


def test_the_stack_begins_at_the_cell_and_steps_stay_in_its_code():
    source = "def f(a):\n    b = a * 2\n    breakpoint()\n    return b\nz = f(3)\nz + 1\n"
    nb, _, ns, err = run(source, ["w", "u", "u", "d", "n", "n", "n", "n"])
    assert err is None and ns["z"] == 6
    text = nb.text
    # `w` lists the cell's frame and the function's, nothing of nbdist or the engine
    where = text.split("(Pdb rank 1) w\n")[1].split("(Pdb rank 1)")[0]
    assert where == ("  <distributed cell [5]>(5)<module>()\n-> z = f(3)\n"
                     "> <distributed cell [5]>(4)f()\n-> return b\n")
    assert "*** Oldest frame" in text  # `u` stops at the cell
    # `n` returns from f, goes on into the cell's last expression (a frame of its own), ends
    assert "--Return--\n> <distributed cell [5]>(4)f()->6" in text
    assert "> <distributed cell [5]>(6)<module>()\n-> z + 1" in text
    assert "execute.py" not in text and "contextlib" not in text and "__return__" not in ns


def test_a_function_from_an_earlier_cell_is_listed_from_its_own_source():
    ns = {"__name__": "__main__", "rank": 1}
    run("def train(steps):\n    total = steps * 10\n    breakpoint()\n    return total\n",
        ns=ns, filename="<distributed cell [3]>")
    nb, sink, _, err = run("result = train(4)\n", ["p total", "ll", "c"], ns=ns)
    assert err is None and ns["result"] == 40
    assert "40\n" in nb.text and "  3  \t    breakpoint()\n" in nb.text
    assert sink.kinds(ev.INPUT)[0]["file"] == "<distributed cell [3]>"


def test_q_ends_the_cell_with_debugger_quit_at_the_cells_line():
    nb, _, ns, err = run("x = 1\nbreakpoint()\ny = 2\n", ["q"])
    assert isinstance(err, debugger.DebuggerQuit) and "y" not in ns
    assert str(err) == "rank 1 quit the debugger (q), which ended its cell"
    info = results.error_info(err, CELL)
    assert info["ename"] == "DebuggerQuit" and info["line"] == 3
    assert not info["communication"]
    assert "bdb.py" not in info["traceback"] and "pdb.py" not in info["traceback"]
    assert debugger.failure() is None  # quitting is not a failure to inspect


def test_an_interrupt_at_the_prompt_leaves_pdb_as_a_keyboard_interrupt(monkeypatch):
    def interrupted(self, keys):
        raise KeyboardInterrupt  # the stop button, while the rank waits for an answer

    monkeypatch.setattr(Notebook, "check", interrupted)
    _, sink, ns, err = run("x = 1\nbreakpoint()\ny = 2\n")
    assert isinstance(err, KeyboardInterrupt) and "y" not in ns  # pdb did not catch it
    assert [e["state"] for e in sink.kinds(ev.DEBUGGER)] == ["enter", "leave"]


def test_pdb_set_trace_and_post_mortem_in_a_cell_reach_the_notebook():
    before = pdb.set_trace, pdb.post_mortem, sys.breakpointhook, input
    nb, _, ns, err = run("import pdb\nv = 7\npdb.set_trace()\nw = v\n", ["p v + 1", "c"])
    assert err is None and "8\n" in nb.text and ns["w"] == 7
    source = ("import pdb\ntry:\n    def g():\n        local = 'here'\n        1 / 0\n    g()\n"
              "except ZeroDivisionError:\n    pdb.post_mortem()\n")
    nb, _, _, err = run(source, ["p local", "q"])
    assert err is None and "'here'\n" in nb.text
    assert (pdb.set_trace, pdb.post_mortem, sys.breakpointhook, input) == before  # restored


def test_input_asks_the_notebook_with_the_rank_before_the_prompt():
    nb, sink, ns, err = run("name = input('name? ')\n", ["bob"])
    assert err is None and ns["name"] == "bob"
    assert nb.text == "[rank 1] name? bob\n"
    assert [(e["state"], e["mode"]) for e in sink.kinds(ev.DEBUGGER)] == [
        ("enter", "input"), ("leave", "input")]


def test_pythonbreakpoint_is_honoured_as_python_honours_it(monkeypatch):
    _, sink, _, err = run("breakpoint()\n", breakpoint_env="0")  # the notebook's value
    assert err is None and not sink.events
    seen = []
    hook = types.ModuleType("nbdist_test_hook")
    hook.stop = lambda *a, **k: seen.append((a, k))
    monkeypatch.setitem(sys.modules, "nbdist_test_hook", hook)
    monkeypatch.setenv("PYTHONBREAKPOINT", "nbdist_test_hook.stop")  # the worker's wins
    _, sink, _, err = run("breakpoint(1, x=2)\n", breakpoint_env="0")
    assert err is None and seen == [((1,), {"x": 2})] and not sink.events


def test_without_stdin_a_breakpoint_is_passed_with_one_line_and_input_fails():
    _, sink, ns, err = run("for i in range(3):\n    breakpoint()\ndone = i\n", stdin=False)
    assert err is None and ns["done"] == 2
    [skip] = sink.kinds(ev.DEBUGGER)  # once for the place, not once per pass
    assert (skip["state"], skip["line"], skip["text"]) == ("skip", 2, "breakpoint()")
    assert not sink.kinds(ev.INPUT)
    _, _, _, err = run("input('name? ')\n", stdin=False)
    assert isinstance(err, EOFError) and "a headless run" in str(err)


def test_when_the_notebook_cannot_answer_after_all_pdb_carries_on():
    nb, sink, ns, err = run("breakpoint()\nx = 1\nbreakpoint()\ny = 2\n", [None])
    assert err is None and ns["y"] == 2
    assert len(sink.kinds(ev.INPUT)) == 1  # the second breakpoint asks no one
    assert "cannot answer" in sink.kinds(ev.DEBUGGER)[1]["text"]


def test_a_worker_keeps_its_last_failure_until_its_next_cell_for_post_mortem():
    source = "def f(a):\n    scale = a * 3\n    raise ValueError(scale)\nf(2)\n"
    _, _, _, err = run(source)
    assert isinstance(err, ValueError)
    kept = debugger.failure()
    assert kept is not None and (kept["ename"], kept["evalue"], kept["line"]) == \
        ("ValueError", "6", 3)
    sink = Sink()
    nb = Notebook(sink, ["p scale", "u", "u", "q"])
    assert debugger.post_mortem(debugger.Link("k", True), sink, lambda: nb)
    assert nb.text.startswith("> <distributed cell [5]>(3)f()\n-> raise ValueError(scale)\n"
                              "(Pdb rank 1) p scale\n6\n")
    assert "*** Oldest frame" in nb.text  # the stack starts at the cell, not at nbdist's
    run("x = 1\n")
    assert debugger.failure() is None
    assert not debugger.post_mortem(debugger.Link("k", True), Sink(), lambda: nb)


def test_a_forgotten_call_leaves_tracing_usable_in_its_thread():
    # After a Dask call, a traced call in the same thread (pdb's next frame) must not spin.
    code = compile("1 + 1", "<x>", "eval")
    out: list = []

    def call() -> None:
        interrupt.forget_call(interrupt.register_call("tag"))
        sys.settrace(lambda frame, event, arg: None)
        try:
            out.append(eval(code))
        finally:
            sys.settrace(None)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and out == [2]


def test_a_hang_on_purpose_holds_once_for_its_time():
    faults.arm(0.2)
    t0 = time.monotonic()
    faults.hang()
    assert 0.2 <= time.monotonic() - t0 < 2 and faults.armed is None
    t0 = time.monotonic()
    faults.hang()  # disarmed: no hold
    assert time.monotonic() - t0 < 0.1


def test_the_recursive_debugger_works_and_what_cannot_work_here_says_so():
    nb, _, ns, err = run("x = 1\nbreakpoint()\ny = 2\n",
                         ["debug x + 1", "s", "c", "interact", "restart", "c"])
    assert err is None and ns["y"] == 2
    assert "ENTERING RECURSIVE DEBUGGER" in nb.text and "((Pdb rank 1)) s\n--Return--" in nb.text
    assert "*** interact does not work on a rank" in nb.text
    assert "*** there is no script to restart on a rank" in nb.text
    assert "__return__" not in ns  # the recursive pdb's name does not stay in the namespace
