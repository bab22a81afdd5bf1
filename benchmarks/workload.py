"""The one DDP training workload both sides run: an MLP on synthetic MNIST-shaped data.

nbdist imports this module inside a ``%%distributed`` cell (the process group already
exists); torchrun runs it as a script (``main()`` forms the group from torchrun's
environment first). Timing happens here, inside the loop, so neither side's start-up counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

IN, HIDDEN, OUT = 784, 512, 10
POOL = 8  # distinct synthetic batches, cycled, so data generation stays out of the loop


def build(batch: int, seed: int, threads: int) -> tuple[Any, Any, Any, list[tuple[Any, Any]]]:
    """Model wrapped in DDP, its optimizer, loss, and a pool of batches for this rank."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
    data = [(torch.randn(batch, IN, generator=gen), torch.randint(0, OUT, (batch,), generator=gen))
            for _ in range(POOL)]
    return ddp, opt, torch.nn.CrossEntropyLoss(), data


def step(ddp: Any, opt: Any, loss_fn: Any, x: Any, y: Any) -> float:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(ddp(x), y)
    loss.backward()
    opt.step()
    return loss.item()


class Trainer:
    """A model, its optimizer and data, built and warmed up once; then timed windows of steps
    on it, as a warm notebook worker or a long-running torchrun job trains in stretches."""

    def __init__(self, batch: int, seed: int, threads: int, warmup: int):
        self.ddp, self.opt, self.loss_fn, self.data = build(batch, seed, threads)
        self.batch, self.i = batch, 0
        self.steps(warmup)

    def steps(self, n: int) -> float:
        loss = 0.0
        for _ in range(n):
            loss = step(self.ddp, self.opt, self.loss_fn, *self.data[self.i % POOL])
            self.i += 1
        return loss

    def window(self, steps: int) -> dict[str, Any]:
        """Time ``steps`` steps from a common start; every rank returns the global figures."""
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss = self.steps(steps)
        # The slowest rank bounds the job: reduce the maximum. CPU time (all threads of the
        # rank's process) is the load-insensitive view: what a step costs, not how long it waited.
        t = torch.tensor([time.perf_counter() - t0, time.process_time() - cpu0],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        world = dist.get_world_size()
        return {"samples_per_s": steps * self.batch * world / t[0].item(),
                "seconds": t[0].item(), "cpu_ms_per_step": 1e3 * t[1].item() / steps,
                "steps": steps, "batch": self.batch, "world_size": world, "loss": loss}


def train(steps: int = 200, warmup: int = 20, batch: int = 64, seed: int = 0,
          threads: int = 1) -> dict[str, Any]:
    """Build, warm up, then time ``steps`` steps; every rank returns the same global figures."""
    out = Trainer(batch, seed, threads, warmup).window(steps)
    out["threads"] = torch.get_num_threads()
    return out


_trainers: dict[str, Trainer] = {}


def window(key: str, steps: int, warmup: int = 20, batch: int = 64, seed: int = 0,
           threads: int = 1) -> dict[str, Any]:
    """A timed window on the warm model named ``key`` (built and warmed up on first use)."""
    if key not in _trainers:
        _trainers[key] = Trainer(batch, seed, threads, warmup)
    return _trainers[key].window(steps)


def serve(port: int, warmup: int, batch: int, seed: int, threads: int) -> dict[str, Any]:
    """Train in windows on request: rank 0 reads a step count per line from the benchmark on
    ``port`` (0: stop) and answers each window's figures as one JSON line; between windows
    the ranks wait, idle, in a socket read and a broadcast."""
    import socket

    trainer = Trainer(batch, seed, threads, warmup)
    conn = None
    if dist.get_rank() == 0:
        conn = socket.create_connection(("127.0.0.1", port))
        reader = conn.makefile("r")
    try:
        while True:
            n = torch.zeros(1, dtype=torch.int64)
            if conn is not None:
                line = reader.readline()
                n[0] = int(line) if line.strip() else 0
            dist.broadcast(n, 0)
            if n.item() <= 0:
                return {"windows": trainer.i}
            out = trainer.window(int(n.item()))
            if conn is not None:
                conn.sendall((json.dumps(out) + "\n").encode())
    finally:
        if conn is not None:
            conn.close()


def first_step(batch: int = 64, seed: int = 0, threads: int = 1) -> dict[str, Any]:
    """Time the first DDP construction and the first optimizer step (max over ranks)."""
    t0 = time.perf_counter()
    ddp, opt, loss_fn, data = build(batch, seed, threads)
    t1 = time.perf_counter()
    step(ddp, opt, loss_fn, *data[0])
    t2 = time.perf_counter()
    done = time.time()
    t = torch.tensor([t1 - t0, t2 - t1], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"ddp_s": t[0].item(), "step_s": t[1].item(), "first_step_done": done}


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: form the group from the environment, run, rank 0 prints one JSON line."""
    t_main = time.time()  # torch and this module are imported by now
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("train", "startup", "serve"), default="train")
    ap.add_argument("--port", type=int, default=0, help="serve: the benchmark's port")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    t_group = time.time()
    try:
        if args.mode == "train":
            out = train(args.steps, args.warmup, args.batch, args.seed, args.threads)
        elif args.mode == "serve":
            out = serve(args.port, args.warmup, args.batch, args.seed, args.threads)
        else:
            out = first_step(args.batch, args.seed, args.threads)
            out.update(main_started=t_main, group_formed=t_group)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(out), flush=True)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
