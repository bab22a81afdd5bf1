"""The Dask engine's worker half: the only code of :mod:`.dask` that runs inside Dask workers.

Each worker holds one :class:`Runner`, a Dask actor, through which nbdist's calls reach it;
:func:`publish` sends the worker's event batches to the notebook as Dask events.
"""

from __future__ import annotations

import asyncio
import pickle
import traceback
from typing import Any, Optional, Union

import distributed

from ...runtime import packing
from ...runtime.interrupt import forget_call, register_call
from ...telemetry.events import Batch

_worker: Optional[distributed.Worker] = None  # for event threads that are not task threads


def _invoke(header: bytes, layout: Optional[list], buffers: tuple) -> Any:
    """Run one nbdist call; register the thread running it, so that it can be interrupted."""
    tag, fn, args, kwargs = packing.unpack(header, buffers, layout)
    ident = register_call(tag)
    try:
        return fn(*args, **(kwargs or {}))
    except KeyboardInterrupt:
        # Landed in nbdist's own code rather than the cell's (which reports it as data).
        raise RuntimeError("interrupted outside the cell's code") from None
    finally:
        forget_call(ident)


def _guarded(header: bytes, layout: Optional[list], buffers: tuple) -> tuple[bool, Any]:
    """``(True, value)``, or ``(False, the error with its traceback)`` for an error in
    nbdist's own worker code (the cell's errors are data in its result)."""
    try:
        return True, _invoke(header, layout, buffers)
    except BaseException as exc:  # noqa: BLE001 - reported, never re-raised on the worker
        text = "".join(traceback.format_tb(exc.__traceback__))
        return False, f"{type(exc).__name__}: {exc}\n{text}"


class Runner:
    """The Dask actor through which nbdist's calls reach one worker.

    A Dask task travels client → scheduler → worker → scheduler → client and its result is
    fetched in one more round trip; an actor call is relayed by the scheduler once each way
    (about 2 ms for a call on each of two workers, against 9–15 ms for two tasks). The call
    runs in the worker's task thread pool, as a task would: the worker's event loop stays
    free, and Dask work the user sends to the worker waits behind a running cell as before.
    """

    def __init__(self) -> None:
        global _worker
        _worker = distributed.get_worker()

    async def call(self, header: bytes, layout: Optional[list], *buffers: Any
                   ) -> tuple[bool, Any]:
        """One call, packed (:func:`nbdist.runtime.packing.pack`): its large buffers come
        as frames of their own."""
        worker = _worker
        assert worker is not None  # set when the actor was made
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(worker.executors["default"], _guarded, header,
                                          layout, buffers)


def publish(topic: str, batch: Union[Batch, list[Batch]]) -> None:
    """Send one event batch to the notebook as a Dask event under ``topic`` (a list of them:
    one event, a node relay's, :mod:`nbdist.runtime.node_relay`)."""
    worker = _worker
    if worker is None:
        worker = distributed.get_worker()
    # Pickled, because Dask events must be msgpack-serializable and events may hold any value.
    worker.log_event(topic, pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))

