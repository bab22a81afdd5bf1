"""What a worker's entry point returns to the notebook: the one typed contract between them.

Stdlib only, imported on both sides. Results stay plain dicts on the wire (pickled by the
engine); the ``TypedDict`` classes document their keys and the constructors below are the only
places that build them, as :mod:`nbdist.telemetry.events` does for events.

The worker holds the exception object, so it alone decides whether a failure was in
communication (a collective, the process group) or in the user's code: see :func:`error_info`.
The notebook trusts the flags it sets.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any, Optional, TypedDict

# Text of a failure caused by a *peer* dying or closing the group under this rank.
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote process exited|"
    r"ProcessGroup.*(aborted|destroyed)|Broken pipe|NCCL communicator was aborted",
    re.IGNORECASE,
)
# Text of any communication failure: the above, a collective timing out, a group that is gone.
_COMM = re.compile(_PEER_LOSS.pattern + r"|gloo|nccl|timed out|process ?group|transport",
                   re.IGNORECASE)
# torch's own frames; only an error raised there can be a communication failure.
_TORCH_DIR = os.sep + "torch" + os.sep


class ErrorInfo(TypedDict):
    """One rank's error, formatted on the worker."""

    ename: str  # exception class name
    evalue: str  # str(exception)
    traceback: str  # formatted, from the cell's first frame on
    line: Optional[int]  # the cell's line of the innermost cell frame
    communication: bool  # failed in a collective or the group, not in the cell's own code
    caused_by_peer: bool  # ... because a peer died or closed the group (a consequence)
    timestamp: Optional[float]  # when it was recorded (a script's @record error file), else None


class CellResult(TypedDict, total=False):
    """What ``run_cell`` and ``run_script`` return for one rank."""

    ok: bool
    value: Optional[dict[str, Any]]  # rich display bundle of the last expression (cells)
    error: Optional[ErrorInfo]  # when not ok (scripts: None, see returncode)
    seconds: float
    group_alive: bool  # False: this rank's process group is gone; the next full cell re-forms it
    seq: int  # last event batch the call sent on the event channel (0: none to wait for)
    tail: dict[str, Any]  # the call's last event batch, carried here instead (absent: none)
    returncode: Optional[int]  # scripts: the child's exit status
    interrupted: bool  # scripts: stopped by an interrupt or timeout
    elastic_gen: Optional[int]  # the generation an elastic run re-formed the group at, if any
    rank: int  # this worker's rank when the call returned (elastic runs renumber ranks)
    not_joined: str  # a replacement worker the elastic run did not let in: why (absent: it was)


class Address(TypedDict):
    """One IPv4 address of a worker's host."""

    ip: str
    prefix: int  # network prefix length
    iface: str


class _Described(TypedDict):
    hostname: str
    pid: int
    cpu_count: int  # cores this process may run on
    gpu_count: int  # 0 when asked without GPUs (the notebook's own description)
    addresses: list[Address]
    route_ip: Optional[str]  # the address the host routes towards the controller
    python: str  # sys.executable


class WorkerInfo(_Described, total=False):
    """What ``describe`` says about a worker's host, for planning ranks and the store."""

    worker_id: Any  # the engine's id of the worker, added by the notebook


class WorkerStatus(TypedDict):
    """What ``status`` reports: one row of ``%nbdist status``."""

    rank: Optional[int]  # None: the worker has not joined the job
    hostname: str
    pid: int
    device: Optional[str]
    group: bool  # its process group is formed
    rss: Optional[int]  # resident memory in bytes (None without psutil)


class Joined(TypedDict, total=False):
    """What ``join`` reports once a worker took its rank."""

    rank: int
    device: str
    backend: str  # the process group's backend (gloo, nccl)
    threads: int
    group_s: float  # forming the group took this long
    warm_s: float  # and warming DDP up this long


class PullResult(TypedDict, total=False):
    """Whether ``pull`` found the object (it follows, packed), or why not; ``channel``: its
    buffers went over the notebook's data channel."""

    ok: bool
    evalue: str
    channel: bool


def is_communication_failure(exc: BaseException) -> bool:
    """True when ``exc`` was raised by torch while communicating, never by the user's code.

    Both must hold: torch raised it (its innermost frame is in torch, or it is one of
    torch.distributed's own error types), and its text names a collective, a transport or the
    group. A cell's own ``raise TimeoutError("timed out")`` is therefore a code error.
    """
    if _is_dist_error(exc):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    from_torch = bool(frames) and _TORCH_DIR in frames[-1].filename
    return from_torch and bool(_COMM.search(f"{type(exc).__name__}: {exc}"))


def _is_dist_error(exc: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")  # loaded already if torch can have raised it
    dist_error = getattr(dist, "DistError", None)
    return dist_error is not None and isinstance(exc, dist_error)


def error_info(exc: BaseException, filename: str, *, communication: Optional[bool] = None,
               evalue: Optional[str] = None) -> ErrorInfo:
    """Describe ``exc`` for the notebook, keeping only frames from the cell ``filename`` on.

    ``communication`` overrides the classification (e.g. an interrupt that cut this rank out
    of a collective); ``evalue`` replaces the message.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError):
        lines = traceback.format_exception(type(exc), exc, None)
    elif tb is None:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    else:
        lines = traceback.format_exception(type(exc), exc, tb)
    line = None
    walk = tb
    while walk is not None:
        if walk.tb_frame.f_code.co_filename == filename:
            line = walk.tb_lineno
        walk = walk.tb_next
    comm = is_communication_failure(exc) if communication is None else communication
    text = str(exc) if evalue is None else evalue
    # An error raised because a peer ended the run (elastic training stopping every rank for
    # one rank's error) says so itself.
    by_peer = bool(getattr(exc, "caused_by_peer", False)) or (comm and bool(_PEER_LOSS.search(
        f"{type(exc).__name__}: {exc}")))
    return ErrorInfo(ename=type(exc).__name__, evalue=text, traceback="".join(lines), line=line,
                     communication=comm, caused_by_peer=by_peer, timestamp=None)


def plain_error(ename: str, evalue: str, traceback_text: str = "", *,
                communication: bool = False, timestamp: Optional[float] = None) -> ErrorInfo:
    """An error that is not a Python exception on the worker (no rank, engine failure, a
    script's recorded error)."""
    return ErrorInfo(ename=ename, evalue=evalue, traceback=traceback_text, line=None,
                     communication=communication, caused_by_peer=False, timestamp=timestamp)


def cell_ok(value: Optional[dict[str, Any]] = None) -> CellResult:
    """A cell that ran; ``seconds``, ``group_alive`` and ``seq`` are added by :func:`finish`."""
    return CellResult(ok=True, value=value, error=None)


def cell_failed(error: ErrorInfo, *, group_alive: Optional[bool] = None,
                seq: Optional[int] = None) -> CellResult:
    """A cell (or nbdist's preparation for it) that failed on this rank."""
    out = CellResult(ok=False, value=None, error=error)
    if group_alive is not None:
        out["group_alive"] = group_alive
    if seq is not None:
        out["seq"] = seq
    return out


def finish(result: CellResult, *, seconds: float, group_alive: bool, seq: int,
           tail: Optional[dict[str, Any]] = None) -> CellResult:
    """Add what every finished call reports: its duration, the group's state, the last batch
    it sent (``seq``) and the one it carries (``tail``)."""
    result["seconds"] = seconds
    result["group_alive"] = group_alive
    result["seq"] = seq
    if tail is not None:
        result["tail"] = tail
    return result


def script_result(returncode: int, interrupted: bool, seq: int) -> CellResult:
    """A ``%nbdist run`` script's exit on this rank."""
    return CellResult(ok=returncode == 0 and not interrupted, value=None, error=None,
                      returncode=returncode, interrupted=interrupted, seq=seq,
                      group_alive=True)


def not_joined(why: str, seq: int) -> CellResult:
    """A replacement worker's call that ended without joining the elastic run (``why``)."""
    out = finish(cell_ok(), seconds=0.0, group_alive=False, seq=seq)
    out["not_joined"] = why
    return out


def engine_failure(text: str) -> CellResult:
    """The engine itself failed the call (the worker died, or an nbdist bug): the group is lost."""
    first = text.splitlines()[0] if text else "the engine gave no reason"
    return cell_failed(plain_error("WorkerError", first, text), group_alive=False)


def pulled(channel: bool = False) -> PullResult:
    return PullResult(ok=True, channel=channel)


def not_pulled(reason: str) -> PullResult:
    return PullResult(ok=False, evalue=reason)
