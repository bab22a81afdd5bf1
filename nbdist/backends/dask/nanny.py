"""What nbdist asks of a Dask worker's nanny, the process beside each worker: send the worker
a signal from outside (``%nbdist kill``), and read what a dead worker left on its host (its
last lines on stderr, its record of the cell line) for the notebook on another host.
:func:`signal_process`, :func:`signal_soon` and
:func:`~nbdist.runtime.last_words.last_words` run on the nanny or the worker."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import distributed

from ...errors import ClusterError
from ...runtime import last_words
from ..base import poll_until

#: seconds to wait for a host's nanny or worker to answer for a dead worker's files (its
#: nanny is reachable once the worker it started afresh has joined)
WORDS_WAIT = 3.0


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



def dead_words(client: distributed.Client, host: Optional[str], pid: int,
               wait: float = WORDS_WAIT) -> Optional[dict]:
    """What dead worker process ``pid`` left on ``host``, read and removed there by a nanny
    (or else a worker) on that host; None where none answered within ``wait`` seconds."""

    def ask() -> Optional[dict]:
        for nanny in (True, False):  # a nanny first: it outlives its worker
            try:
                out = client.sync(client._run, last_words.last_words, pid, host, nanny=nanny,
                                  on_error="return", callback_timeout=wait)
            except Exception:
                continue
            for words in out.values():
                if isinstance(words, dict):
                    return words
        return None

    try:
        return poll_until(ask, wait, interval=0.2)
    except Exception:
        return None
