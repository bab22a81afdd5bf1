"""The debugger on a rank: ``breakpoint()``, ``pdb.set_trace()``, ``pdb.post_mortem()`` and
``input()`` in a ``%%distributed`` cell, answered from the notebook.

A worker has no terminal. While a cell runs, :func:`debugging` puts a :class:`Channel` in its
place: a prompt goes up as an ``input`` event (:func:`~nbdist.telemetry.events.input_request`)
on the ordinary event channel, sent at once, and the rank waits for the answer at a key of the
job's rendezvous store, which the notebook hosts and writes to (:mod:`nbdist.debugger.console` is
the notebook's half). The rank looks for it 20 times a second, so an interrupt lands within a
fraction of a second and the store's own timeout never ends a long look around.

:class:`~.rank_pdb.RankPdb` is pdb with that channel for a terminal: its prompt names the
rank (``(Pdb rank 1)``), what it prints goes up with its next prompt, and ``q`` ends the cell
with :class:`DebuggerQuit`. While it waits, the hang doctor holds its clock
(:meth:`~.measure.stall_probe.Watch.hold`) and the notebook is told (``debugger`` events).

``PYTHONBREAKPOINT`` is honoured as Python honours it: the worker's own, else the notebook's.
Where no one can answer (a headless run), ``breakpoint()`` is passed with one line, as
``PYTHONBREAKPOINT=0`` would pass it, and ``input()`` raises ``EOFError``.

A worker keeps the traceback of its last failed cell until its next cell, for
``%nbdist debug`` (:func:`post_mortem`). Stdlib only, and torch's ``TCPStore`` for the answers.
"""

from __future__ import annotations

import bdb
import builtins
import cmd
import datetime
import importlib
import json
import os
import pdb
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Callable, NamedTuple, Optional

from ..telemetry import events as ev
from . import rank_pdb, results
from .measure.stall_probe import watch
from .rank_pdb import RankPdb, innermost

#: seconds between two looks for the notebook's answer: an interrupt lands between them
ANSWER_POLL = 0.05
# The debugger's own files: a DebuggerQuit's traceback ends before them.
_OWN = {os.path.splitext(os.path.abspath(m.__file__ or ""))[0]
        for m in (bdb, pdb, cmd, rank_pdb, sys.modules[__name__])}

Store = Callable[[], Any]  # the job's store, connected on first use


class DebuggerQuit(Exception):
    """``q`` in the debugger ended this rank's cell."""


@dataclass(frozen=True)
class Link:
    """How one call's ranks reach the notebook's stdin (the notebook makes one per call)."""

    #: the store keys of this call's answers start with it
    key: str
    #: the notebook can ask its user (its kernel has stdin, and it hosts the store)
    stdin: bool = False
    #: why it cannot, for the line a passed ``breakpoint()`` prints
    why: str = ""
    #: the notebook's ``PYTHONBREAKPOINT``, for workers that have none of their own
    breakpoint_env: Optional[str] = None


def _place(frame: Optional[FrameType]) -> dict[str, Any]:
    """Where a rank stands: the innermost frame of code a cell defined (its filename is not a
    file's: ``<distributed cell [5]>``), else ``frame`` itself."""
    f = frame
    while f is not None and not f.f_code.co_filename.startswith("<"):
        f = f.f_back
    f = f or frame
    if f is None:
        return {"file": "", "line": None, "func": ""}
    return {"file": f.f_code.co_filename, "line": f.f_lineno, "func": f.f_code.co_name}


class Channel:
    """One rank's line to the notebook during one call: prompts go up as events, answers come
    down through the store (``store``: the job's, connected on first use)."""

    def __init__(self, link: Link, sink: Any, filename: str, store: Store) -> None:
        self.link, self.sink, self.filename, self._store = link, sink, filename, store
        #: prompts reach someone (False once the notebook said it cannot ask after all)
        self.stdin = link.stdin
        self.n = 0  # prompts sent in this call
        self._text: list[str] = []  # what the debugger printed since its last prompt
        self._passed: set[tuple[str, Optional[int]]] = set()

    @property
    def rank(self) -> int:
        return self.sink.rank

    def write(self, text: str) -> None:
        """What the debugger prints: it goes up with its next prompt, or when it leaves."""
        self._text.append(text)

    def take_text(self) -> str:
        text, self._text = "".join(self._text), []
        return text

    @contextmanager
    def stopped(self, mode: str, frame: Optional[FrameType]) -> Iterator[None]:
        """The rank waits for the notebook at ``frame`` (``mode``: ``"pdb"`` or ``"input"``):
        the notebook is told, and the hang doctor's clock stands still meanwhile."""
        place = _place(frame)
        self.sink.emit(ev.debugger("enter", time.time(), mode=mode, **place))
        before = watch.hold(frame)
        try:
            yield
        finally:
            watch.release(before)
            self.sink.emit(ev.debugger("leave", time.time(), mode=mode,
                                       text=self.take_text(), **place))

    def ask(self, prompt: str, mode: str, frame: Optional[FrameType]) -> Optional[str]:
        """The line typed in the notebook for ``prompt``; None when no one can answer."""
        if not self.stdin:
            return None
        self.n += 1
        self.sink.emit(ev.input_request(self.n, prompt, text=self.take_text(), mode=mode,
                                        **_place(frame)))
        self.sink.flush()  # now: the user waits for it
        reply = self._wait(ev.answer_key(self.link.key, self.rank, self.n))
        line = reply.get("line")
        if line is None:
            self.stdin = False  # the notebook could not ask after all: nor will it later
        return line

    def _wait(self, key: str) -> dict[str, Any]:
        store = self._store()
        # Looks, not the store's blocking wait: its own timeout must not end a long look
        # around, an interrupt lands between two, and torch logs every wait that times out.
        while not store.check([key]):
            time.sleep(ANSWER_POLL)  # a person is typing: 20 looks a second are plenty
        raw = store.get(key)
        store.delete_key(key)
        return json.loads(raw)

    def passed(self, frame: Optional[FrameType], what: str) -> None:
        """``what`` (``breakpoint()``) was passed, as no one can answer: say so once per
        place in the call (a breakpoint in a loop says it once)."""
        place = _place(frame)
        if (place["file"], place["line"]) in self._passed:
            return
        self._passed.add((place["file"], place["line"]))
        self.sink.emit(ev.debugger("skip", time.time(), text=what, **place))


# ----------------------------------------------------------------- the cell's hooks
_active: Optional[Channel] = None  # the running call's channel
_saved: dict[str, Any] = {}  # what the hooks replaced while a call runs


def _stop_at(frame: Optional[FrameType], header: Optional[str] = None) -> None:
    ch = _active
    if ch is None:  # outside a cell (the hooks were kept by name): Python's own
        p = pdb.Pdb()
        if header is not None:
            p.message(header)
        p.set_trace(frame)
        return
    if not ch.stdin:
        ch.passed(frame, "breakpoint()")
        return
    p = RankPdb(ch)
    if header is not None:
        p.message(header)
    p.set_trace(frame)


def _set_trace(*, header: Optional[str] = None, **_ignored: Any) -> None:
    """``pdb.set_trace()`` on a rank."""
    _stop_at(sys._getframe().f_back, header)


def _breakpointhook(*args: Any, **kws: Any) -> Any:
    """``breakpoint()`` on a rank; ``PYTHONBREAKPOINT`` read at each call, as Python does."""
    name = os.environ.get("PYTHONBREAKPOINT")
    if name is None and _active is not None:
        name = _active.link.breakpoint_env
    if name == "0":
        return None
    if name and name != "pdb.set_trace":
        module, _, attr = name.rpartition(".")
        try:
            hook = getattr(importlib.import_module(module or "builtins"), attr)
        except (ImportError, AttributeError):
            warnings.warn(f'Ignoring unimportable $PYTHONBREAKPOINT: "{name}"', RuntimeWarning,
                          stacklevel=2)
            return None
        return hook(*args, **kws)
    return _stop_at(sys._getframe(1), kws.get("header"))


def _post_mortem(t: Any = None) -> None:
    """``pdb.post_mortem()`` on a rank."""
    ch = _active
    if ch is None:
        return _saved.get("post_mortem", pdb.post_mortem)(t)
    if isinstance(t, BaseException):
        t = t.__traceback__
    if t is None:
        t = sys.exc_info()[2]
    if t is None:
        raise ValueError("A valid traceback must be passed if no exception is being handled")
    if not ch.stdin:
        ch.passed(innermost(t), "pdb.post_mortem()")
        return None
    p = RankPdb(ch)
    p.reset()
    p.interaction(None, t)
    return None


def _input(prompt: object = "") -> str:
    """``input()`` on a rank: the notebook's input box, the prompt prefixed with the rank."""
    ch = _active
    if ch is None:
        return _saved.get("input", builtins.input)(prompt)
    frame = sys._getframe(1)
    with ch.stopped("input", frame):
        line = ch.ask(f"[rank {ch.rank}] {prompt}", "input", frame)
    if line is None:
        raise EOFError(f"input() on rank {ch.rank}: no one can answer here "
                       f"({ch.link.why or 'the notebook has no stdin'})")
    return line


@contextmanager
def _hooks(channel: Channel) -> Iterator[Channel]:
    global _active
    _saved.update(breakpointhook=sys.breakpointhook, set_trace=pdb.set_trace,
                  post_mortem=pdb.post_mortem, input=builtins.input)
    sys.breakpointhook, pdb.set_trace = _breakpointhook, _set_trace
    pdb.post_mortem, builtins.input = _post_mortem, _input
    _active = channel
    try:
        yield channel
    finally:
        _active = None
        sys.breakpointhook, pdb.set_trace = _saved["breakpointhook"], _saved["set_trace"]
        pdb.post_mortem, builtins.input = _saved["post_mortem"], _saved["input"]
        _saved.clear()
        if isinstance(getattr(sys.gettrace(), "__self__", None), RankPdb):
            sys.settrace(None)  # stepped past the cell's end: nothing more to trace


class Failure(NamedTuple):
    """A cell's failure on this worker, kept for ``%nbdist debug``."""

    exc: BaseException
    tb: TracebackType  # from the cell's first frame on
    filename: str
    t: float


_last: Optional[Failure] = None


@contextmanager
def debugging(link: Optional[Link], sink: Any, filename: str, store: Store) -> Iterator[Channel]:
    """Run a cell (``filename``) with its debugger's line to the notebook (``link``; None:
    no one can answer). A ``q`` in the debugger leaves as :class:`DebuggerQuit`; any other
    failure is kept for :func:`post_mortem` until the next cell."""
    global _last
    _last = None  # a worker keeps its last failure until its next cell
    channel = Channel(link or Link(""), sink, filename, store)
    try:
        with _hooks(channel):
            yield channel
    except bdb.BdbQuit as exc:
        quit_ = DebuggerQuit(f"rank {channel.rank} quit the debugger (q), which ended its cell")
        raise quit_.with_traceback(_before_pdb(exc.__traceback__)) from None
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != filename:
            tb = tb.tb_next
        if tb is not None:  # raised in the cell's code, not in nbdist's around it
            _last = Failure(exc, tb, filename, time.time())
        raise


def _before_pdb(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """``tb`` without its innermost frames in pdb, bdb or here (where ``q`` raised)."""
    keep, walk = None, tb
    while walk is not None:
        if os.path.splitext(os.path.abspath(walk.tb_frame.f_code.co_filename))[0] not in _OWN:
            keep = walk
        walk = walk.tb_next
    if keep is not None:
        keep.tb_next = None
    return tb


def failure() -> Optional[dict[str, Any]]:
    """This worker's last failed cell, described (None: its last cell did not fail)."""
    f = _last
    if f is None:
        return None
    info = results.error_info(f.exc, f.filename)
    return {"ename": info["ename"], "evalue": info["evalue"], "line": info["line"],
            "file": f.filename, "communication": info["communication"],
            "caused_by_peer": info["caused_by_peer"], "t": f.t}


def post_mortem(link: Link, sink: Any, store: Store) -> bool:
    """``%nbdist debug``: pdb on the frame where this worker's last cell failed, through the
    notebook; False when there is none."""
    f = _last
    if f is None:
        return False
    with _hooks(Channel(link, sink, f.filename, store)) as channel:
        p = RankPdb(channel)
        p.reset()
        p.interaction(None, f.tb)
    return True


def post_mortem_call(link: Link, sink: Any, store: Store) -> results.CellResult:
    """:func:`post_mortem` as a call of its own on this worker, with the output it printed;
    its value says whether there was a failure to inspect."""
    t0 = time.perf_counter()
    seq0 = sink.flush()
    try:
        found = post_mortem(link, sink, store)
        out = results.cell_ok({"text/plain": repr(found)})
    except BaseException as exc:  # an interrupt, or a failure of the debugger's line
        out = results.cell_failed(results.error_info(exc, "<nbdist debug>"))
    seq, tail = sink.end_call(seq0)
    return results.finish(out, seconds=time.perf_counter() - t0, group_alive=True,
                          seq=seq, tail=tail)


_clients: dict[tuple[str, int], Any] = {}


def store_client(addr: str, port: int, timeout: float = 300.0) -> Any:
    """This worker's own client of the job's store, for the debugger's answers (apart from
    the process group's, which a collective may be using)."""
    client = _clients.get((addr, port))
    if client is None:
        import torch.distributed as dist

        client = _clients[(addr, port)] = dist.TCPStore(
            addr, port, None, False, datetime.timedelta(seconds=timeout))
    return client
