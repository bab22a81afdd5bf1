"""Synthetic telemetry for view and fold tests: what DDP ranks would send."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from nbdist.telemetry import events as ev
from nbdist.telemetry.intervals import exposed_seconds

T0 = 1_700_000_000.0


def training_events(steps: int = 8, slow: bool = False, t0: float = T0) -> list[dict]:
    """Steps of 0.1 s with one all-reduce bucket each; a slow rank computes 0.09 s, others 0.05."""
    evs = []
    for n in range(steps):
        s0 = t0 + n * 0.1
        compute = 0.09 if slow else 0.05
        evs.append(ev.comm("all_reduce", s0 + compute, s0 + 0.1, 1000, step=n, bucket=0))
        evs.append(ev.step(n, s0, s0 + 0.1, samples=4, comm_total_s=0.1 - compute,
                           comm_exposed_s=0.1 - compute, comm_bytes=1000, buckets=1))
    return evs


def ddp_job(compute: Mapping[int, float], steps: int = 10, transfer: float = 0.002,
            bucket_bytes: Sequence[int] = (1000, 1000), skew: Optional[Mapping[int, float]] = None,
            t0: float = T0) -> dict[int, list[dict]]:
    """The events every rank of a DDP job sends, simulated from its compute time per step.

    Every rank starts a step when the previous step's last all-reduce finished (everyone
    leaves a collective together). Bucket ``b`` becomes ready after ``(b + 1) / B`` of the
    rank's compute; its all-reduce starts when the rank hands it over and finishes
    ``transfer`` seconds after the last rank handed it over (and after the bucket before it).
    ``skew`` shifts a rank's clock: the numbers must not move.
    """
    skew = skew or {}
    out: dict[int, list[dict]] = {r: [] for r in compute}
    start = t0
    nb = len(bucket_bytes)
    for n in range(steps):
        ready = {r: [start + c * (b + 1) / nb for b in range(nb)] for r, c in compute.items()}
        done, prev = [], start
        for b in range(nb):
            prev = max(max(ready[r][b] for r in compute), prev) + transfer
            done.append(prev)
        end = done[-1]
        for r, c in compute.items():
            sh = skew.get(r, 0.0)
            spans = [(ready[r][b], done[b]) for b in range(nb)]
            for b, (a, z) in enumerate(spans):
                out[r].append(ev.comm("all_reduce", a + sh, z + sh, bucket_bytes[b], step=n,
                                      bucket=b, dtype="float32"))
            out[r].append(ev.step(n, start + sh, end + sh, samples=8,
                                  comm_total_s=sum(z - a for a, z in spans),
                                  comm_exposed_s=exposed_seconds(start + c, spans),
                                  comm_bytes=sum(bucket_bytes), buckets=nb))
        start = end
    return out


def batches(rank: int, events: list[dict], per_batch: int = 7) -> list[dict]:
    return [{"rank": rank, "seq": i // per_batch + 1, "events": events[i:i + per_batch]}
            for i in range(0, len(events), per_batch)]


def job_batches(job: Mapping[int, list[dict]], per_batch: int = 7) -> list[dict]:
    return [b for r, evs in job.items() for b in batches(r, evs, per_batch)]


def aggregate_job(compute: Mapping[int, float], steps: int = 10):
    """The snapshot of :func:`ddp_job`, folded as the notebook folds it."""
    from nbdist.telemetry.aggregate import aggregate

    return aggregate(job_batches(ddp_job(compute, steps=steps)))


class Sink:
    """What the measurement model emits into, kept in memory for tests."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)

    def kinds(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]


CELL_FILE = "<distributed cell 1>"


def stack_waiting(t: float, seq: int = 5, *, reason: str = "stall", line: int = 6,
                  flight: bool = True, last_done: Optional[int] = None) -> dict:
    """A rank inside ``dist.all_reduce`` at cell ``line``, as a worker reports it: the
    group's collective ``seq`` unfinished in the Flight Recorder (``flight``) and nbdist's own
    record of the call."""
    frames = [{"file": CELL_FILE, "line": line, "name": "<module>", "cell": True,
               "code": "dist.all_reduce(t)", "call": "dist.all_reduce(t)"},
              {"file": "/x/torch/distributed/distributed_c10d.py", "line": 3252,
               "name": "torch.distributed.distributed_c10d.all_reduce", "cell": False,
               "code": "work.wait()", "call": "work.wait()"}]
    fr = None
    if flight:
        fr = [{"group": "default_pg", "op": "all_reduce", "seq": s, "sizes": [[4]],
               "dtypes": ["Float"], "state": "scheduled", "done": True, "p2p": False}
              for s in ([last_done] if last_done else [])]
        fr.append({"group": "default_pg", "op": "all_reduce", "seq": seq, "sizes": [[4]],
                   "dtypes": ["Float"], "state": "scheduled", "done": False, "p2p": False})
    return ev.stack(t, reason, 1.0, frames,
                    collective={"op": "all_reduce", "seq": 1, "bytes": 16, "dtype": "float32",
                                "since": t - 1},
                    flight=fr, calls={"all_reduce": 1})


def stack_sleeping(t: float, *, reason: str = "stall", line: int = 5,
                   flight: Optional[list] = None, calls: Optional[dict] = None) -> dict:
    """A rank in ``time.sleep(0.05)`` at cell ``line``, not inside any collective."""
    frames = [{"file": CELL_FILE, "line": line, "name": "<module>", "cell": True,
               "code": "time.sleep(0.05)", "call": "time.sleep(0.05)"}]
    return ev.stack(t, reason, 1.0, frames, flight=flight, calls=calls)
