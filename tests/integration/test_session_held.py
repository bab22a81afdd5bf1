"""What the notebook keeps across cells, on real clusters of both engines: a tensor pushed
again and again holds one copy, chatty cells leave no replies behind in the engine's client,
and ``stop`` lets go of everything."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
from clusters import ENGINES, start_session

pytestmark = pytest.mark.timeout(300)

CHATTY = "for i in range(500):\n    print('line', i, 'x' * 60)\n"


def client_caches(session, timeout: float = 10.0) -> int:
    """Replies ipyparallel's client still keeps (results, metadata, futures) once every reply
    it waits for has come; 0 on Dask. A cell returns with its ranks' replies, and the client
    purges a request's entries on its IO thread when the engine's idle status follows: on a
    busy machine that can be a moment later (a purge still due is not a leak; an entry with
    nothing pending is)."""
    client = session.membership.backend.client
    if session.membership.backend.name != "ipyparallel":
        return 0
    deadline = time.monotonic() + timeout
    while client._futures and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(client.results) + len(client.metadata) + len(client._futures)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_long_session_keeps_one_push_copy_and_no_replies(engine):
    import torch

    s = start_session(engine)
    try:
        sink = io.StringIO()
        for k in range(4):
            s.push({"data": torch.full((2**18,), float(k))})  # 1 MiB each time
            with contextlib.redirect_stdout(sink):
                s.run_cell(CHATTY)
            s.run_cell("total = float(data.sum())")
        assert s.pull("total") == 3.0 * 2**18  # the workers have the last value
        held = s.held()
        assert held.pushes == 4 and 2**20 <= held.push_bytes < 2 * 2**20  # one copy, not 4
        before = client_caches(s)
        for _ in range(10):
            with contextlib.redirect_stdout(sink):
                s.run_cell(CHATTY)
        assert client_caches(s) <= before  # ten more cells leave nothing behind
        assert "notebook holds: history 18 of 5000 cells, 4 pushes / push copies 1.0 MiB" \
            in repr(s.status())
    finally:
        s.stop()
    held = s.held()
    assert (held.cells, held.pushes, held.push_bytes, held.runs, held.named) == (0, 0, 0, 0, 0)
