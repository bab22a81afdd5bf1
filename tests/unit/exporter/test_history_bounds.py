"""The export record's bounds: push copies share one budget (the oldest give way), a push of
a name replaces the copy an earlier push kept of it, the latest cells are kept; the export
says what gave way, and a script whose value was replaced before any cell read it still runs."""

from __future__ import annotations

import pickle

import pytest
from unit.exporter.test_torchrun import SHAPE, run_script

from nbdist.exporter.history import (
    OVER_BUDGET,
    PUSH_BUDGET_BYTES,
    REPLACED,
    TOO_LARGE,
    History,
    PushEntry,
    push_budget,
)
from nbdist.exporter.torchrun import render


class Blob:
    """A pushed value that is not a literal (kept as a copy, not as code)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


def pushes(h: History) -> list[PushEntry]:
    return [e for e in h.entries if isinstance(e, PushEntry)]


def test_a_push_of_the_same_name_replaces_the_copy_it_supersedes():
    h = History(budget=10_000)
    h.push({"data": Blob("old"), "lr": 0.1}, size=400)
    h.push({"data": Blob("new")}, size=400)
    first, second = pushes(h)
    assert not first.kept and first.dropped == ("data",) and first.reason("data") == REPLACED
    assert first.code == {"lr": "0.1"}  # a literal costs nothing: kept as code
    assert second.kept and pickle.loads(second.blob)["data"].tag == "new"
    assert h.kept_bytes == 400  # one copy, not two


def test_a_push_to_some_ranks_replaces_nothing_the_other_ranks_hold():
    h = History(budget=10_000)
    h.push({"data": Blob("all")}, size=100)
    h.push({"data": Blob("rank 1")}, ranks=[1], size=100)
    assert [e.kept for e in pushes(h)] == [True, True]
    h.push({"data": Blob("all again")}, size=100)  # every rank: both earlier copies go
    assert [e.kept for e in pushes(h)] == [False, False, True] and h.kept_bytes == 100


def test_only_the_names_pushed_again_go_from_an_earlier_push():
    h = History(budget=10_000)
    h.push({"a": Blob("a"), "b": Blob("b")}, size=600)
    h.push({"a": Blob("a2")}, size=300)
    first = pushes(h)[0]
    assert first.pickled == ("b",) and set(pickle.loads(first.blob)) == {"b"}
    assert first.nbytes == 300  # half the names left: half the bytes counted


def test_the_budget_lets_go_of_the_oldest_copies_first():
    h = History(budget=250)
    for name in ("a", "b", "c"):
        h.push({name: Blob(name)}, size=100)
    a, b, c = pushes(h)
    assert (a.kept, b.kept, c.kept) == (False, True, True) and h.kept_bytes == 200
    assert a.reason("a") == OVER_BUDGET.format(budget="0.0 MiB")
    h.push({"d": Blob("d")}, size=300)  # over the budget alone: never kept
    assert not pushes(h)[-1].kept and h.kept_bytes == 200


def test_a_blob_pushed_without_a_size_counts_its_pickle():
    h = History(budget=10_000)
    h.push({"w": Blob("w")})
    (e,) = pushes(h)
    assert e.kept and e.nbytes == len(e.blob) == h.kept_bytes


def test_the_latest_cells_are_kept_and_the_rest_counted():
    h = History(max_cells=3)
    h.push({"lr": 0.1})
    for n in range(1, 6):
        h.cell(n, f"x = {n}")
    assert [c.number for c in h.cells] == [3, 4, 5] and h.forgotten == 2
    assert len(h) == 3  # the push before the first kept cell went with it
    out = render(h.entries, SHAPE, "train.py", forgotten=h.forgotten)
    assert out.left_out == ("the first 2 cells since the group formed (the record keeps "
                            "the latest 3)",)
    assert "# ---- not kept: the first 2 cells" in out.script
    h.reset()
    assert len(h) == 0 and h.forgotten == 0 and h.describe().startswith("0 cells")


def test_the_export_names_a_value_the_budget_let_go(tmp_path):
    h = History(budget=150)
    h.push({"w": Blob("w")}, size=100)
    h.cell(1, "a = w.tag")
    h.push({"v": Blob("v")}, size=100)  # over the budget: w's copy gives way
    h.cell(2, "b = v.tag")
    out = render(h.entries, SHAPE, "train.py")
    assert out.left_out == (f"pushed value 'w' ({OVER_BUDGET.format(budget='0.0 MiB')}; the "
                            "script stops there)",)
    with pytest.raises(SystemExit, match="w was pushed from the notebook but is not in the "
                                         r"export \(its copy gave way"):
        run_script(out.script, 0, data=out.data, tmp_path=tmp_path)


def test_a_value_replaced_before_any_cell_read_it_is_not_missed(tmp_path):
    h = History(budget=10_000)
    h.push({"data": Blob("first")}, size=100)
    h.cell(1, "x = 1")  # does not read data
    h.push({"data": Blob("second")}, size=100)
    h.cell(2, "tag = data.tag")
    out = render(h.entries, SHAPE, "train.py")
    assert out.left_out == ()
    ns = run_script(out.script, 0, data=out.data, tmp_path=tmp_path)
    assert ns["tag"] == "second"


def test_a_replaced_value_a_cell_read_stops_the_script_and_says_why(tmp_path):
    h = History(budget=10_000)
    h.push({"data": Blob("first")}, size=100)
    h.cell(1, "tag = data.tag")
    h.push({"data": Blob("second")}, size=100)
    out = render(h.entries, SHAPE, "train.py")
    assert out.left_out == (f"pushed value 'data' ({REPLACED}; the script stops there)",)
    with pytest.raises(SystemExit, match="a later push of the same name replaced its copy"):
        run_script(out.script, 0, data=out.data, tmp_path=tmp_path)


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("NBDIST_PUSH_BUDGET_MIB", raising=False)
    assert push_budget() == PUSH_BUDGET_BYTES == 256 * 2**20
    monkeypatch.setenv("NBDIST_PUSH_BUDGET_MIB", "1.5")
    assert push_budget() == 3 * 2**19 and History().budget == 3 * 2**19
    monkeypatch.setenv("NBDIST_PUSH_BUDGET_MIB", "lots")
    with pytest.raises(ValueError, match="NBDIST_PUSH_BUDGET_MIB must be a number of MiB"):
        push_budget()


def test_a_value_too_large_for_one_push_says_so_not_budget():
    h = History(max_kept_bytes=100, budget=1000)
    h.push({"big": Blob("big")}, size=500)
    assert pushes(h)[0].reason("big") == TOO_LARGE
