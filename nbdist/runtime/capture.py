"""Worker-side event batching and stdout/stderr capture.

Output and telemetry leave a worker in batches through a transport the engine backend installs
(ipyparallel data publication, Dask pub-sub). A background thread flushes up to four times a
second, so training never waits on the notebook, and a cell's end flushes synchronously so the
notebook can wait for exactly the batches that belong to it.

The notebook receives every rank's batches, so a rank flushes less often the larger the job
(:func:`~nbdist.telemetry.events.flush_interval`), and packs its steps, buckets and memory
samples into tables (:func:`~nbdist.telemetry.columns.pack`); a cell's rank seals what only
the notebook's fold reads into one pickle (:func:`~nbdist.telemetry.columns.seal`). What
cannot wait goes out at the next tick: elastic training's news, the hang doctor's report, the
debugger's, and the output of the rank whose output the notebook shows
(:attr:`EventSink.prompt_output`).
"""

from __future__ import annotations

import io
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional, TextIO, Union

from ..telemetry.columns import pack, seal
from ..telemetry.events import (
    DEBUGGER,
    DISPLAY,
    ELASTIC,
    INPUT,
    MIN_INTERVAL,
    SEALABLE,
    SEALED,
    STACK,
    STREAM,
    Batch,
    Event,
    stream,
    warning,
)
from . import fd_output

#: sends one batch, or a relay's list of its host's batches as one message
Transport = Callable[[Union[Batch, list[Batch]]], None]

#: seconds between the sending thread's ticks: urgent events wait at most this long
TICK = 0.1
#: seconds a relay's own batch may wait for its peers' (sent at the same moment as its own,
#: they reach it within a tick or two), so that the host's batches go in one message
RELAY_GRACE = 2 * TICK
#: kinds sent at the next tick, whatever the interval
URGENT = frozenset({ELASTIC, STACK, DEBUGGER, INPUT})
#: kinds of the output the notebook shows, urgent from the shown rank
SHOWN = frozenset({STREAM, DISPLAY})


class EventSink:
    """Collects events from any thread and sends them in batches, every ``interval``
    seconds (see :func:`~nbdist.telemetry.events.flush_interval`); ``sealed``: what only the
    notebook's fold reads travels as one pickle (a cell's rank: its notebook unpickles what
    it sends anyway)."""

    def __init__(self, rank: int, transport: Optional[Transport],
                 interval: float = MIN_INTERVAL, sealed: bool = False,
                 figures_interval: Optional[float] = None):
        self.rank = rank
        self.transport = transport
        self.interval = interval
        #: seconds between batches of nothing but figures, at least ``interval``
        #: (:func:`~nbdist.telemetry.events.figures_interval`)
        self.figures_interval = figures_interval or interval
        self._words = False  # a pending event is not a figure: it goes at ``interval``
        self.sealed = sealed
        self.seq = 0  # batches sent so far
        self._pending: list[Any] = []  # events, and (build, args) from defer()
        self._urgent = False  # an event that cannot wait for the interval is pending
        #: this rank's output is the one the notebook shows: send it at the next tick
        self.prompt_output = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        #: called by the sending thread before each flush (the hang doctor's look at the cell)
        self.on_tick: Optional[Callable[[], None]] = None
        #: during a cell run by other ranks of this host too: the lowest of them relays their
        #: batches with its own (``relay``, a :class:`~.node_relay.Relay`), the others hand their
        #: batches to it (``peer``, a :class:`~.node_relay.Peer`); see :mod:`.node_relay`
        self.relay: Any = None
        self.peer: Any = None
        self._last = time.monotonic()  # when the last batch went (or a cell began)
        self._handed = 0  # the seq of the last batch handed to the relay in this cell
        #: batches of peers this rank relayed, its own it handed a relay, and those it sent
        #: itself when a relay could not take them, in cells that ended
        self.relayed = self.handed = self.declined = 0
        self._thread = threading.Thread(target=self._loop, name="nbdist-events", daemon=True)
        self._thread.start()

    def emit(self, event: Event) -> None:
        with self._lock:
            self._pending.append(event)
            if event["kind"] not in SEALABLE:
                self._words = True
            if event["kind"] in URGENT or (self.prompt_output and event["kind"] in SHOWN):
                self._urgent = True

    def defer(self, build: Callable[..., list[Event]], *args: Any) -> None:
        """Queue events that ``build(*args)`` makes when the batch is sent, on the sending
        thread, in their place among the others: a training step's event is built there
        with its neighbours' (the training thread only records the step)."""
        with self._lock:
            self._pending.append((build, args))

    def _take_pending(self) -> list[Event]:
        with self._lock:
            pending, self._pending, self._urgent = self._pending, [], False
            self._words = False
        events: list[Event] = []
        for e in pending:
            if type(e) is tuple:
                try:
                    events.extend(e[0](*e[1]))
                except Exception as exc:  # a telemetry bug must not lose the batch's other events
                    sys.__stderr__.write(f"nbdist: telemetry error: {exc!r}\n")
            else:
                events.append(e)
        return events

    def flush(self) -> int:
        """Send what is pending now (a relay: with its peers' batches it holds); return the
        sequence number of the last batch sent. The next interval counts from now: the ranks
        of a cell, which flush as it begins, send at the same moments."""
        with self._send_lock:
            urgent = self._urgent
            events = self._take_pending()
            self._last = time.monotonic()
            out = []
            if events and self.transport is not None:
                self.seq += 1
                out.append(self._batch(events))
            relay = self.relay
            if relay is not None and self.transport is not None:
                relay.collect()
                out += relay.take()
            if not out:
                return self.seq
            assert self.transport is not None
            peer = self.peer
            if len(out) > 1:
                self.transport(out)  # a host's batches, one message
            elif peer is not None and _relayable(out[0]) and peer.send(out[0], urgent):
                self._handed = out[0]["seq"]
            else:
                if self._handed:  # it may arrive before the one the relay holds: the
                    out[0]["after"] = self._handed  # notebook folds them in order
                self.transport(out[0])
            return self.seq

    def stagger(self, share: float) -> None:
        """Send the next batch ``share`` (0-1) of an interval sooner than the interval after
        the last one: hosts given evenly spread shares send at evenly spread moments (the
        notebook hears from some rank all the time, rather than from all of them at once
        each interval), while a host's ranks, given the same share, send together for their
        relay."""
        with self._send_lock:
            self._last -= (share % 1.0) * max(self.interval, self.figures_interval)

    def end_relay(self) -> None:
        """A cell's relaying ends (its call returns): a peer sends its own batches from now
        on; a relay stops taking any and sends those it held."""
        with self._send_lock:
            peer, relay, self.peer, self.relay = self.peer, self.relay, None, None
            self._handed = 0
            if peer is not None:
                peer.close()
                self.handed += peer.handed
                self.declined += peer.declined
            if relay is not None:
                held = relay.close()
                self.relayed += relay.relayed
                if held and self.transport is not None:
                    self.transport(held)

    def _batch(self, events: list[Event]) -> Batch:
        packed = pack(_coalesce(events))
        return {"rank": self.rank, "seq": self.seq,
                "events": seal(packed) if self.sealed else packed}

    def take(self) -> Optional[Batch]:
        """What is pending, as the next batch, for the caller to carry instead of sending it
        (a cell's last batch travels in its result: one message fewer, nothing to wait for).
        Every earlier batch has been handed to the transport (or to the host's relay,
        :mod:`.node_relay`) when this returns."""
        with self._send_lock:
            events = self._take_pending()
            if not events:
                return None
            self.seq += 1
            return self._batch(events)

    def end_call(self, seq0: int) -> tuple[int, Optional[Batch]]:
        """A call that began when ``seq0`` batches had been sent ends: its last batch, for
        its result to carry, and the seq of the last batch it sent before that (0: none, so
        the notebook waits for nothing)."""
        tail = self.take()
        seq = tail["seq"] - 1 if tail is not None else self.seq
        return (seq if seq > seq0 else 0), tail

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=2)
        self.flush()

    def _loop(self) -> None:
        while not self._closed:
            # Ticks stay short whatever the interval: the hang doctor looks at the cell on
            # each, and urgent events go out on the next one.
            self._wake.wait(min(TICK, self.interval))
            tick = self.on_tick
            if tick is not None:
                try:
                    tick()
                except Exception as exc:  # a diagnosis bug must not stop the events; once
                    sys.__stderr__.write(f"nbdist: hang doctor error: {exc!r}\n")
                    self.on_tick = None
            waited = time.monotonic() - self._last
            # figures alone wait longer in a large job (output, warnings and news do not)
            every = self.interval if self._words else max(self.interval, self.figures_interval)
            relay = self.relay
            if relay is None:
                due = waited >= every - 1e-3
            else:  # its peers' batches, due together (or its own, a little late without them)
                with self._send_lock:
                    relay.collect()
                    due = relay.due() or waited >= every + RELAY_GRACE
            if not (self._urgent or self._closed or due):
                continue
            try:
                self.flush()
            except Exception as exc:  # a broken channel must not kill training; say so once
                sys.__stderr__.write(f"nbdist: could not send events: {exc!r}\n")
                self._closed = True


def _relayable(batch: Batch) -> bool:
    """Whether a peer hands ``batch`` to its host's relay: only what the run's fold reads
    (sealed), never output, a prompt or the hang doctor's report, which go straight to the
    notebook: a relay that dies takes along at most an interval of its peers' figures, and
    nothing a rank wrote."""
    return all(e["kind"] == SEALED for e in batch["events"])


def _coalesce(events: list[Event]) -> list[Event]:
    """Merge consecutive stream chunks of one stream, so a print loop is one event."""
    out: list[Event] = []
    for ev in events:
        prev = out[-1] if out else None
        if (ev["kind"] == STREAM and prev is not None and prev["kind"] == STREAM
                and prev["name"] == ev["name"]):
            out[-1] = stream(ev["name"], prev["text"] + ev["text"])
        else:
            out.append(ev)
    return out


#: characters of stdout + stderr one rank sends per cell; past it, output is counted, not sent
MAX_OUTPUT_CHARS = 1_000_000


class OutputBudget:
    """What a rank may still send of its output in this cell, and what it held back."""

    def __init__(self, limit: int = MAX_OUTPUT_CHARS):
        self.left = limit
        self.limit = limit
        self.dropped_chars = 0
        self.dropped_lines = 0

    def take(self, text: str) -> str:
        """The part of ``text`` that may still be sent (counting the rest)."""
        if len(text) <= self.left:
            self.left -= len(text)
            return text
        sent, rest = text[:max(self.left, 0)], text[max(self.left, 0):]
        self.left = 0
        self.dropped_chars += len(rest)
        self.dropped_lines += rest.count("\n")
        return sent

    def notice(self) -> str:
        return (f"\n[nbdist: output cut after {self.limit:,} characters; "
                f"{self.dropped_lines:,} more lines ({self.dropped_chars:,} characters) were not "
                "sent to the notebook. Write long logs to a file.]\n")


class StreamTee(io.TextIOBase):
    """A text stream that turns writes into ``stream`` events, within an output budget."""

    def __init__(self, sink: EventSink, name: str, budget: Optional[OutputBudget] = None):
        self._sink = sink
        self.name = name
        self._budget = budget

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        fds = fd_output.current()
        if fds is not None:  # what the descriptors got before this print goes out first
            fds.drain()
        sent = self._budget.take(text) if self._budget is not None and text else text
        if sent:
            self._sink.emit(stream(self.name, sent))
        return len(text)

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def _warning_tee(sink: EventSink) -> Callable[..., None]:
    """A ``warnings.showwarning`` that sends each shown warning as one event.

    The notebook shows a warning once with the ranks that raised it, instead of once per rank
    in their stderr. Python's filters still decide what is shown (by default each warning once
    per code location).
    """
    original = warnings.showwarning

    def showwarning(message: Any, category: type, filename: str, lineno: int,
                    file: Optional[TextIO] = None, line: Optional[str] = None) -> None:
        if file is not None:  # someone asked for this very stream: honour it
            original(message, category, filename, lineno, file, line)
            return
        sink.emit(warning(getattr(category, "__name__", str(category)), str(message),
                          str(filename), int(lineno or 0)))

    return showwarning


def fresh_warnings() -> None:
    """Let each warning show once more in this cell, as a plain kernel does on a re-run: the
    filters' "once per location" registries are kept across cells on a warm worker, and
    Python empties them all when it is told its filters changed (they did not: the same
    filters are kept)."""
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is not None:
        mutated()
    elif warnings.filters:  # no such hook: re-adding a filter that is there tells it too
        action, message, category, module, lineno = warnings.filters[-1]
        warnings.filterwarnings(action, message.pattern if message else "", category,
                                module.pattern if module else "", lineno, append=True)


@contextmanager
def captured_output(sink: EventSink, limit: int = MAX_OUTPUT_CHARS,
                    filename: Optional[str] = None) -> Iterator[OutputBudget]:
    """Route ``sys.stdout``/``sys.stderr``, shown warnings and, where this process captures
    them (:mod:`.fd_output`), file descriptors 1 and 2 to ``sink`` during a cell; where
    ``filename`` (the cell's code) is given, the capture's line record follows this thread in
    it.

    At most ``limit`` characters are sent; past them, output is counted and one notice says
    how much was held back (a print loop of millions of lines must not flood the notebook).
    """
    budget = OutputBudget(limit)
    fresh_warnings()
    fds = fd_output.current()

    def emit(name: str, text: str) -> None:
        sent = budget.take(text)
        if sent:
            sink.emit(stream(name, sent))

    if fds is not None:
        fds.begin(emit, filename)
    old = sys.stdout, sys.stderr, warnings.showwarning
    sys.stdout = StreamTee(sink, "stdout", budget)
    sys.stderr = StreamTee(sink, "stderr", budget)
    warnings.showwarning = _warning_tee(sink)
    try:
        yield budget
    finally:
        sys.stdout, sys.stderr, warnings.showwarning = old
        if fds is not None:  # what the cell wrote to 1 and 2, read now: no wait at its end
            fds.end()
        if budget.dropped_chars:
            sink.emit(stream("stderr", budget.notice()))
