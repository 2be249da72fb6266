"""Lesson 0: the shortest correct DDP program, every call in view (no helper).

    python ddp_minimal.py --nproc 2        # 2 processes: one per GPU, or 2 CPU processes

mp.spawn starts the processes; each joins the process group, wraps the same model in DDP and
trains on its own shard of the data. DDP averages the gradients during backward, so every
process takes the same step and the copies stay identical: 2 processes with batches of 32
train like 1 process with batches of 64 (equal to float rounding). Every line there for DDP is
marked `# DDP:`.
"""

import argparse
import gc
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n=2048, dim=16, seed=0):
    """y = a fixed random smooth function of x, plus a little noise: a loss that can fall."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator)
    w = torch.randn(dim, 1, generator=generator) / dim**0.5
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def worker(rank, world_size, args):
    """One process of the job: rank 0 .. world_size-1. Returns the trained model and losses."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        # DDP: first, so NCCL binds this process to its own GPU.
        torch.cuda.set_device(device)
    else:
        # DDP: N CPU processes share the cores; N full thread pools would fight over them.
        torch.set_num_threads(max(1, os.cpu_count() // world_size))
    # DDP: join the group: rank 0 listens at MASTER_ADDR:MASTER_PORT, the others connect there.
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        rank=rank,
        world_size=world_size,
        device_id=device if on_gpu else None,
    )
    # The same initial weights in every process.
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    # DDP: wrap the model; backward then averages the gradients of all processes.
    model = DDP(model, device_ids=[rank] if on_gpu else None)
    dataset = make_dataset(seed=args.seed)
    # DDP: each process draws its own 1/world_size of the shuffled samples.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        # DDP: a new shuffle each epoch, the same one in every process.
        sampler.set_epoch(epoch)
        # Summed on the device: no host sync per step.
        loss_sum = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            # DDP: the gradient all-reduce runs here, overlapped with backward.
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(x)
        total = torch.stack([loss_sum, torch.tensor(float(len(sampler)), device=device)])
        # DDP: add up every process's sums for the epoch's mean loss.
        dist.all_reduce(total)
        losses.append((total[0] / total[1]).item())
        # DDP: one process prints, not world_size copies.
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} | loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(
            f"done: world {world_size} | backend {dist.get_backend()} | device {device.type} | "
            f"loss {losses[-1]:.4f} (first epoch {losses[0]:.4f}) | "
            f"time {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
    # DDP: drop the wrapper and the reference cycles it leaves before leaving the group: a live
    # one can abort a gloo process at exit.
    model = model.module
    gc.collect()
    # DDP: leave the group cleanly.
    dist.destroy_process_group()
    return model, losses


def main():
    parser = argparse.ArgumentParser(description="Lesson 0: the bare DDP calls, no helper.")
    parser.add_argument(
        "--nproc",
        type=int,
        default=torch.cuda.device_count() or 2,
        help="processes to start (default: one per GPU, or 2 on CPU)",
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="PER PROCESS (global = this x nproc)"
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if torch.cuda.is_available() and not 1 <= args.nproc <= torch.cuda.device_count():
        parser.error(f"--nproc must be 1..{torch.cuda.device_count()}: one process per GPU")
    for name in ("nproc", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    # DDP: where rank 0 will listen: this machine, on a port that is free now.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    print(
        f"start: world {args.nproc} | backend {'nccl' if torch.cuda.is_available() else 'gloo'} | "
        f"batch {args.batch_size}/process, "
        f"{args.batch_size * args.nproc} global | epochs {args.epochs}",
        flush=True,
    )
    # DDP: start args.nproc processes; each calls worker(rank, args.nproc, args).
    mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
