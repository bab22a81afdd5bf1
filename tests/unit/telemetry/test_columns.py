"""Tables of events on the wire: packing on the worker, unpacking in the notebook (pure)."""

from __future__ import annotations

import pickle

from synthetic import T0, ddp_job

from nbdist.telemetry import events as ev
from nbdist.telemetry.columns import column, columns, pack, row, rows, summary, table, unpack
from nbdist.telemetry.intervals import merge, union_seconds


def mixed_events() -> list[dict]:
    """A rank's high-rate events of every kind, with fields that are None, lists, strings,
    optional keys and a float-or-int column."""
    evs = ddp_job({0: 0.01}, steps=3, bucket_bytes=(100, 200))[0]
    evs.insert(1, ev.comm("all_reduce", T0, T0, 64, step=0, measured="untimed"))
    evs.append(ev.comm("all_gather", T0 + 1, T0 + 1.5, 2 ** 40, step=2, dim="tp"))
    evs.append(ev.comm("broadcast", T0 + 2, T0 + 2.1, 8))  # outside any step
    evs.append(ev.comm("send", T0 + 2, T0 + 2.2, 8, peer=1, mb="F3"))
    evs.append(ev.memory(T0 + 3, params=1, grads=2, optimizer=3, rss=None, peak=5, step=2))
    evs.append(ev.memory(T0 + 3.5, params=1, grads=2, optimizer=3, rss=4, peak=5,
                         device_peak=2 ** 70))
    evs.append(ev.stage("forward", 0, 1, T0 + 4, T0 + 4.5))
    evs.append(ev.step(3, T0 + 4, T0 + 5, samples=2.5, fwd=(T0 + 4, T0 + 4.2)))
    evs.append(ev.step(4, T0 + 5, T0 + 6, source="progress"))  # no forward span: None
    return evs


def test_a_table_gives_back_every_event_in_its_order():
    evs = mixed_events()
    t = table(evs)
    assert list(rows(t)) == evs
    assert list(rows(pickle.loads(pickle.dumps(t)))) == evs  # as the transports carry it
    # one part per kind and set of keys; numbers travel as array bytes, the rest as lists
    kinds = [p["of"] for p in t["parts"]]
    assert kinds.count("comm") >= 3 and "memory" in kinds and "stage" in kinds
    steps = next(p for p in t["parts"] if p["of"] == "step")
    cols = dict(zip(steps["fields"], steps["columns"]))
    assert isinstance(cols["t0"], bytes) and isinstance(cols["step"], bytes)
    assert isinstance(cols["fwd"], list)  # spans or None
    timed = [ev.step(n, T0 + n, T0 + n + 1, fwd=(T0 + n, T0 + n + 0.3)) for n in range(3)]
    part = table(timed)["parts"][0]
    assert isinstance(dict(zip(part["fields"], part["columns"]))["fwd"], bytes)  # pairs
    assert list(rows(table(timed))) == timed
    mem = [p for p in t["parts"] if p["of"] == "memory"]
    assert any(isinstance(dict(zip(p["fields"], p["columns"]))["rss"], list) for p in mem)


def test_columns_and_single_rows_decode_alike():
    t = table(mixed_events())
    for part in t["parts"]:
        cols = columns(part)
        assert all(column(part, f) == cols[f] for f in part["fields"])
        every = [dict({"kind": part["of"]}, **dict(zip(cols, vals)))
                 for vals in zip(*cols.values())]
        assert [row(part, i) for i in range(part["n"])] == every


def test_collectives_of_steps_are_summed_on_the_worker():
    evs = ddp_job({0: 0.01}, steps=2, bucket_bytes=(100, 200))[0]
    evs.insert(0, ev.comm("all_reduce", T0, T0, 50, step=0, measured="untimed"))
    [part] = [p for p in table(evs)["parts"] if p["of"] == "comm"]
    by_step = {e[0]: e for e in summary(part)}
    assert sorted(by_step) == [0, 1] and part["n"] == 5 and part["bytes"] == 650
    assert all(isinstance(c, bytes) for k, c in part["steps"].items() if k != "untimed")
    spans = [(c["t0"], c["t1"]) for c in evs if c["kind"] == "comm" and c["step"] == 0
             and c["t1"] > c["t0"]]
    # bytes, timed bytes, one without a time, the time any ran, their union
    assert by_step[0][1:] == (350, 300, True, union_seconds(spans), merge(spans))
    # collectives outside steps, or of a mesh dimension, are folded one by one: no summary
    t = table([ev.comm("broadcast", T0, T0 + 1, 8), ev.comm("all_reduce", T0, T0 + 1, 8,
                                                           step=0, dim="dp")])
    assert all("steps" not in p for p in t["parts"])


def test_pack_makes_one_table_where_the_last_high_rate_event_was():
    log, bar, end = ev.scalars({"loss": 1.0}, T0, 0), ev.progress(1, "", 1, 3, T0), \
        ev.end(True, T0 + 9)
    steps = ddp_job({0: 0.01}, steps=2)[0]
    out = pack([ev.stream("stdout", "hi\n"), *steps[:3], log, *steps[3:], bar, end])
    assert [e["kind"] for e in out] == ["stream", "scalars", "table", "progress", "end"]
    assert list(rows(out[2])) == steps
    assert sorted(map(repr, unpack(out))) == sorted(map(repr, [
        ev.stream("stdout", "hi\n"), *steps, log, bar, end]))
    lone = ev.memory(T0, params=1, grads=1, optimizer=1, rss=None, peak=None)
    assert pack([log, lone, bar]) == [log, lone, bar]  # nothing to gain from a table of one
    assert pack([]) == []
