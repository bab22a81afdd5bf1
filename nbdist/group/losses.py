"""How a worker was lost: which workers the engine still has, and a
:class:`~nbdist.telemetry.recovery.Lost` record of one that is gone (where it ran, how it ended).

The elastic coordinator asks when it finds a member gone; the cell loop asks too, for the
workers the engine lost in a cell without elastic training, so every death reaches the run's
record, and the screen, by one road.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

from ..backends.base import WorkerId
from ..runtime import fd_output, last_words
from ..telemetry.recovery import Lost

if TYPE_CHECKING:
    from .membership import Membership


def live_workers(membership: Membership, fallback: Iterable[WorkerId]) -> set[WorkerId]:
    """The workers the engine still has, less those on this host whose process is gone (the
    engine may not know yet); ``fallback`` where the engine cannot say."""
    try:
        live = set(membership.require().worker_ids())
    except Exception:  # the engine cannot say: trust only the processes we can see
        live = set(fallback)
    here = socket.gethostname()
    for w in list(live):
        host, pid = _host_pid(membership, w)
        if host == here and pid and not _pid_alive(pid):
            live.discard(w)
    return live


def lost_worker(membership: Membership, w: WorkerId, rank: Optional[int], oom_before: int,
                by: str = "nbdist.elastic") -> Lost:
    """``w``'s worker is gone: a :class:`~nbdist.telemetry.recovery.Lost` record of ``rank``
    with where it ran and how it ended, as far as the engine knows (``SIGKILL``, ``exit
    status 1``; the out-of-memory killer named where this host counted more kills than
    ``oom_before``, an :func:`oom_kills` reading from before the cell). ``by``: who found it.
    May wait about a second for the engine's answer (see ``Backend.exit_cause``)."""
    host, pid = _host_pid(membership, w)
    try:
        cause = membership.require().exit_cause(w, pid)
    except Exception:  # how it died is a detail; that it died is the news
        cause = None
    if cause == "SIGKILL" and _oom_kills() > oom_before:
        cause = "SIGKILL, by the kernel's out-of-memory killer"
    words, kept_at = _last_words(membership, w, host, pid)
    tail = words["tail"] if words else []
    line, seen = last_words.cell_line(tail), False  # a dump says where it died
    if line is None and words and words.get("line"):
        line, exact = words["line"]  # else the rank's record of its line
        seen = not exact
    lost = Lost(time.time(), rank, host, pid, cause, by, line, tuple(last_words.told(tail)),
                kept_at, seen)
    membership.deaths[w] = lost
    return lost


def _last_words(membership: Membership, w: WorkerId, host: Optional[str], pid: Optional[int]
                ) -> tuple[Optional[dict], Optional[str]]:
    """What a dead worker left (:func:`~nbdist.runtime.last_words.last_words`: its last lines
    on stderr, its record of the cell line), read and removed on this host or by the engine
    on its own (a Dask nanny); else None and where its stderr is kept."""
    if pid is None:
        return None, None
    if _here(host):
        return last_words.last_words(pid), None
    try:
        words = membership.require().last_words(w, host, pid)
    except Exception:  # the engine could not ask its host: say where the file is
        words = None
    return words, None if words is not None else f"{host}:{fd_output.paths(pid)['stderr']}"


def _here(host: Optional[str]) -> bool:
    """Whether ``host`` (a worker's hostname) is the notebook's."""
    return host == socket.gethostname()


def remove_leftovers(membership: Membership) -> None:
    """Remove the files of this job's ranks on the notebook's host whose processes are gone
    (a rank that died with no cell to notice, or between cells): ``%nbdist stop`` runs it
    once the engine stopped its workers."""
    pids = {info["pid"] for info in membership.infos.values() if _here(info["hostname"])}
    pids |= {d.pid for d in membership.deaths.values() if d.pid and _here(d.host)}
    for pid in pids:
        last_words.last_words(pid)  # a process still running keeps its files


def _host_pid(membership: Membership, w: WorkerId) -> tuple[Optional[str], Optional[int]]:
    info = membership.infos.get(w)
    return (info["hostname"], info["pid"]) if info is not None else (None, None)


def oom_kills() -> int:
    """The out-of-memory kills this host's cgroup has counted (0 where it cannot be read): a
    cell's baseline for :func:`lost_worker`, read before the cell runs."""
    return _oom_kills(fresh_s=_OOM_FRESH_S)


# A reading of the out-of-memory kill count this old serves as the next cell's baseline: a
# cell run right after another does not open the cgroup's file again before it starts.
_OOM_FRESH_S = 1.0
_oom_read: tuple[float, int] = (float("-inf"), 0)  # (monotonic time, count) of the last read


def _oom_kills(fresh_s: float = 0.0) -> int:
    """The out-of-memory kills this host's cgroup has seen (0 where it cannot be read); the
    last reading where it is under ``fresh_s`` seconds old."""
    global _oom_read
    now = time.monotonic()
    if now - _oom_read[0] < fresh_s:
        return _oom_read[1]
    count = 0
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                count = next((int(line.split()[1]) for line in f
                              if line.startswith("oom_kill ")), 0)
            break
        except (OSError, ValueError):
            continue
    _oom_read = (now, count)
    return count


def _pid_alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False
