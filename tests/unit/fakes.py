"""A scripted in-memory backend: the Session's coordination tested without processes.

``ScriptedBackend`` answers nbdist's own calls (describe, join, ...) with canned values and each
rank's ``run_cell`` with a :class:`Scripted` outcome: a result or an engine error, the event
batches it sends (some only after the outcome is in), or a hang until interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from nbdist.backends.base import Backend, Call, Outcome, Submission, WorkerGone, WorkerId
from nbdist.runtime import results
from nbdist.telemetry.events import Batch


@dataclass
class Scripted:
    """What one rank does with one cell."""

    result: Optional[results.CellResult] = None  # default: ok (hung: interrupted), nothing sent
    engine_error: Optional[str] = None  # the engine failed the call (the worker died)
    batches: list[Batch] = field(default_factory=list)  # drained while the call runs
    late: list[Batch] = field(default_factory=list)  # drained only after the outcome is in
    hang: bool = False  # runs until interrupted
    ignores_interrupt: bool = False  # ... and even then (stuck in native code)
    until: Optional[Callable[[], bool]] = None  # runs until this is true (an answer came)


def ok(value: Optional[dict] = None, *, seq: int = 0, group_alive: bool = True
       ) -> results.CellResult:
    return results.finish(results.cell_ok(value), seconds=0.01, group_alive=group_alive,
                          seq=seq)


def failed(ename: str, evalue: str, *, line: Optional[int] = 1, communication: bool = False,
           caused_by_peer: bool = False, group_alive: bool = True, seq: int = 0
           ) -> results.CellResult:
    err = results.ErrorInfo(ename=ename, evalue=evalue, line=line,
                            traceback=f"Traceback (most recent call last):\n{ename}: {evalue}\n",
                            communication=communication, caused_by_peer=caused_by_peer,
                            timestamp=None)
    return results.finish(results.cell_failed(err), seconds=0.01, group_alive=group_alive,
                          seq=seq)


class ScriptedSubmission(Submission):
    def __init__(self, backend: ScriptedBackend, plan: list[tuple[WorkerId, Any, Scripted]]):
        self._backend = backend
        self._plan = plan
        self._live = [b for _, _, s in plan for b in s.batches]
        self._late = [b for _, _, s in plan for b in s.late]
        self.drains_after_done = 0

    def _hung(self) -> list[WorkerId]:
        b = self._backend
        return [w for w, _, s in self._plan
                if ((s.hang and (w not in b.interrupted or s.ignores_interrupt))
                    or (s.until is not None and not s.until() and w not in b.interrupted))
                and w not in b.restarted]

    def wait(self, timeout: Optional[float]) -> bool:
        if not self._hung():
            return True
        time.sleep(min(timeout or 0.0, 0.01))  # a hung call: let the caller's clock move
        return not self._hung()

    def pending(self) -> list[WorkerId]:
        return self._hung()

    def outcomes(self) -> list[Outcome]:
        out = []
        for w, value, s in self._plan:
            if w in self._backend.restarted:
                out.append(Outcome(w, engine_error=f"worker {w}: the worker left the cluster"))
            elif s.engine_error is not None:
                out.append(Outcome(w, engine_error=s.engine_error))
            elif s.hang:  # what it returns once interrupted (by default, no batch of its own)
                out.append(Outcome(w, value=s.result or failed("KeyboardInterrupt", "",
                                                               line=None)))
            else:
                out.append(Outcome(w, value=value))
        return out

    def drain_events(self) -> list[Batch]:
        batches, self._live = self._live, []
        if not self._hung():
            self.drains_after_done += 1
            if self.drains_after_done >= 3 and self._late:  # arrives well after the outcome
                batches, self._late = batches + self._late, []
        return batches


class ScriptedBackend(Backend):
    """``n`` in-memory workers on one host; ``cells`` scripts each rank's next ``run_cell``."""

    name = "scripted"

    def __init__(self, n: int = 2, hostname: str = "hostA") -> None:
        self.ids = list(range(100, 100 + n))  # not the ranks: the Session must map them
        self.hostname = hostname
        self.cells: dict[int, Scripted] = {}  # worker id -> what its next run_cell does
        self.failures: dict[int, dict] = {}  # worker id -> the failure it keeps (%nbdist debug)
        self.signals: list[tuple[Any, int, Any]] = []  # (worker, signal, pid) sent
        self.interrupted: set[WorkerId] = set()
        self.calls: list[str] = []
        self.submitted: list[Call] = []
        self.jobs: list[ScriptedSubmission] = []
        self.gpus = 0  # GPUs each worker's describe() reports
        self.can_restart_workers = False  # True: restart_workers replaces a worker's process
        self.restarted: list[WorkerId] = []  # old ids, in the order restarted
        self.no_nanny: set[WorkerId] = set()  # restart_workers only stops these
        self.names: dict[WorkerId, list[str]] = {}  # what run_beside(defined_names) answers
        self.imports: dict[WorkerId, list] = {}  # namespace_held's imports, beside names
        self.not_importable: set[str] = set()  # names whose restore_imports fails

    def script(self, **by_rank: Scripted) -> None:
        """Script the next cell: ``script(r0=Scripted(...), r1=...)`` (worker of rank i is
        the i-th worker id, as the Session plans ranks on one host)."""
        for key, s in by_rank.items():
            self.cells[self.ids[int(key[1:])]] = s

    # what an adapter provides
    def _start(self, n: int, timeout: float) -> None:
        self.client = self
        self.cluster = self
        self.controller_ip = "127.0.0.1"

    def connect(self, timeout: float, **target: Any) -> None:
        self.client = self
        self.owns_cluster = False

    def worker_ids(self) -> list[WorkerId]:
        return list(self.ids)

    def submit(self, calls: Sequence[Call]) -> ScriptedSubmission:
        gone = [c.worker for c in calls if c.worker not in self.ids]
        if gone:
            raise WorkerGone(gone)
        plan = []
        for c in calls:
            name = getattr(c.fn, "__name__", "?")
            self.calls.append(name)
            self.submitted.append(c)
            if name in ("run_cell", "post_mortem"):
                s = self.cells.pop(c.worker, Scripted())
                plan.append((c.worker, s.result or ok(), s))
            else:
                plan.append((c.worker, self._answer(name, c), Scripted()))
        self.interrupted.clear()
        job = ScriptedSubmission(self, plan)
        self.jobs.append(job)
        return job

    def _answer(self, name: str, c: Call) -> Any:
        answers: dict[str, Callable[[], Any]] = {
            "describe": lambda: {"hostname": self.hostname, "pid": c.worker, "cpu_count": 2,
                                 "gpu_count": self.gpus, "addresses": [],
                                 "route_ip": "127.0.0.1"},
            "open_store": lambda: 29500,
            "defined_names": lambda: self.names.get(c.worker, []),
            "join": lambda: {"rank": c.args[0].rank, "device": "cpu", "backend": "gloo",
                             "threads": 1},
            "status": lambda: {"rank": None, "hostname": self.hostname, "pid": c.worker,
                               "device": "cpu", "group": True, "rss": 2**20},
            "failure": lambda: self.failures.get(c.worker),
            "restore_imports": lambda: {i[0]: "ModuleNotFoundError: gone" for i in c.args[0]
                                        if i[0] in self.not_importable},
        }
        return answers.get(name, lambda: None)()

    def interrupt(self, workers: Sequence[WorkerId]) -> None:
        self.interrupted.update(workers)

    def signal(self, worker: WorkerId, signum: int, pid: Any = None) -> None:
        self.signals.append((worker, signum, pid))

    def restart_workers(self, ids: Sequence[WorkerId], timeout: float) -> list[WorkerId]:
        """A fresh worker (id + 1000) in each one's place; without a nanny, none."""
        self.calls.append("restart_workers")
        replaced = []
        for w in ids:
            self.restarted.append(w)
            i = self.ids.index(w)
            if w in self.no_nanny:
                self.ids.pop(i)
            else:
                self.ids[i] = w + 1000
                replaced.append(w)
        return replaced

    def run_beside(self, workers: Sequence[WorkerId], fn: Callable[..., Any], *args: Any
                   ) -> dict[WorkerId, Any]:
        if getattr(fn, "__name__", "") == "namespace_held":
            return {w: {"names": self.names[w], "imports": self.imports.get(w, [])}
                    for w in workers if w in self.names}
        return {w: self.names[w] for w in workers if w in self.names}

    def transport(self) -> Callable[[Batch], None]:
        return print

    def _close_client(self, client: Any) -> None:
        pass

    def _close_cluster(self, cluster: Any) -> None:
        pass


class FakeStore:
    """The notebook's store process, as the session writes to it (``set``), in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value
