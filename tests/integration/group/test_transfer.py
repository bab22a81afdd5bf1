"""Push and pull through real workers on both engines: values come back equal (dtype, shape,
strides, views), large ones over the notebook's data channel and small ones through the
engine, and the channel (plain TCP on these plain clusters) refuses a connection without a
live ticket."""

from __future__ import annotations

import socket

import pytest
import torch
from clusters import ENGINES, start_session

from nbdist.runtime import packing as wire

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=ENGINES)
def session(request):
    s = start_session(request.param)
    yield s
    s.stop()


BASE = torch.arange(2_000_000, dtype=torch.float32).reshape(1000, 2000)
VALUES = {
    "big": torch.randn(3_000_000),  # 12 MB: the data channel
    "small": torch.arange(10),  # inside the engine's message
    "transposed": BASE.t(),
    "strided": BASE[::3, 1::2],
    "bf16": torch.randn(600_000, dtype=torch.bfloat16),
    "nested": {"list": [torch.ones(400_000), ("x", 2)], "n": 3},
}


def test_values_pushed_to_every_rank_come_back_equal_from_each(session):
    session.push(VALUES)
    session.run_cell("echo = {k: globals()[k] for k in "
                     "['big', 'small', 'transposed', 'strided', 'bf16', 'nested']}\n"
                     "big.add_(0)  # the received memory is the worker's to write",
                     output="quiet")
    for rank in range(session.world_size):
        echo = session.pull("echo", rank=rank)
        for k in ("big", "small", "transposed", "strided", "bf16"):
            a, b = VALUES[k], echo[k]
            assert (b.dtype, b.shape, b.stride()) == (a.dtype, a.shape, a.stride()), k
            assert torch.equal(a, b), k
        assert torch.equal(echo["nested"]["list"][0], VALUES["nested"]["list"][0])
        assert echo["nested"]["list"][1] == ("x", 2) and echo["nested"]["n"] == 3


def test_a_trained_module_and_a_view_of_a_worker_tensor(session):
    session.run_cell("import torch\ntorch.manual_seed(rank)\n"
                     "net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),"
                     " torch.nn.Linear(512, 4))\n"
                     "whole = torch.arange(4_000_000.)\npart = whole[1000:3_001_000:2]",
                     output="quiet")
    net = session.pull("net", rank=1)
    torch.manual_seed(1)
    want = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 4))
    for (k, a), (_, b) in zip(want.state_dict().items(), net.state_dict().items()):
        assert torch.equal(a, b), k
    part = session.pull("part")
    assert part.stride() == (2,) and torch.equal(part, torch.arange(4_000_000.)[1000:3_001_000:2])


def test_the_data_channel_serves_only_live_tickets(session):
    channel = session.transfers.channel(session.membership)
    assert channel is not None and channel.address[0] == "127.0.0.1"
    assert channel.tls is None  # a plain cluster: plain TCP, at no cost
    ticket = channel.offer([torch.arange(1000).numpy()])
    got = wire.fetch(channel.address, ticket, 10)
    assert bytes(got[0]) == torch.arange(1000).numpy().tobytes()
    assert set(channel.served) == {"tcp"}
    channel.forget(ticket)
    with pytest.raises(ValueError):  # closed unanswered
        wire.fetch(channel.address, ticket, 10)
    with socket.create_connection(channel.address, timeout=10) as conn:
        conn.sendall(wire.GET + b"\0" * wire.TICKET)
        assert conn.recv(1) == b""


#: on a worker: whether tensor ``t``'s memory lies in a mapping of the notebook's shared copy
IN_SHARED_COPY = """
def in_shared_copy(t):
    at = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= at < hi:
            return "memfd:nbdist-transfer" in line
    return False
"""


@pytest.mark.parametrize("shared", [True, False], ids=["shared-copy", "data-channel"])
def test_a_push_to_workers_on_this_machine_maps_one_copy_and_each_rank_owns_its_value(
        session, shared):
    """Workers on the notebook's machine map one copy-on-write copy (or, switched off, each
    fetch their own over the data channel): a rank's in-place write stays its own."""
    value = torch.randn(2_000_000)
    keep = value.clone()
    session.transfers.shared = shared
    try:
        session.push({"pushed": value})
    finally:
        session.transfers.shared = True
    session.run_cell(IN_SHARED_COPY + "mapped = in_shared_copy(pushed)\n"
                     "if rank == 0:\n    pushed.mul_(-1)\n", output="quiet")
    for rank in range(session.world_size):
        assert session.pull("mapped", rank=rank) is shared, rank
    assert torch.equal(session.pull("pushed", rank=0), -keep)
    assert torch.equal(session.pull("pushed", rank=1), keep)  # rank 0's write did not reach it
    assert torch.equal(value, keep)  # nor the notebook's tensor


def _mapped_from_shared_copy(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory, in this (the notebook's) process, is a shared copy's mapping."""
    namespace: dict = {}
    exec(IN_SHARED_COPY, namespace)
    return namespace["in_shared_copy"](t)


@pytest.mark.parametrize("mappable", [True, False], ids=["shared-copy", "refused"])
def test_a_pull_from_a_worker_on_this_machine_maps_its_copy_or_takes_the_bytes(
        session, monkeypatch, mappable):
    """A local rank offers the notebook one shared copy; where the notebook cannot map it,
    the rank sends the bytes over the data channel instead."""
    from nbdist.runtime import shared_copy

    if not mappable:  # the notebook fails to map it
        monkeypatch.setattr(shared_copy, "attach", lambda spec, ticket: None)
    session.run_cell("import torch\nbig_one = torch.arange(3_000_000.) * (rank + 1)",
                     output="quiet")
    got = session.pull("big_one", rank=1)
    assert torch.equal(got, torch.arange(3_000_000.) * 2)
    assert _mapped_from_shared_copy(got) is mappable
    got.add_(1)  # the notebook's to write: the worker's own is untouched
    assert torch.equal(session.pull("big_one", rank=1), torch.arange(3_000_000.) * 2)


def test_with_the_shared_copy_off_a_pull_takes_the_bytes(session):
    session.run_cell("import torch\nbig_two = torch.arange(2_000_000.) - rank", output="quiet")
    session.transfers.shared = False
    try:
        got = session.pull("big_two", rank=1)
    finally:
        session.transfers.shared = True
    assert torch.equal(got, torch.arange(2_000_000.) - 1) and not _mapped_from_shared_copy(got)
