"""Elastic training: what ``state.commit()`` costs, and how fast a lost rank is recovered.

    python benchmarks/bench_elastic.py [--engine dask] [--rounds 3] [--recoveries 3]

1. Commit overhead: the benchmark workload (DDP MLP 784-512-512-10, SGD with momentum,
   batch 64 per rank, 2 ranks) inside ``@nbdist.elastic.run``, with no commit, a commit every
   step, a commit every 10 steps, and, for reference, what a script would do instead: rank 0
   ``torch.save``-ing a checkpoint file every step. Rounds interleave the variants on one warm
   cluster; reported are median samples/s, spread, and the ratio to no commit.
2. Time to recover: rank 1 SIGKILLs itself mid-training. nbdist: from the kill to the
   survivor's next step (the group re-formed at width 1) and to the first step back at full
   width (a replacement worker started and healed from the survivor). torchrun: the same job
   under ``torchrun --max-restarts 1`` (the c10d rendezvous, each attempt's rank 0 hosting
   its store: static rendezvous restarts failed half the time here), which restarts every
   worker and resumes from a checkpoint file of the step the kill came after; from the kill
   to the first step after the restart. Trials alternate between the two sides.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import textwrap
from typing import Any

try:
    from benchmarks import _common as c
except ImportError:  # run as a script
    import _common as c  # type: ignore[no-redef]

KILL_AT = 30  # the step after which rank 1 is killed

SETUP = """
import os, sys, time, torch, torch.distributed as dist, nbdist
if {here!r} not in sys.path:
    sys.path.insert(0, {here!r})
import workload
ddp, opt, loss_fn, data = workload.build(batch={batch}, seed=0, threads=1)
state = nbdist.elastic.State(model=ddp, optimizer=opt, step=0)
marks = []  # (time, world size) after each step: a plain list, never rolled back

def state_bytes():
    sd = [ddp.module.state_dict(), opt.state_dict()]
    seen = []
    def walk(x):
        if isinstance(x, torch.Tensor):
            seen.append(x.numel() * x.element_size())
        elif isinstance(x, dict):
            [walk(v) for v in x.values()]
        elif isinstance(x, (list, tuple)):
            [walk(v) for v in x]
    walk(sd)
    return sum(seen)

@nbdist.elastic.run
def bench(state, mode, steps, warmup, ckpt):
    def one(i):
        workload.step(state.model, state.optimizer, loss_fn, *data[i % workload.POOL])
        state.step += 1
        if mode == "commit" or (mode == "commit/10" and state.step % 10 == 0):
            state.commit()
        elif mode == "torch.save" and dist.get_rank() == 0:
            torch.save({{"model": state.model.module.state_dict(),
                        "optimizer": state.optimizer.state_dict(), "step": state.step}},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    for i in range(warmup):
        one(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        one(i)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return steps * {batch} * dist.get_world_size() / t.item()

@nbdist.elastic.run
def survive(state, kill_at, after, flag):
    # Train; rank 1 SIGKILLs itself after step kill_at (once: the flag file records it);
    # carry on until the group has been back at full width for `after` steps.
    full_since = None
    while True:
        workload.step(state.model, state.optimizer, loss_fn, *data[state.step % workload.POOL])
        state.step += 1
        state.commit()
        marks.append((time.time(), dist.get_world_size()))
        if state.step == kill_at and not os.path.exists(flag) and dist.get_rank() == 1:
            with open(flag, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), 9)
        if os.path.exists(flag) and dist.get_world_size() == 2:
            full_since = full_since if full_since is not None else state.step
            if state.step - full_since >= after:
                return
"""

TORCHRUN_JOB = """
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {here!r})
import workload
dist.init_process_group("gloo")
rank = dist.get_rank()
ddp, opt, loss_fn, data = workload.build(batch={batch}, seed=0, threads=1)
ckpt, flag, marks = sys.argv[1], sys.argv[2], sys.argv[3]
step = 0
if os.path.exists(ckpt):  # a restart: resume from the checkpoint, as a torchrun job does
    saved = torch.load(ckpt)
    ddp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    step = saved["step"]
first = True
while step < {kill_at} + {after}:
    workload.step(ddp, opt, loss_fn, *data[step % workload.POOL])
    step += 1
    if first and os.path.exists(ckpt) and rank == 0:
        with open(marks, "w") as f:
            f.write(repr(time.time()))
        first = False
    if step == {kill_at} and not os.path.exists(flag):
        if rank == 0:
            torch.save({{"model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()  # the checkpoint of this very step is on disk before the kill
        if rank == 1:
            with open(flag, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), 9)
dist.destroy_process_group()
"""


def overhead(s: Any, args: argparse.Namespace, tmp: str) -> None:
    modes = ["none", "commit", "commit/10", "torch.save"]
    results: dict[str, list[float]] = {m: [] for m in modes}
    ckpt = os.path.join(tmp, "every-step.pt")
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        for m in order:
            sps = float(repr(s.run_cell(
                f"bench(state, {m!r}, {args.steps}, {args.warmup}, {ckpt!r})",
                output="quiet")))
            results[m].append(sps)
            c.log(f"round {rnd + 1}/{args.rounds} {m}: {sps:.0f} samples/s")
    size = float(repr(s.run_cell("state_bytes()", output="quiet", ranks="0")))
    base = c.median(results["none"])
    rows = []
    for m in modes:
        v = results[m]
        per_step = 1e3 * args.batch * 2 * (1 / c.median(v) - 1 / base)
        rows.append((m, c.median(v), min(v), max(v), c.median(v) / base,
                     per_step, " ".join(f"{x:.0f}" for x in v)))
    print(f"\n1. commit() overhead: model + optimizer state {size / 2**20:.1f} MiB per rank, "
          f"{args.steps} timed steps after {args.warmup} warm-up, {args.rounds} interleaved "
          "rounds\n")
    print(c.table(["variant", "median samples/s", "min", "max", "vs none",
                   "ms/step added", "runs"], rows))
    for m in modes[1:]:
        print(f"throughput ratio {m}/none: {c.median(results[m]) / base:.3f}x")


def nbdist_recovery(s: Any, args: argparse.Namespace, tmp: str, trial: int) -> tuple[float,
                                                                                       float]:
    flag = os.path.join(tmp, f"killed-{trial}")
    s.run_cell("marks.clear(); state.step = 0; state.commit()", output="quiet")
    s.run_cell(f"survive(state, {KILL_AT}, {args.after}, {flag!r})", output="quiet",
               timeout=args.timeout)
    with open(flag) as f:
        killed = float(f.read())
    marks = s.pull("marks", rank=0)
    # Rank 0 may finish the kill's own step just after rank 1 wrote the time: the recovery is
    # the first step at width 1, then the first back at width 2.
    after = [(t, w) for t, w in marks if t > killed]
    resumed = next(t for t, w in after if w == 1)
    full = next(t for t, w in after if w == 2 and t > resumed)
    resumed, full = resumed - killed, full - killed
    return resumed, full


def torchrun_recovery(args: argparse.Namespace, tmp: str, trial: int) -> float:
    d = os.path.join(tmp, f"torchrun-{trial}")
    os.makedirs(d)
    script = os.path.join(d, "job.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_JOB.format(here=c.HERE, batch=args.batch, kill_at=KILL_AT,
                                    after=args.after))
    ckpt, flag, marks = (os.path.join(d, n) for n in ("ckpt.pt", "killed", "resumed"))
    # torchrun's static rendezvous keeps one store across attempts, whose keys the restarted
    # workers read again: they found the killed worker's address and were refused, or hung
    # until killed (2 of 4 runs here, Nov 30). The c10d rendezvous, with each attempt's rank 0
    # hosting a store of its own (as torch's maintainers advise), restarted 4 of 4.
    c.run_torchrun(script, [ckpt, flag, marks], 2, timeout=120,
                   env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                   launcher_args=["--max-restarts", "1", "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", f"127.0.0.1:{c.free_port()}"])
    with open(flag) as f:
        killed = float(f.read())
    with open(marks) as f:
        return float(f.read()) - killed


def _why(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if "Error" in ln]
    return (lines[-1] if lines else str(exc).splitlines()[0])[:160]


def recovery(s: Any, args: argparse.Namespace, tmp: str, engine: str) -> None:
    nb_resume: list[float] = []
    nb_full: list[float] = []
    tr: list[float] = []
    failed: list[str] = []
    for trial in range(args.recoveries):
        sides = ["nbdist", "torchrun"] if trial % 2 == 0 else ["torchrun", "nbdist"]
        for side in sides:
            if side == "nbdist":
                r, f = nbdist_recovery(s, args, tmp, trial)
                nb_resume.append(r)
                nb_full.append(f)
                c.log(f"trial {trial + 1}: nbdist training again after {r:.3f} s, "
                      f"full width after {f:.2f} s")
            else:
                for attempt in range(4):
                    try:
                        t = torchrun_recovery(args, tmp, trial + 1000 * attempt)
                        break
                    except Exception as exc:  # e.g. gloo refusing a connection at the restart
                        failed.append(_why(exc))
                        c.log(f"trial {trial + 1}: torchrun failed ({failed[-1]}); again")
                else:  # counted below; the trial has no torchrun figure
                    continue
                tr.append(t)
                c.log(f"trial {trial + 1}: torchrun full width again after {t:.2f} s")
    rows = [
        (f"nbdist ({engine}): survivors training again", c.median(nb_resume), min(nb_resume),
         max(nb_resume)),
        (f"nbdist ({engine}): back at full width", c.median(nb_full), min(nb_full),
         max(nb_full)),
    ]
    if tr:
        rows.append(("torchrun --max-restarts 1: back at full width", c.median(tr), min(tr),
                     max(tr)))
    print(f"\n2. Time to recover from a SIGKILL of rank 1 (after step {KILL_AT}), seconds, "
          f"{args.recoveries} alternating trials\n")
    print(c.table(["side", "median s", "min", "max"], rows))
    if failed:
        print(f"torchrun runs that failed and were repeated: {len(failed)} of "
              f"{len(failed) + len(tr)} (e.g. {failed[0]})")
    if not tr:
        print("torchrun: no restart succeeded, no ratio")
        return
    print(f"time-to-full-width ratio nbdist/torchrun: {c.median(nb_full) / c.median(tr):.2f}x")
    print(f"time-to-training-again ratio nbdist/torchrun: "
          f"{c.median(nb_resume) / c.median(tr):.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("ipyparallel", "dask"), default="ipyparallel")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per run (200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first (20)")
    ap.add_argument("--batch", type=int, default=64, help="batch per rank (64)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved overhead rounds (3)")
    ap.add_argument("--recoveries", type=int, default=3, help="recovery trials per side (3)")
    ap.add_argument("--after", type=int, default=20,
                    help="steps at full width after the recovery before a trial ends (20)")
    ap.add_argument("--skip", choices=("overhead", "recovery"), action="append", default=[])
    ap.add_argument("--timeout", type=float, default=900, help="overall limit, s (900)")
    args = c.parse_args(ap, argv)
    with c.deadline(args.timeout):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from nbdist.session import Session

    print(f"bench_elastic: 2 ranks on {args.engine}, gloo, 1 thread/rank ({c.machine()})")
    s = Session()
    tmp = tempfile.mkdtemp(prefix="nbdist-bench-elastic-")
    try:
        c.log(f"starting nbdist on 2 {args.engine} workers")
        s.start(2, engine=args.engine, threads=1, timeout=120)
        s.run_cell(textwrap.dedent(SETUP.format(here=c.HERE, batch=args.batch)),
                   output="quiet")
        if "overhead" not in args.skip:
            overhead(s, args, tmp)
        if "recovery" not in args.skip:
            recovery(s, args, tmp, args.engine)
    finally:
        c.log("stopping the cluster")
        s.stop()
        c.kill_children()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
