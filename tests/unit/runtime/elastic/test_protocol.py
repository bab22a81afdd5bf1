"""What the notebook and the ranks of an elastic run agree on
(:mod:`nbdist.runtime.elastic.protocol`): the store's keys, what a replacement worker runs to
resume a cell, and which names of a namespace can travel to it."""

from __future__ import annotations

import pickle

from nbdist.runtime.elastic.protocol import (
    arrive_key,
    cell_of,
    join_key,
    joiner_source,
    picklable_namespace,
    plan_key,
    run_key,
)


def test_the_replacement_resumes_at_the_calling_statement_with_its_assignment():
    source = "\n".join([
        "import torch",                     # 1
        "def f(s):",                        # 2
        "    return 1",                     # 3
        "losses = train(",                  # 4
        "    state)",                       # 5
        "print(losses)",                    # 6
    ])
    out = joiner_source(source, 5, "RESUME")
    lines = out.split("\n")
    assert lines[3] == "losses = RESUME()" and lines[5] == "print(losses)"
    assert lines[:3] == ["", "", ""]  # line numbers stay the cell's own
    assert joiner_source(source, None, "RESUME") == "RESUME()\n"
    compile(out, "<cell>", "exec")


def test_names_that_cannot_travel_are_left_out_with_the_reason():
    import threading

    ns = {"__builtins__": {}, "rank": 0, "a": 1, "lock": threading.Lock()}
    kept, dropped = picklable_namespace(ns, pickle.dumps)
    assert kept == {"a": 1} and "lock" in dropped and "pickle" in dropped["lock"]


def test_both_sides_spell_the_store_keys_the_same():
    key = run_key("c0ffee", 2)
    assert cell_of(key) == "c0ffee"
    assert len({plan_key(key, 1), plan_key(key, 2), join_key(key),
                arrive_key(key, 1, "7")}) == 4
    assert all(k.startswith(key + "/") for k in (plan_key(key, 1), join_key(key)))
