"""The notebook's handle on the job's rendezvous store (:mod:`nbdist.boot.store_host`), on a
real store process: what the notebook writes, a worker's ``TCPStore`` client reads, and back;
a second store for a script; a bad request answered without ending the store; the process
gone after close."""

from __future__ import annotations

import datetime

import pytest

from nbdist.boot.store_host import StoreError, StoreHost

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def host():
    h = StoreHost("127.0.0.1", timeout=30)
    try:
        yield h
    finally:
        h.close()


def client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))


def test_the_notebook_and_a_workers_client_see_one_store(host):
    worker = client(host.port())
    assert host.get("plan/1") is None  # not set yet: None at once, no wait on the key
    host.set("plan/1", b"\x00rank 1\xff")
    assert worker.get("plan/1") == b"\x00rank 1\xff"  # bytes as they were, base64 on the pipe
    worker.set("arrived/0", b"yes")
    assert host.get("arrived/0") == b"yes"
    assert host.add("joined") == 1 and worker.add("joined", 2) == 3 and host.add("joined", 0) == 3


def test_a_second_store_opens_and_closes_beside_the_jobs(host):
    port = host.open("script-7")
    assert port != host.port()
    script = client(port)
    script.set("k", b"v")
    assert script.get("k") == b"v" and host.get("k") is None  # a store of its own
    host.close_store("script-7")


def test_a_bad_request_is_an_error_and_the_store_goes_on(host):
    with pytest.raises(StoreError, match="rendezvous store"):
        host.add("joined", n="many")  # the store process cannot read the count
    host.set("still", b"here")
    assert host.get("still") == b"here" and host.alive


def test_closing_ends_the_process():
    import psutil

    h = StoreHost("127.0.0.1", timeout=30)
    h.port()
    proc = psutil.Process(h.pid)
    h.close()  # end of its input: the process closes the store and exits
    assert not h.alive and not proc.is_running()
    with pytest.raises(StoreError, match="process is gone"):  # said as the store's error
        h.set("late", b"x")
