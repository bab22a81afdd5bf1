"""Filters on Dask's loggers for lines about events nbdist reports itself."""

from __future__ import annotations

import logging


class _RelayErrors(logging.Filter):
    """Drops the scheduler's log line for a call it could not relay because the worker's
    connection closed: nbdist reports that worker's loss itself, with its rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("broadcast to ") and "CommClosedError" in msg)


def not_restart_lines(record: logging.LogRecord) -> bool:
    """A log filter: False for a nanny's warnings about a restart nbdist asked for."""
    return not record.getMessage().startswith(("Worker process still alive after",
                                               "Restarting worker"))


def quiet_relay_errors() -> None:
    """Install :class:`_RelayErrors` on the scheduler's logger of this process, once (the
    scheduler of a cluster nbdist starts here runs in this process)."""
    log = logging.getLogger("distributed.scheduler")
    if not any(isinstance(f, _RelayErrors) for f in log.filters):
        log.addFilter(_RelayErrors())
