"""One engine message for the calls that are the same on every worker."""

from __future__ import annotations

from nbdist.backends.base import Call
from nbdist.backends.ipyparallel.adapter import _same_calls


def _f() -> None:
    return None


def _g() -> None:
    return None


def test_calls_with_the_same_function_and_arguments_go_together():
    args, kwargs = ("x = 1",), {"measure": None}
    calls = [Call(w, _f, args, kwargs) for w in (0, 1, 2)]
    assert [[c.worker for c in g] for g in _same_calls(calls)] == [[0, 1, 2]]


def test_calls_that_differ_are_sent_on_their_own_in_order():
    shared = ("x = 1",)
    calls = [Call(0, _f, shared, None), Call(1, _f, shared, None),
             Call(2, _f, tuple(["x = 1"]), None),  # equal, not the same object: its own
             Call(3, _g, shared, None), Call(4, _f, shared, None)]
    assert [[c.worker for c in g] for g in _same_calls(calls)] == [[0, 1], [2], [3], [4]]
