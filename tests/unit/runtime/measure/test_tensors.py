"""``batch_size``: the samples a call's arguments carry, as the worker's sample counts read it;
``payload``: the bytes and dtype a collective moves, as the collective timers read them."""

from __future__ import annotations

import sys
from collections import namedtuple

import pytest

from nbdist.runtime.measure.tensors import batch_size, payload

torch = pytest.importorskip("torch")


def test_the_leading_dimension_of_the_first_tensor():
    x, y = torch.zeros(8, 3), torch.zeros(5)
    assert batch_size((x, y)) == 8
    assert batch_size(("text", 3, y)) == 5
    assert batch_size((torch.tensor(1.0),)) == 1  # a scalar is one sample


def test_the_first_item_of_lists_tuples_and_dicts_is_looked_into():
    x = torch.zeros(4, 2)
    assert batch_size(([x, torch.zeros(9)],)) == 4
    assert batch_size(({"input_ids": x, "mask": torch.zeros(9)},)) == 4
    assert batch_size(([[x]],)) == 4
    assert batch_size(([],)) == 0


def test_a_named_tuple_is_a_record_not_a_batch():
    Pair = namedtuple("Pair", "a b")
    assert batch_size((Pair(torch.zeros(3), torch.zeros(2)), torch.zeros(6))) == 6


def test_no_tensor_is_no_samples():
    assert batch_size(()) == 0
    assert batch_size(("a", 1, None)) == 0


def test_without_torch_imported_there_is_nothing_to_count(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    assert batch_size((object(),)) == 0


def test_a_collectives_payload_is_its_largest_buffer():
    x = torch.zeros(8, 4)  # 128 bytes of float32
    assert payload((x,), {}) == (128, "float32")
    # all_gather(outputs, input): the gathered list, not the one input
    outs = [torch.zeros(8, 4, dtype=torch.float16) for _ in range(4)]
    assert payload((outs, torch.zeros(8, 4, dtype=torch.float16)), {}) == (256, "float16")
    assert payload((), {"tensor": torch.zeros(3, dtype=torch.int64)}) == (24, "int64")
    assert payload(("sum", None, []), {"async_op": True}) == (0, "")


def test_payload_looks_torch_up_and_never_imports_it(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delitem(sys.modules, "torch")
    assert payload((x,), {}) == (0, "")
    assert "torch" not in sys.modules
