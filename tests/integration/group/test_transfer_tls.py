"""Push and pull on a Dask cluster reached over TLS (a throwaway certificate authority, as a
site's TLS setup would have): values larger than the engine-message threshold go over the
data channel as TLS, and come back equal; the shared copy with workers on this machine is
untouched by it; a worker that cannot open TLS to the channel fails the push with the words
that name its host and the channel's address. (ipyparallel has no TLS channel: its data
channel stays plain, as tests/integration/group/test_transfer.py checks on both engines.)"""

from __future__ import annotations

import logging

import pytest
import torch

distributed = pytest.importorskip("distributed")

from nbdist.errors import WorkerCallFailed  # noqa: E402
from nbdist.runtime import packing  # noqa: E402
from nbdist.session import Session  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def session():
    from distributed.security import Security

    sec = Security.temporary()
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       protocol="tls://", host="127.0.0.1", security=sec,
                                       dashboard_address="127.0.0.1:0",
                                       silence_logs=logging.WARNING)
    try:
        assert cluster.scheduler_address.startswith("tls://")
        s = Session().connect(engine="dask", address=cluster.scheduler_address,
                              security=sec, timeout=60)
        try:
            yield s
        finally:
            s.stop()
    finally:
        cluster.close()


@pytest.fixture
def streamed(session):
    """The data channel's streams, as workers on other machines use them (no shared copy)."""
    session.transfers.shared = False
    try:
        yield session.transfers.channel(session.membership)
    finally:
        session.transfers.shared = True


def tls_served(channel) -> int:
    assert set(channel.served) <= {"TLSv1.2", "TLSv1.3"}, channel.served  # never plain
    return sum(channel.served.values())


def test_push_and_pull_over_the_data_channel_travel_under_tls(session, streamed):
    channel = streamed
    assert channel is not None and channel.tls is not None
    value = torch.randn(3_000_000)  # 12 MB, over packing.CHANNEL_MIN
    assert value.numel() * 4 > packing.CHANNEL_MIN
    before = tls_served(channel)
    session.push({"sent": value})
    assert tls_served(channel) == before + 2  # each rank fetched it over TLS
    session.run_cell("import torch\nback = sent * (rank + 1)", output="quiet")
    for rank in range(2):
        got = session.pull("back", rank=rank)
        assert torch.equal(got, value * (rank + 1)), rank
    assert tls_served(channel) == before + 4  # and delivered its answer over TLS


def test_the_shared_copy_on_this_machine_opens_no_connection(session):
    channel = session.transfers.channel(session.membership)
    before = tls_served(channel)
    value = torch.arange(2_000_000.)
    session.push({"mapped": value})  # mapped by both ranks, nothing streamed
    assert tls_served(channel) == before
    assert torch.equal(session.pull("mapped", rank=1), value)
    assert tls_served(channel) == before + 1  # the pull's offer of its copy, under TLS


def test_a_worker_that_cannot_open_tls_says_where_and_what_to_check(session, streamed):
    channel = streamed
    pinned = channel.fingerprint
    channel.fingerprint = bytes(32)  # the workers expect another certificate
    try:
        with pytest.raises(WorkerCallFailed) as err:
            session.push({"refused": torch.zeros(1_000_000)})
    finally:
        channel.fingerprint = pinned
    host, port = channel.address
    text = str(err.value)
    assert f"could not open TLS to the notebook's data channel at {host}:{port}: it " \
           "presented a certificate other than the notebook's" in text, text
    assert f"Check that this host reaches {host}:{port} directly" in text
    session.push({"after": torch.ones(1_000_000)})  # the channel serves the next push
    assert repr(session.run_cell("float(after.sum())", output="quiet")) == "1000000.0"
