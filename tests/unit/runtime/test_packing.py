"""Values as a protocol-5 pickle with out-of-band buffers (push, pull): what goes out of band,
and that every value comes back equal, with its dtype, shape, strides and sharing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from nbdist.runtime import packing as transfer


def roundtrip(obj, readonly: bool = False, max_buffers: int = transfer.MAX_BUFFERS):
    header, buffers, layout = transfer.pack(obj, max_buffers)
    # what an engine delivers: the bytes of each buffer, as a new object (read-only or not)
    wire = [memoryview(bytes(b)) if readonly else memoryview(bytearray(b)) for b in buffers]
    return transfer.unpack(pickle.loads(pickle.dumps(header)), wire, layout)


BASE = torch.arange(120.0).reshape(10, 12)
TENSORS = {
    "contiguous": torch.randn(300, 300),
    "transposed": BASE.t(),
    "slice": BASE[2:5, 3:7],
    "strided": BASE[::3, ::2],
    "expanded": torch.ones(3, 1).expand(3, 4),
    "offset view": torch.randn(70_000)[1000:],
    "empty": torch.empty(0, 5),
    "scalar": torch.tensor(3.5),
    "bool": torch.rand(100_000) > 0.5,
    "bfloat16": torch.randn(70_000, dtype=torch.bfloat16),
    "complex64": torch.randn(40_000, dtype=torch.complex64),
    "int8": torch.randint(-5, 5, (100_000,), dtype=torch.int8),
    "int64": torch.randint(0, 1 << 40, (20_000,)),
    "channels_last": torch.randn(2, 8, 40, 40).to(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "read-only"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_tensors_come_back_equal_with_dtype_shape_and_strides(name, readonly):
    t = TENSORS[name]
    back = roundtrip({"t": t}, readonly)["t"]
    assert type(back) is torch.Tensor
    assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
    assert back.is_contiguous() == t.is_contiguous()
    assert torch.equal(back, t)
    if back.dtype != torch.bool and back.numel() and 0 not in back.stride():
        back.add_(1)  # its memory is writable (and its own: the original is unchanged)
        assert not torch.equal(back, t)


def test_large_tensors_leave_the_pickle_and_small_ones_stay():
    big, small = torch.randn(256, 1024), torch.randn(10)
    header, buffers, layout = transfer.pack({"big": big, "small": small})
    assert layout is None and len(buffers) == 1
    assert buffers[0].nbytes == big.numel() * 4
    assert len(header) < 4096  # the big one's bytes are not in it
    # out of band means no copy: the buffer is the tensor's own memory
    assert buffers[0].ctypes.data == big.data_ptr()


def test_a_view_sends_only_the_span_it_views():
    whole = torch.randn(1000, 1000)
    header, buffers, _ = transfer.pack(whole[10:30])
    assert sum(b.nbytes for b in buffers) == 20 * 1000 * 4


def test_modules_parameters_and_gradients():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.ReLU(), torch.nn.Linear(300, 2))
    back = roundtrip(m)
    assert isinstance(back[0].weight, torch.nn.Parameter) and back[0].weight.requires_grad
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    x = torch.randn(4, 300)
    assert torch.equal(back(x), m(x))


def test_the_same_tensor_twice_stays_one_tensor():
    shared = torch.nn.Linear(200, 200)
    tied = torch.nn.ModuleDict({"a": shared, "b": shared})
    back = roundtrip({"m": tied, "w": shared.weight})
    assert back["m"]["a"] is back["m"]["b"]
    assert back["w"] is back["m"]["a"].weight


def test_nested_containers_numpy_and_plain_objects():
    value = {"list": [torch.randn(50_000), (1, "two", None)],
             "tuple": (np.arange(100_000, dtype=np.float32), {"deep": torch.zeros(3)}),
             "fn": lambda x: x + 1, "bytes": b"x" * 100_000, "set": {1, 2}}
    back = roundtrip(value)
    assert torch.equal(back["list"][0], value["list"][0])
    assert back["list"][1] == (1, "two", None)
    assert np.array_equal(back["tuple"][0], value["tuple"][0])
    assert torch.equal(back["tuple"][1]["deep"], torch.zeros(3))
    assert back["fn"](1) == 2 and back["bytes"] == value["bytes"] and back["set"] == {1, 2}


def test_past_the_buffer_limit_the_smallest_are_joined():
    many = {f"t{i}": torch.full((20_000 + i,), float(i)) for i in range(12)}
    header, buffers, layout = transfer.pack(many, max_buffers=5)
    assert len(buffers) == 5 and layout is not None
    back = roundtrip(many, max_buffers=5)
    assert all(torch.equal(back[k], many[k]) for k in many)


def test_tensors_torch_must_pickle_keep_torch_pickling():
    sparse = torch.eye(300).to_sparse()
    header, buffers, _ = transfer.pack(sparse)
    assert not buffers  # torch's own pickling, in band
    assert torch.equal(roundtrip(sparse).to_dense(), sparse.to_dense())


def test_a_tensor_that_requires_grad_comes_back_as_a_leaf_that_does():
    computed = torch.randn(300, 300, requires_grad=True) * 2
    back = roundtrip(computed)
    assert back.requires_grad and back.is_leaf and torch.equal(back, computed.detach())
