"""What nbdist asks of a Dask worker's nanny, the process beside each worker: send the worker
a signal from outside (``%nbdist kill``). :func:`signal_process` and :func:`signal_soon` run
on the nanny or the worker."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import distributed

from ...errors import ClusterError


def signal_worker(client: distributed.Client, worker: Any, has_nanny: bool, signum: int,
                  pid: Optional[int]) -> None:
    """Send ``signum`` to ``worker``'s process (``pid``, as the worker reported it) while it
    may be busy with a cell: through its nanny, or else its own event loop."""
    try:
        if has_nanny and pid is not None:
            client.run(signal_process, pid, signum, workers=[worker], nanny=True)
        else:  # the worker's event loop, beside the busy thread, signals its own process
            client.run(signal_soon, signum, workers=[worker])
    except Exception as exc:
        raise ClusterError(f"could not signal Dask worker {worker}: "
                           f"{type(exc).__name__}: {exc}") from exc


def signal_process(pid: int, signum: int) -> None:
    """On a worker's nanny: send ``signum`` to the worker process ``pid``."""
    os.kill(pid, signum)


def signal_soon(signum: int) -> None:
    """On a worker without a nanny, on its event loop: send ``signum`` to this process once
    the call has returned (a SIGKILL sent at once would leave the caller without an answer)."""
    threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()

