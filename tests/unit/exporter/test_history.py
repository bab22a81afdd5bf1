"""The session's record for export (:mod:`nbdist.exporter.history`): cells in order, pushed
values kept as code where they are literals, pickled otherwise, named where too large."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from nbdist.exporter.history import CellEntry, History, literal_code


@pytest.mark.parametrize("value", [0.1, 3, "a'b", None, True, [1, (2, "x")], {"k": [1.5]}])
def test_literals_are_kept_as_code(value):
    assert eval(literal_code(value)) == value


@pytest.mark.parametrize("value", [float("nan"), object(), bytearray(b"x"), frozenset({1})])
def test_other_values_are_not_literals(value):
    assert literal_code(value) is None


def test_history_keeps_literals_as_code_and_pickles_the_rest():
    h = History()
    blob = cloudpickle.dumps({"w": [object]})
    h.push({"w": [object]}, blob)
    h.push({"lr": 0.1, "v": [object]})
    h.cell(1, "x = 1")
    first, second, cell = h.entries
    assert first.blob is blob and first.code == {} and first.pickled == ("w",)
    assert second.code == {"lr": "0.1"} and pickle.loads(second.blob) == {"v": [object]}
    assert cell == CellEntry(1, "x = 1", None)
    assert repr(h).startswith("<nbdist.History: 1 cell, 2 pushes, push copies ")
    h.reset()
    assert len(h) == 0


def test_values_too_large_to_keep_are_named_not_kept():
    h = History(max_kept_bytes=100)
    h.push({"big": "x" * 10, "blob": bytearray(1000)})
    (entry,) = h.entries
    assert entry.code == {"big": repr("x" * 10)} and entry.blob is None
    assert entry.dropped == ("blob",)


def test_a_push_of_known_size_keeps_a_copy_as_it_was_and_pickles_it_when_asked():
    h = History(max_kept_bytes=1000)
    weights = [[0.5, object]]
    h.push({"w": weights, "lr": 0.1}, size=200, ranks=[1])
    weights[0][0] = 9.0  # the notebook changes its value after the push
    (entry,) = h.entries
    assert entry.pickle is None and entry.ranks == (1,)  # nothing pickled yet
    assert entry.code == {"lr": "0.1"} and entry.pickled == ("w",)
    assert pickle.loads(entry.blob)["w"][0][0] == 0.5  # the value as it was pushed


def test_a_push_larger_than_the_limit_is_named_without_being_pickled():
    h = History(max_kept_bytes=100)
    h.push({"blob": object(), "n": 3}, size=10_000)
    (entry,) = h.entries
    assert entry.dropped == ("blob",) and entry.blob is None and entry.code == {"n": "3"}
    h.cell(2, "y = n", ranks=[0, 1])
    assert [c.ranks for c in h.cells] == [(0, 1)] and len(h) == 2
