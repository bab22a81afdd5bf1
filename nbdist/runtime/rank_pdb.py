"""pdb on a rank, with the notebook for its terminal (see :mod:`.debugger`, which makes one per
stop and gives it its channel).

What changes from pdb: its prompt names the rank (``(Pdb rank 1)``); it reads and writes
through the channel; it never stops in the frames below the cell (nbdist's, the engine's), so
``w`` starts at the cell and stepping past the cell's end lets it finish; the cell's body
returning does not stop it, its last expression (a frame of its own) does; an interrupt leaves
it as a ``KeyboardInterrupt`` in the cell instead of prompting again; ``interact``, ``run`` and
``restart``, which cannot work on a rank, say why. Stdlib only.
"""

from __future__ import annotations

import bdb
import pdb
import sys
from types import FrameType, TracebackType
from typing import Any, Optional, Protocol

#: modules whose frames are never where a user stands (pdb's ``skip``)
SKIP = ("nbdist.*",)


class Line(Protocol):
    """What pdb needs of its line to the notebook (:class:`.debugger.Line`)."""

    rank: int
    filename: str

    def write(self, text: str) -> None: ...

    def take_text(self) -> str: ...

    def ask(self, prompt: str, mode: str, frame: Optional[FrameType]) -> Optional[str]: ...

    def stopped(self, mode: str, frame: Optional[FrameType]) -> Any: ...


class _Out:
    """pdb's stdout: into the channel, up with the next prompt."""

    encoding = "utf-8"

    def __init__(self, channel: Line) -> None:
        self.channel = channel

    def write(self, text: str) -> int:
        self.channel.write(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _In:
    """pdb's stdin, for what reads it directly (the pdb of the ``debug`` command): a line from
    the notebook, the prompt being what was written last."""

    def __init__(self, channel: Line) -> None:
        self.channel = channel

    def readline(self) -> str:
        before, newline, prompt = self.channel.take_text().rpartition("\n")
        self.channel.write(before + newline)
        line = self.channel.ask(prompt, "pdb", None)
        return "" if line is None else line + "\n"


class _Interrupted(BaseException):
    """An interrupt on its way out of pdb, which would catch a KeyboardInterrupt."""


class RankPdb(pdb.Pdb):
    """pdb whose terminal is the notebook, through ``channel``; see the module docstring."""

    def __init__(self, channel: Line) -> None:
        # nosigint: an interrupt must stop the cell, not stop in pdb again
        super().__init__(stdin=_In(channel), stdout=_Out(channel), skip=list(SKIP),
                         nosigint=True)
        self.channel = channel
        self.prompt = f"(Pdb rank {channel.rank}) "
        self.use_rawinput = False
        self._outer: dict[int, FrameType] = {}  # frames below the cell: never stopped in

    def set_trace(self, frame: Optional[FrameType] = None) -> None:
        """Stop at ``frame``'s next line; the stack pdb shows and walks begins at the cell."""
        frame = frame if frame is not None else sys._getframe().f_back
        bottom = None
        f = frame
        while f is not None:  # the outermost frame of the running cell
            if f.f_code.co_filename == self.channel.filename:
                bottom = f
            f = f.f_back
        super().set_trace(frame)
        if bottom is not None:
            self.botframe = bottom
            f = bottom.f_back
            while f is not None:
                self._outer[id(f)] = f
                f = f.f_back

    def stop_here(self, frame: FrameType) -> bool:
        return self._in_cell(frame) and super().stop_here(frame)

    def _in_cell(self, frame: FrameType) -> bool:
        """``frame`` runs the cell's code: it is the cell's, or called from it (never one of
        the frames below the cell, nbdist's and the engine's, or one they call)."""
        if not self._outer:
            return True
        f: Optional[FrameType] = frame
        while f is not None and f is not self.botframe:
            if self._outer.get(id(f)) is f:
                if f is frame.f_back and frame.f_code.co_filename == self.channel.filename:
                    self.botframe = frame  # the cell's last expression, in a frame of its own
                    return True
                return False
            f = f.f_back
        return True

    def user_call(self, frame: FrameType, argument_list: Any) -> None:
        if frame is not self.botframe:  # the last expression starts: stop at its line instead
            super().user_call(frame, argument_list)

    def user_return(self, frame: FrameType, return_value: Any) -> None:
        if frame is self.botframe:  # the cell's body ends: its last expression (if any) next
            self.set_step()
            return
        super().user_return(frame, return_value)

    def user_exception(self, frame: FrameType, exc_info: Any) -> None:
        if issubclass(exc_info[0], KeyboardInterrupt):
            self.set_continue()  # an interrupt stops the cell, as it would without pdb
            return
        try:
            super().user_exception(frame, exc_info)
        finally:
            if frame.f_locals is frame.f_globals:  # the cell's namespace keeps no pdb names
                frame.f_globals.pop("__exception__", None)

    def interaction(self, frame: Optional[FrameType], tb: Any) -> None:
        at = frame if frame is not None else innermost(tb)
        with self.channel.stopped("pdb", at):
            try:
                super().interaction(frame, tb)
            except _Interrupted:
                sys.settrace(None)
                raise KeyboardInterrupt from None

    def do_debug(self, arg: str) -> Any:
        try:
            return super().do_debug(arg)
        finally:  # its pdb's names, left in the namespace it ran in (the cell's outlives it)
            for name in ("__return__", "__exception__"):
                self.curframe_locals.pop(name, None)

    do_debug.__doc__ = pdb.Pdb.do_debug.__doc__

    def do_interact(self, arg: str) -> None:
        """interact
        Not on a rank: its console reads until end of file, which the notebook's input box
        cannot send. Run statements one at a time with ! instead."""
        self.error("interact does not work on a rank (its console reads until end of file, "
                   "which the input box cannot send): run statements one at a time with !")

    def do_run(self, arg: str) -> None:
        """run / restart
        Not on a rank: there is no script to restart. Run the cell again instead."""
        self.error("there is no script to restart on a rank: run the cell again")

    do_restart = do_run

    def cmdloop(self, intro: Any = None) -> None:
        """``cmd.Cmd.cmdloop`` with the notebook for its terminal."""
        try:
            self.preloop()
            stop = None
            while not stop:
                if self.cmdqueue:
                    line = self.cmdqueue.pop(0)
                else:
                    answer = self.channel.ask(self.prompt, "pdb", self.curframe)
                    if answer is None:  # no one to answer after all: carry on
                        self.message("nbdist: the notebook cannot answer; continuing")
                        bdb.Bdb.clear_all_breaks(self)
                        answer = "continue"
                    line = answer
                line = self.precmd(line)
                stop = self.onecmd(line)
                stop = self.postcmd(stop, line)
            self.postloop()
        except KeyboardInterrupt:
            raise _Interrupted from None


def innermost(tb: Optional[TracebackType]) -> Optional[FrameType]:
    frame = None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return frame
