"""A push's shared copy (runtime/shared_copy.py): written once, mapped copy-on-write by a
worker that holds the push's ticket, refused where the file is not the one the ticket names."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from nbdist.runtime.shared_copy import SharedCopy, attach

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux's memfd_create")

TICKET = b"t" * 16


@pytest.fixture
def buffers():
    return [np.arange(1_000_003, dtype=np.uint8), np.frombuffer(b"xyz", dtype=np.uint8),
            np.random.default_rng(0).integers(0, 255, 9000, dtype=np.uint8)]


def test_the_buffers_come_back_equal_each_at_a_page_boundary(buffers):
    shared = SharedCopy(buffers, TICKET)
    try:
        pid, fd, offsets, sizes, total = shared.spec
        assert all(off % os.sysconf("SC_PAGE_SIZE") == 0 for off in offsets)
        views = attach(shared.spec, TICKET)
    finally:
        shared.close()
    assert views is not None and total >= sum(sizes)
    assert [bytes(v) for v in views] == [b.tobytes() for b in buffers]


def test_a_worker_s_writes_stay_its_own(buffers):
    shared = SharedCopy(buffers, TICKET)
    try:
        first = attach(shared.spec, TICKET)
        first[0][:5] = b"\xff" * 5
        second = attach(shared.spec, TICKET)
    finally:
        shared.close()
    assert bytes(first[0][:5]) == b"\xff" * 5
    assert bytes(second[0]) == buffers[0].tobytes()  # the file itself is unchanged


def test_the_mapping_outlives_the_notebook_s_file(buffers):
    shared = SharedCopy(buffers, TICKET)
    views = attach(shared.spec, TICKET)
    shared.close()
    assert bytes(views[2]) == buffers[2].tobytes()


def test_a_wrong_ticket_or_an_unreachable_file_is_refused(buffers):
    shared = SharedCopy(buffers, TICKET)
    try:
        pid, fd, offsets, sizes, total = shared.spec
        assert attach(shared.spec, secrets.token_bytes(16)) is None  # another push's file
        assert attach((pid, fd, offsets, sizes, total + 4096), TICKET) is None  # another size
        assert attach((pid, 10_000, offsets, sizes, total), TICKET) is None  # no such fd
        assert attach((2 ** 22 + 7, fd, offsets, sizes, total), TICKET) is None  # no such pid
        r, w = os.pipe()  # a pipe where the file was expected: refused, without waiting
        assert attach((os.getpid(), r, offsets, sizes, total), TICKET) is None
        os.close(r), os.close(w)
    finally:
        shared.close()
    assert attach(shared.spec, TICKET) is None  # closed, and nothing else maps it


def test_make_gives_none_where_no_copy_can_be_made(buffers, monkeypatch):
    def refuse(*_):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "ftruncate", refuse)
    assert SharedCopy.make(buffers, TICKET) is None
