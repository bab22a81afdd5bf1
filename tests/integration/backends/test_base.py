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
