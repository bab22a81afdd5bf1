"""Synthetic telemetry for view and fold tests: what a DDP rank would send."""

from __future__ import annotations

from nbdist.telemetry import events as ev

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
