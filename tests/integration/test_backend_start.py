"""A real engine start that cannot finish in time: the error says so and nothing is left."""

from __future__ import annotations

import pytest

from nbdist.errors import WorkersDidNotStart


@pytest.mark.timeout(120)
def test_a_real_start_that_times_out_raises_workers_did_not_start():
    from nbdist.backends import get_backend

    b = get_backend("ipyparallel")
    with pytest.raises(WorkersDidNotStart) as info:
        b.start(2, 0.01)  # engines take longer than 10 ms to register
    assert info.value.wanted == 2 and info.value.ready < 2
    assert isinstance(info.value.__cause__, TimeoutError)
    assert b.cluster is None and b.client is None  # stopped: the suite checks no process is left


@pytest.mark.timeout(120)
def test_each_engines_nanny_starts_with_it_and_reports_its_death_at_once():
    """The nanny (started at engine start-up, not after registration) relays what
    ipyparallel's does: a killed engine leaves the client's ids well within the heart beat's
    10 s tolerance, because its nanny tells the controller."""
    import os
    import signal
    import time

    import psutil

    from nbdist.backends import get_backend

    b = get_backend("ipyparallel")
    b.start(2, 60)
    try:
        pids = {e: b.client[e].apply_sync(os.getpid) for e in b.worker_ids()}
        for pid in pids.values():
            kids = [" ".join(k.cmdline()) for k in psutil.Process(pid).children()]
            assert any("-m nbdist.runtime.nanny" in k for k in kids), kids
        victim, pid = next(iter(pids.items()))
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while victim in b.worker_ids() and time.monotonic() - t0 < 30:
            time.sleep(0.05)  # the controller's unregistration reaches the client's ids
        assert victim not in b.worker_ids()
        assert time.monotonic() - t0 < 5, "unregistered by the heart beat, not the nanny"
    finally:
        b.stop()
