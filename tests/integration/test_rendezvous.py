"""The notebook's rendezvous store: bound at once, its process started later, clients wait."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest

from nbdist.rendezvous import StoreError, StoreHost
from nbdist.runtime.env import LOOPBACK

pytestmark = pytest.mark.timeout(120)


def test_a_client_that_connects_before_the_store_process_starts_waits_for_it():
    import torch.distributed as dist

    store = StoreHost(LOOPBACK, 60, spawn=False)
    try:
        assert not store.spawned and store.alive
        port = store.bound_port
        got: dict = {}

        def client() -> None:  # a worker reaching the job's store early
            c = dist.TCPStore(LOOPBACK, port, None, False, datetime.timedelta(seconds=60))
            c.set("early", b"yes")
            got["value"] = c.get("late")

        t = threading.Thread(target=client)
        t.start()
        t.join(0.5)
        assert t.is_alive()  # nothing serves yet: it waits, it does not fail
        store.spawn()
        assert store.port(60) == port and store.pid is not None
        store.set("late", b"answer")
        t.join(60)
        assert got == {"value": b"answer"} and store.get("early") == b"yes"
    finally:
        store.close()
    assert not store.alive


def test_a_store_closed_before_it_started_frees_its_port_and_refuses_use():
    store = StoreHost(LOOPBACK, 60, spawn=False)
    port = store.bound_port
    store.close()
    assert not store.alive and store.pid is None
    with pytest.raises(StoreError, match="closed"):
        store.port(5)
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect((LOOPBACK, port))
