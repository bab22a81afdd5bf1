"""Tables of events: the form in which a worker sends its high-rate events.

A training rank sends tens of events a second (a step, a collective per gradient bucket, a
memory sample); a thousand ranks would send the notebook fifty thousand dicts a second. In a
batch, the :data:`~.events.TABLED` events are therefore one ``table`` event (:func:`pack`),
built on the worker:

* events of one kind with the same keys form a *part*, one column per field; a column of
  floats or of integers (or of pairs of floats) travels as the bytes of an ``array`` (no
  object per value to unpickle), one string repeated (a collective's name) once with its
  count, any other as a list;
* ``order`` has one character per event, the index of its part, so :func:`rows` gives the
  events back exactly, in their order (what a trace file and the tests read);
* a part of collectives that belong to a step (gradient buckets, collectives called in the
  step) also carries what the notebook's fold needs of them, folded on the worker, in
  columns too (:func:`summary`): per step, their bytes, the bytes of the timed ones, whether
  one had no time, the time any of them was running (:func:`~.intervals.union_seconds`) and
  that union as disjoint intervals (:func:`~.intervals.merge`, to join a step whose
  collectives came in two batches), with the part's total bytes and time span. The fold
  reads that summary, never the part's rows;
* a part of steps or of memory samples carries its time span, and one of memory samples the
  sample the fold keeps (``held``: the last that holds any parameters, gradients or optimizer
  state, as a dict; None where none does), so the fold decodes none of their rows.

From a cell's rank, :func:`seal` then pickles the table with the batch's other events that only
the run's fold reads (logged values, bars) into one bytes object. A thousand ranks' batches
wait in the notebook's client for up to a tenth of a second before the cell loop folds them:
as dicts and lists, long enough for the garbage collector to move them to its oldest
generation, whose full collections then scanned them and the whole fold (a quarter of the
notebook's time at 16,384 simulated ranks); as bytes, they are nothing it tracks, and the
fold unpickles each batch's just before reading it (:func:`unseal`), so they die young.

Everything here is plain data (dicts, lists, str, bytes), as the transports carry it.
"""

from __future__ import annotations

import pickle
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from math import fsum
from typing import Any, Optional

from .events import COMM, LOGGED, MEMORY, SCALARS, SEALABLE, SEALED, STEP, TABLE, TABLED, Event
from .intervals import merge

__all__ = ["SUMMARY", "TRACE_ONLY", "column", "columns", "logged", "logged_columns", "numbers",
           "pack", "row", "rows", "seal", "summary", "summary_column", "table", "table_rows",
           "unlogged", "unpack", "unseal"]

_BIG = sys.byteorder == "big"  # arrays travel little-endian


#: the types a column of one repeated value is sent once for
_SCALARS = (str, bool, type(None))


def _encode(values: list[Any]) -> Any:
    """A column as ``b"d" + float64 bytes`` or ``b"q" + int64 bytes``; a column of
    same-length lists of floats (a step's forward span) as ``b"D", k`` and their floats; a
    column of one string, bool or None repeated (a collective's name and dtype) as
    ``{"=": value, "n": count}``; any other as the list.

    >>> _encode(["all_reduce"] * 3), _decode(_encode(["all_reduce"] * 3))
    ({'=': 'all_reduce', 'n': 3}, ['all_reduce', 'all_reduce', 'all_reduce'])
    """
    kinds = {type(v) for v in values}
    if (len(values) > 1 and len(kinds) == 1 and isinstance(values[0], _SCALARS)
            and values.count(values[0]) == len(values)):
        return {"=": values[0], "n": len(values)}
    head = b"d" if kinds == {float} else b"q" if kinds == {int} else None
    if head is None and kinds == {list}:
        sizes = {len(v) for v in values}
        k = sizes.pop() if len(sizes) == 1 else 0
        flat = [x for v in values for x in v]
        if 0 < k < 256 and {type(x) for x in flat} == {float}:
            head, values = b"D" + bytes([k]), flat
    if head is None:
        return values
    try:
        a = array(chr(head[0]).lower(), values)
    except OverflowError:  # an int beyond 64 bits
        return values
    if _BIG:
        a.byteswap()
    return head + a.tobytes()


def _decode(col: Any) -> list[Any]:
    if isinstance(col, (bytes, bytearray)):
        lists = col[0] == ord("D")
        a = array("d" if lists else chr(col[0]))
        a.frombytes(memoryview(col)[2 if lists else 1:])
        if _BIG:
            a.byteswap()
        if lists:
            k = col[1]
            return [a[i:i + k].tolist() for i in range(0, len(a), k)]
        return a.tolist()
    if isinstance(col, dict):
        return [col["="]] * col["n"]
    return list(col)


def columns(part: Event) -> dict[str, list[Any]]:
    """A part's columns by field name, as lists."""
    return {f: _decode(c) for f, c in zip(part["fields"], part["columns"])}


def row(part: Event, i: int) -> Event:
    """The ``i``-th event of a part, decoding only its own values."""
    e = {"kind": part["of"]}
    for f, c in zip(part["fields"], part["columns"]):
        if isinstance(c, (bytes, bytearray)):
            if c[0] == ord("D"):
                k = c[1]
                e[f] = list(struct.unpack_from(f"<{k}d", c, 2 + 8 * k * i))
            else:
                e[f] = struct.unpack_from("<" + chr(c[0]), c, 1 + 8 * i)[0]
        elif isinstance(c, dict):
            e[f] = c["="]
        else:
            e[f] = c[i]
    return e


def column(part: Event, name: str) -> list[Any]:
    """One of a part's columns, as a list (KeyError: the part has no such field)."""
    return _decode(part["columns"][part["fields"].index(name)])


def numbers(part: Event, name: str, summed: bool = False) -> Sequence[Any]:
    """One of a part's columns (``summed``: of its summary, :data:`SUMMARY`) without building
    its list where it is a column of floats or integers: a view of its bytes, which the fold
    slices and indexes for the few values it reads of a long column.

    >>> from nbdist.telemetry import events as ev
    >>> v = numbers(table([ev.step(0, 0.5, 1.0), ev.step(1, 1.0, 1.25)])["parts"][0], "t1")
    >>> v[-1], list(v[-1:]), len(v)
    (1.25, [1.25], 2)
    """
    return _view(part["steps"][name] if summed else part["columns"][part["fields"].index(name)])


def _view(col: Any) -> Sequence[Any]:
    # the fold's hottest call (a dozen a batch): the usual case tested first, cheaply
    # (about 2.5 µs a rank's batch, in 6 alternating runs of 2,048 ranks' batches)
    if type(col) is bytes and not _BIG:
        head = col[0]
        if head == _FLOATS or head == _INTS:
            return memoryview(col)[1:].cast(_TYPECODES[head])
    elif isinstance(col, bytearray) and col[:1] in (b"d", b"q") and not _BIG:
        return memoryview(col)[1:].cast(chr(col[0]))
    return _decode(col)


_FLOATS, _INTS = ord("d"), ord("q")
_TYPECODES = {_FLOATS: "d", _INTS: "q"}


def _summarized(e: Event) -> bool:
    """A collective the fold only needs in sum, per step (not one called outside a step, whose
    peers' calls are matched one by one, nor one of a mesh dimension, counted per dimension)."""
    return e["kind"] == COMM and e.get("step") is not None and e.get("dim") is None


def table(events: Sequence[Event]) -> Event:
    """Pack ``events`` (of :data:`~.events.TABLED` kinds) into one table event.

    >>> from nbdist.telemetry import events as ev
    >>> t = table([ev.comm("all_reduce", 1.0, 1.5, 8, step=0), ev.step(0, 0.5, 2.0)])
    >>> [p["of"] for p in t["parts"]], t["order"], summary(t["parts"][0])
    (['comm', 'step'], '01', [(0, 8, 8, False, 0.5, [(1.0, 1.5)])])
    >>> list(rows(t)) == [ev.comm("all_reduce", 1.0, 1.5, 8, step=0), ev.step(0, 0.5, 2.0)]
    True
    """
    parts: list[dict[str, Any]] = []
    index: dict[tuple, int] = {}
    order = []
    for e in events:
        summed = _summarized(e)
        key = (summed, *e)
        i = index.get(key)
        if i is None:
            i = index[key] = len(parts)
            fields = [k for k in e if k != "kind"]
            parts.append({"of": e["kind"], "fields": fields, "columns": [[] for _ in fields],
                          "n": 0, "summed": summed})
        part = parts[i]
        for col, k in zip(part["columns"], part["fields"]):
            col.append(e[k])
        part["n"] += 1
        order.append(chr(48 + i))
    for part in parts:
        if part.pop("summed"):
            _summarize(part)
        elif part["of"] == STEP and "t0" in part["fields"] and "t1" in part["fields"]:
            cols = dict(zip(part["fields"], part["columns"]))  # the steps' span, as above
            part["t0"], part["t1"] = min(cols["t0"]), max(cols["t1"])
        elif part["of"] == MEMORY and "t" in part["fields"]:  # the samples' span
            cols = dict(zip(part["fields"], part["columns"]))
            part["t0"], part["t1"] = min(cols["t"]), max(cols["t"])
            # and the one sample the fold keeps of them, where one holds anything
            held = [i for i, h in enumerate(zip(*(cols.get(k, ()) for k in _HELD))) if any(h)]
            part["held"] = ({"kind": MEMORY, **{f: c[held[-1]] for f, c in cols.items()}}
                            if held else None)
        part["columns"] = [_encode(c) for c in part["columns"]]
    return {"kind": TABLE, "parts": parts, "order": "".join(order)}


#: what a memory sample holds of the model: the fold keeps a rank's last sample holding any
_HELD = ("params", "grads", "optimizer")


#: a summary's columns, one value per step (``spans``: each step's ``intervals`` disjoint
#: intervals, start and end, one after the other)
SUMMARY = ("step", "bytes", "timed", "untimed", "busy", "intervals", "spans")


def _summarize(part: dict[str, Any]) -> None:
    """What the fold needs of a part of step collectives (see the module's docstring)."""
    cols = dict(zip(part["fields"], part["columns"]))
    t0s, t1s, nbytes = cols["t0"], cols["t1"], cols["bytes"]
    measured = cols.get("measured") or [""] * len(t0s)
    steps: dict[int, list[Any]] = {}
    for s, a, z, b, m in zip(cols["step"], t0s, t1s, nbytes, measured):
        acc = steps.get(s)
        if acc is None:
            acc = steps[s] = [0, 0, False, []]
        acc[0] += b
        if z > a:
            acc[1] += b
            acc[3].append((a, z))
        if m == "untimed":
            acc[2] = True
    out: dict[str, list[Any]] = {k: [] for k in SUMMARY}
    for s, (nb, tb, untimed, spans) in steps.items():
        union = merge(spans)
        for k, v in zip(SUMMARY, (s, nb, tb, untimed, float(fsum(b - a for a, b in union)),
                                  len(union))):
            out[k].append(v)
        out["spans"] += [x for span in union for x in span]
    part["steps"] = {k: _encode(v) for k, v in out.items()}
    part["bytes"] = sum(nbytes)
    part["t0"], part["t1"] = min(t0s), max(t1s)


def summary_column(part: Event, name: str) -> list[Any]:
    """One of the columns of a part's summary (:data:`SUMMARY`), as a list."""
    return _decode(part["steps"][name])


def summary(part: Event) -> list[tuple[int, int, int, bool, float, list[tuple[float, float]]]]:
    """A part's summary of its steps' collectives: ``(step, bytes, timed bytes, untimed,
    busy seconds, disjoint intervals)`` per step."""
    cols = {k: _decode(c) for k, c in part["steps"].items()}
    out, at = [], 0
    for s, nb, tb, untimed, busy, k in zip(*(cols[k] for k in SUMMARY[:-1])):
        flat = cols["spans"][at:at + 2 * k]
        at += 2 * k
        out.append((s, nb, tb, untimed, busy, list(zip(flat[::2], flat[1::2]))))
    return out


def table_rows(t: Event) -> int:
    """How many events a table holds."""
    return len(t["order"])


def rows(t: Event) -> Iterator[Event]:
    """The events a :func:`table` holds, as dicts, in the order they were packed."""
    parts = [(p["of"], p["fields"], list(zip(*(_decode(c) for c in p["columns"]))))
             for p in t["parts"]]
    taken = [0] * len(parts)
    for ch in t["order"]:
        i = ord(ch) - 48
        kind, fields, values = parts[i]
        e = {"kind": kind}
        e.update(zip(fields, values[taken[i]]))
        taken[i] += 1
        yield e


def pack(events: Iterable[Event]) -> list[Event]:
    """A batch's events with its :data:`~.events.TABLED` events as one table, where the last
    of them was (a lone one stays as it is).

    Only the high-rate events' order among themselves is kept exactly: the others that came
    between them (a logged value, a progress bar, the hang doctor's report) now come before
    them, which the fold does not mind (it orders a rank's reports by their times, not by
    their place in a batch; an end of cell comes after every step anyway).
    """
    events = list(events)
    high = [i for i, e in enumerate(events) if e.get("kind") in TABLED]
    if len(high) < 2:
        return events
    keep = set(high)
    return ([e for i, e in enumerate(events[:high[-1]]) if i not in keep]
            + [table([events[i] for i in high])] + events[high[-1] + 1:])


def unpack(events: Iterable[Event]) -> Iterator[Event]:
    """A batch's events with every table (sealed or not, and a sealed batch's logged values)
    expanded back into its events."""
    for e in events:
        kind = e.get("kind")
        if kind == SEALED:
            yield from unpack(unseal(e, whole=True))
        elif kind == TABLE:
            yield from rows(e)
        elif kind == LOGGED:
            yield from unlogged(e)
        else:
            yield e


_SCALARS_KEYS = frozenset({"kind", "values", "t", "step"})


def logged(events: Sequence[Event]) -> Optional[Event]:
    """Logged values (``scalars`` events, in order) as one ``logged`` event, a column per name
    (``names``; ``values``: their columns; ``t``, ``step``: a column each), where there are
    several and each logs the same names in the same order (the rule: a training loop logs
    the same values each time); None otherwise. :func:`unlogged` gives them back exactly.

    >>> from nbdist.telemetry import events as ev
    >>> evs = [ev.scalars({"loss": 0.5, "lr": 0.1}, 10.0, 1),
    ...        ev.scalars({"loss": 0.25, "lr": 0.1}, 11.0, 2)]
    >>> e = logged(evs); e["names"], unlogged(e) == evs
    (['loss', 'lr'], True)
    >>> logged([evs[0], ev.scalars({"acc": 1.0}, 12.0, 3)]) is None
    True
    """
    if len(events) < 2:
        return None
    names = list(events[0]["values"])
    if any(e.keys() != _SCALARS_KEYS or list(e["values"]) != names for e in events):
        return None
    return {"kind": LOGGED, "names": names, "t": _encode([e["t"] for e in events]),
            "step": _encode([e["step"] for e in events]),
            "values": [_encode([e["values"][k] for e in events]) for k in names]}


def logged_columns(e: Event) -> tuple[Sequence[float], Sequence[Optional[int]],
                                      list[Sequence[Any]]]:
    """A ``logged`` event's times, steps and values (a column per name), as
    :func:`numbers` gives columns."""
    return _view(e["t"]), _view(e["step"]), [_view(c) for c in e["values"]]


def unlogged(e: Event) -> list[Event]:
    """The ``scalars`` events a ``logged`` event (:func:`logged`) holds, in their order."""
    names = e["names"]
    return [{"kind": SCALARS, "values": dict(zip(names, values)), "t": t, "step": step}
            for t, step, values in zip(_decode(e["t"]), _decode(e["step"]),
                                       zip(*(_decode(c) for c in e["values"])))]


#: a step's columns only a trace reads (its forward and backward spans, its buckets, its
#: collectives' whole time, what measured it): :func:`seal` sends them apart from the fold's
TRACE_ONLY = frozenset({"comm_total_s", "buckets", "fwd", "bwd", "source"})


def seal(events: Sequence[Event]) -> list[Event]:
    """A packed batch's events (:func:`pack`) with those of :data:`~.events.SEALABLE` kinds
    pickled together into one ``sealed`` event, where the last of them was (as :func:`pack`
    places its table; a lone one stays as it is, unless it is a table, whose parts and columns
    are the lists and dicts sealing is for). ``n`` counts the events it holds, a table's rows
    each. Logged values go as columns (:func:`logged`). What only a trace reads goes apart,
    pickled and compressed (``rows``; zlib at its fastest level): the rows of a table's summed
    collectives (the fold reads their summary) and the step columns in :data:`TRACE_ONLY`.
    The fold neither unpickles nor decompresses them (a rank's 16 s batch of 160 steps: the
    fold unpickles 28 KB instead of 36, and 34 KB travel instead of 62).

    For the notebook's own workers only: the notebook unpickles what they send anyway (their
    channel is authenticated), which a job watched from outside is not trusted with.

    >>> from nbdist.telemetry import events as ev
    >>> s = seal(pack([ev.step(0, 0.5, 1.0), ev.step(1, 1.0, 1.5),
    ...                ev.scalars({"loss": 1.0}, 1.5, 1), ev.stream("stdout", "hi")]))
    >>> [e["kind"] for e in s], s[0]["n"], [e["kind"] for e in unseal(s[0])]
    (['sealed', 'stream'], 3, ['table', 'scalars'])
    >>> s = seal(pack([ev.comm("all_reduce", 0.6, 0.8, 8, step=0), ev.step(0, 0.5, 1.0)]))
    >>> [p["columns"] is None for p in unseal(s[0])[0]["parts"]]
    [True, False]
    >>> list(unpack(s)) == [ev.comm("all_reduce", 0.6, 0.8, 8, step=0), ev.step(0, 0.5, 1.0)]
    True
    >>> [e["kind"] for e in seal(pack([ev.step(0, 0.5, 1.0), ev.step(1, 1.0, 1.5)]))]
    ['sealed']
    >>> [e["kind"] for e in seal([ev.scalars({"loss": 1.0}, 1.5, 1)])]
    ['scalars']
    """
    low = [i for i, e in enumerate(events) if e.get("kind") in SEALABLE]
    if not low or (len(low) == 1 and events[low[0]]["kind"] != TABLE):
        return list(events)
    keep = set(low)
    inner = [events[i] for i in low]
    n = sum(table_rows(e) if e["kind"] == TABLE else 1 for e in inner)
    # logged values as columns, after the rest (the fold takes them after it, together)
    values = logged([e for e in inner if e["kind"] == SCALARS])
    if values is not None:
        inner = [e for e in inner if e["kind"] != SCALARS] + [values]
    rows: list[Any] = []  # what is apart, per part that has any, in the parts' order
    for i, e in enumerate(inner):
        if e["kind"] == TABLE:
            parts = [_apart(p, rows) for p in e["parts"]]
            if any(a is not b for a, b in zip(parts, e["parts"])):
                inner[i] = {**e, "parts": parts}
    sealed = {"kind": SEALED, "events": pickle.dumps(inner, 5), "n": n}
    if rows:
        sealed["rows"] = zlib.compress(pickle.dumps(rows, 5), 1)
    return ([e for i, e in enumerate(events[:low[-1]]) if i not in keep] + [sealed]
            + list(events[low[-1] + 1:]))


def unseal(e: Event, whole: bool = False) -> list[Event]:
    """The events a ``sealed`` event (:func:`seal`) holds, in their order, as the fold reads
    them: a part of summed collectives without its rows (``columns`` None), a part of steps
    without its :data:`TRACE_ONLY` columns, unless ``whole`` (a trace's reading)."""
    inner = pickle.loads(e["events"])
    if whole and "rows" in e:
        rows = iter(pickle.loads(zlib.decompress(e["rows"])))
        for x in inner:
            if x["kind"] == TABLE:
                for p in x["parts"]:
                    if "steps" in p and p["columns"] is None:
                        p["columns"] = next(rows)
                    elif p.pop("apart", False):  # back in their places, in order
                        for j, field, col in next(rows):
                            p["fields"].insert(j, field)
                            p["columns"].insert(j, col)
    return inner


def _apart(p: Event, rows: list[Any]) -> Event:
    """Part ``p`` as the fold reads it, what only a trace reads appended to ``rows``: a part
    of summed collectives without its rows (``columns`` None), a part of steps without its
    :data:`TRACE_ONLY` columns (``apart`` True; their indices, names and columns go to
    ``rows``). Any other part as it is."""
    if "steps" in p:
        rows.append(p["columns"])
        return {**p, "columns": None}
    if p["of"] != STEP:
        return p
    fields = p["fields"]
    out = [j for j, f in enumerate(fields) if f in TRACE_ONLY]
    if not out:
        return p
    rows.append([(j, fields[j], p["columns"][j]) for j in out])
    kept = [j for j, f in enumerate(fields) if f not in TRACE_ONLY]
    return {**p, "fields": [fields[j] for j in kept],
            "columns": [p["columns"][j] for j in kept], "apart": True}
