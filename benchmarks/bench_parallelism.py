"""Model parallelism and asynchronous training vs. DDP: samples/s as ratios, in one run.

The same MLP (784-512-512-512-10, Adam, 1 torch thread per rank) trains on the same 2 warm
workers five ways, each a named ``%%distributed`` run, in rounds that rotate the order:

* ``ddp``: DistributedDataParallel, batch 64 per rank;
* ``pipeline``: two stages (two linear layers each), ScheduleGPipe, one batch of 128 in 4
  microbatches;
* ``tensor-parallel``: parallelize_module with ColwiseParallel / RowwiseParallel pairs on a
  1-D mesh, one batch of 128;
* ``parameter-server``: nbdist.ParameterServer, batch 64 per rank, both ranks for the same
  wall time;
* ``local-sgd``: DDP with post_localSGD_hook and PostLocalSGDOptimizer averaging every 4
  steps, batch 64 per rank.

Every run processes 128 samples per step of the job. Samples/s is the median over rounds of
each run's own timing (wall clock around the timed steps). A second part slows rank 1 by 2x
(before each step it sleeps as long as a training step computes on it alone) and compares the
parameter server with DDP under the same slow rank: DDP runs at the slow rank's pace, the
parameter server does not.

    python benchmarks/bench_parallelism.py [--steps 60] [--rounds 3] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

try:
    from benchmarks import _common as c
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _common as c  # type: ignore[no-redef]

SETUP = """
import time, torch, nbdist, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState, post_localSGD_hook)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

BATCH = 64  # per rank; the model-parallel runs take one batch of BATCH * world_size
LOSS = torch.nn.functional.cross_entropy

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))

def data(size, shared):
    g = torch.Generator().manual_seed(0 if shared else rank)
    return [(torch.randn(size, 784, generator=g), torch.randint(0, 10, (size,), generator=g))
            for _ in range(8)]

def compute_s(steps=10):
    # one training step's computation on one rank, alone (forward, backward, optimizer
    # step): the slow rank sleeps this long per step, so it computes at half speed
    m, (x, y) = make(), data(BATCH, False)[0]
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(); LOSS(m(x), y).backward(); opt.step()
    return (time.perf_counter() - t0) / steps

def slow(delay):
    if delay and rank == 1:
        time.sleep(delay)

def timed(step, steps, warmup, samples_per_step):
    for k in range(warmup + steps):
        if k == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        step(k)
    return {"samples_per_s": samples_per_step * steps / (time.perf_counter() - t0)}

def run_ddp(steps, warmup, delay=0.0, local_sgd=False):
    m = DDP(make())
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    if local_sgd:
        own, _ = dist.new_subgroups(group_size=1)
        m.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=own,
                                               start_localSGD_iter=warmup,
                                               post_local_gradient_allreduce=False),
                             post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=opt, averager=PeriodicModelAverager(
            period=4, warmup_steps=warmup))
    batches = data(BATCH, False)
    def step(k):
        slow(delay)
        x, y = batches[k % len(batches)]
        loss = LOSS(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    return timed(step, steps, warmup, BATCH * world_size)

def run_pipeline(steps, warmup):
    part = make()[:4] if rank == 0 else make()[4:]
    sched = ScheduleGPipe(PipelineStage(part, rank, world_size, device), n_microbatches=4,
                          loss_fn=LOSS)
    opt = torch.optim.Adam(part.parameters(), lr=1e-3)
    batches = data(BATCH * world_size, True)
    def step(k):
        x, y = batches[k % len(batches)]
        opt.zero_grad()
        sched.step(x) if rank == 0 else sched.step(target=y)
        opt.step()
    return timed(step, steps, warmup, BATCH * world_size)

def run_tp(steps, warmup):
    m = parallelize_module(make(), nbdist.mesh(tp=world_size),
                           {"0": ColwiseParallel(), "2": RowwiseParallel(),
                            "4": ColwiseParallel(), "6": RowwiseParallel()})
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    batches = data(BATCH * world_size, True)
    def step(k):
        x, y = batches[k % len(batches)]
        loss = LOSS(m(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    return timed(step, steps, warmup, BATCH * world_size)

def run_ps(seconds, warmup, delay=0.0):
    # each rank trains for the same wall time; the job's samples/s is the sum over ranks
    m = make()
    ps = nbdist.ParameterServer(m, torch.optim.Adam(m.parameters(), lr=1e-3))
    batches = data(BATCH, False)
    def step(k):
        slow(delay)
        x, y = batches[k % len(batches)]
        ps.pull(m)
        loss = LOSS(m(x), y)
        m.zero_grad(); loss.backward()
        ps.push(m)
    for k in range(warmup):
        step(k)
    dist.barrier()
    t0 = time.perf_counter()
    k = 0
    while time.perf_counter() - t0 < seconds:
        step(k)
        k += 1
    rate = BATCH * k / (time.perf_counter() - t0)
    dist.barrier()
    ps.wait()
    ps.close()
    rates = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(rates, torch.tensor([rate]))
    return {"samples_per_s": float(sum(rates)), "per_rank": [float(r) for r in rates]}
"""

RUNS = {
    "ddp": "run_ddp({steps}, {warmup})",
    "pipeline": "run_pipeline({steps}, {warmup})",
    "tensor-parallel": "run_tp({steps}, {warmup})",
    "parameter-server": "run_ps({seconds}, {warmup})",
    "local-sgd": "run_ddp({steps}, {warmup}, local_sgd=True)",
}
SLOW = {
    "ddp, rank 1 slowed 2x": "run_ddp({steps}, {warmup}, delay={delay})",
    "parameter-server, rank 1 slowed 2x": "run_ps({seconds}, {warmup}, delay={delay})",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="wall time of each parameter-server run")
    ap.add_argument("--engine", default="ipyparallel")
    ap.add_argument("--timeout", type=float, default=1200)
    args = c.parse_args(ap, argv)

    sys.path.insert(0, c.REPO)
    from nbdist.session import Session

    speed: dict[str, list[float]] = {k: [] for k in (*RUNS, *SLOW)}
    per_rank: dict[str, list[list[float]]] = {}
    fmt = {"steps": args.steps, "warmup": args.warmup, "seconds": args.seconds}
    with c.deadline(args.timeout):
        s = Session().start(2, engine=args.engine, threads=1, timeout=120)
        try:
            s.run_cell(SETUP, output="quiet")
            s.run_cell("run_ddp(2, 1); run_pipeline(2, 1); run_tp(2, 1)", output="quiet",
                       telemetry=False)  # first-use costs
            s.run_cell("_delay = compute_s()", output="quiet")
            fmt["delay"] = round(s.pull("_delay", rank=1), 6)
            names = list(RUNS)
            for k in range(args.rounds):
                order = names[k % len(names):] + names[:k % len(names)]
                for name in order:
                    s.run_cell(f"_bench = {RUNS[name].format(**fmt)}", output="quiet",
                               name=name)
                    speed[name].append(s.pull("_bench")["samples_per_s"])
                for name, code in SLOW.items():
                    s.run_cell(f"_bench = {code.format(**fmt)}", output="quiet", name=name)
                    got = s.pull("_bench")
                    speed[name].append(got["samples_per_s"])
                    if "per_rank" in got:
                        per_rank.setdefault(name, []).append(got["per_rank"])
                c.log(f"round {k + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {speed[n][-1]:.0f}" for n in speed))
            figures = {f.name: f for f in s.compare().runs}
        finally:
            s.stop()

    base = statistics.median(speed["ddp"])
    out: dict[str, Any] = {"benchmark": "parallelism", "engine": args.engine, "workers": 2,
                           "steps": args.steps, "rounds": args.rounds,
                           "slow_rank_delay_s": fmt["delay"], "machine": c.machine()}
    rows = []
    for name in RUNS:
        med = statistics.median(speed[name])
        f = figures[name]
        rows.append([name, med, c.ratio(med, base),
                     f"{min(speed[name]) / base:.2f}-{max(speed[name]) / base:.2f}",
                     (f.bytes_per_step or 0) / 1e6, (f.params or 0) / 1e6,
                     "-" if f.bubble is None else f"{f.bubble:.0%}"])
        out[name] = {"samples_per_s": med, "vs_ddp": med / base,
                     "comm_mb_per_step": (f.bytes_per_step or 0) / 1e6,
                     "params_mb_per_rank": (f.params or 0) / 1e6, "bubble": f.bubble}
    print(c.table(["run", "median samples/s", "vs DDP", "spread", "comm MB/step",
                   "params MB/rank", "bubble"], rows))
    ddp_slow, ps_slow = (statistics.median(speed[n]) for n in SLOW)
    ranks = [statistics.median(r[i] for r in per_rank[list(SLOW)[1]]) for i in (0, 1)]
    print(f"\nrank 1 slowed 2x (sleeps {fmt['delay'] * 1e3:.1f} ms per step):")
    print(c.table(["run", "median samples/s", "vs DDP with the same slow rank"],
                  [["ddp", ddp_slow, "1.00x"],
                   ["parameter-server", ps_slow, c.ratio(ps_slow, ddp_slow)]]))
    print(f"parameter server per rank: rank 0 {ranks[0]:.0f}, rank 1 {ranks[1]:.0f} samples/s")
    print("samples/s ratio to DDP: " + ", ".join(
        f"{name} {out[name]['vs_ddp']:.2f}x" for name in RUNS if name != "ddp"))
    print(f"samples/s ratio parameter-server / DDP, rank 1 slowed 2x: {ps_slow / ddp_slow:.2f}x "
          "(async should win: > 1)")
    out["slow"] = {"ddp": ddp_slow, "parameter_server": ps_slow,
                   "ps_vs_ddp": ps_slow / ddp_slow, "ps_per_rank": ranks}
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
