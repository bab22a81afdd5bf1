"""A plain torchrun script: DistributedDataParallel on synthetic data, nothing nbdist-specific.

    torchrun --nproc-per-node 2 train_ddp.py --epochs 3 --save model.pt

In a notebook with nbdist, the same script runs unchanged on warm workers:

    %nbdist run train_ddp.py --epochs 3 --save model.pt
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two noisy clusters of 2-D points, centred at (-1, -1) (class 0) and (1, 1) (class 1)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 2, generator=g) * 0.6 + (y.float() * 2 - 1).unsqueeze(1)
    return x, y


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", default=None, help="rank 0 saves the weights here")
    args = parser.parse_args()

    # env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the launcher.
    # NCCL needs a GPU per process: with fewer GPUs than processes on this host, gloo on CPU.
    cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    print(f"rank {rank}/{world_size} LOCAL_RANK={local_rank} "
          f"MASTER_ADDR={os.environ['MASTER_ADDR']}", flush=True)

    data = TensorDataset(*blobs(2048, seed=0))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(make_model().to(device), device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {epoch}: last batch loss {loss.item():.4f}", flush=True)
    if args.save and rank == 0:
        torch.save(model.module.state_dict(), args.save)
    # Every rank finished its last all-reduce before any tears its connections down (a peer
    # that closes early can abort a rank still reading its last gradient bucket).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
