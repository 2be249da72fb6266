"""Lesson 1: the simplest complete DistributedDataParallel run.

    torchrun --standalone --nproc_per_node=4 ddp_mnist.py          # 4 GPUs, or 4 CPU processes

torchrun starts one process per GPU (or per CPU slot) and gives each its rank. Every process
builds the same model; DDP averages the gradients across processes during backward, so every
replica takes the same optimizer step and the replicas stay identical. Each process sees a
different shard of the data (DistributedSampler), which is where the speed-up comes from.
The DDP-specific lines are marked `# DDP:`.
"""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_checkpoint import save_checkpoint
from ddp_common import cleanup, fail, print0, set_seed, setup
from ddp_extras import folder_lock, long_barrier

# MNIST pixel statistics.
MEAN, STD = 0.1307, 0.3081


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 1: train a small CNN on MNIST with DDP. "
        "Launch with: torchrun --standalone --nproc_per_node=N ddp_mnist.py"
    )
    parser.add_argument(
        "--data",
        default="auto",
        choices=["auto", "mnist", "synthetic"],
        help="mnist: the real set (downloaded into --data-dir if missing, error if it "
        "cannot be); synthetic: generated MNIST-shaped digits, no download; "
        "auto: mnist, or synthetic with a warning when it cannot be had (default)",
    )
    parser.add_argument(
        "--data-dir", default="./data", help="where MNIST/raw/ lives (default ./data)"
    )
    parser.add_argument(
        "--epochs", type=int, default=2, help="passes over the training set (default 2)"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many optimizer steps in all (0 = no cap); for quick checks",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="samples per step PER RANK; the global batch is this x world size (default 64)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for init, data order and synthetic data"
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="./checkpoints",
        help="rank 0 saves mnist.pt here after every epoch (default ./checkpoints)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)",
    )
    parser.add_argument(
        "--log-every", type=int, default=100, help="steps between log lines (default 100)"
    )
    args = parser.parse_args(argv)
    # Every rank parses the flags: rank 0 alone says what is wrong.
    for name in ("epochs", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1", rank0_only=True)
    if args.max_steps < 0:
        fail("--max-steps must be >= 0", rank0_only=True)
    if args.lr <= 0:
        fail("--lr must be > 0", rank0_only=True)
    return args


class Net(nn.Module):
    """A small CNN: 28x28 digit -> 10 class scores (~0.2 M parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_mnist(data_dir, download):
    """Real MNIST through torchvision (IDX files in DATA_DIR/MNIST/raw/), as normalised tensors."""
    from torchvision.datasets import MNIST

    sets = [MNIST(data_dir, train=train, download=download) for train in (True, False)]
    return [
        TensorDataset(s.data.unsqueeze(1).float().div(255).sub(MEAN).div(STD), s.targets)
        for s in sets
    ]


def synthetic_mnist(seed, n_train=60000, n_test=10000):
    """MNIST-shaped data that can be learned: each class is a fixed random smooth pattern, each
    sample that pattern, shifted by a pixel or two, plus noise. Same on every rank (fixed seed)."""
    generator = torch.Generator().manual_seed(seed + 12345)
    protos = F.interpolate(torch.rand(10, 1, 7, 7, generator=generator), size=28, mode="bilinear")
    # each prototype moved by (-2..2, -2..2) pixels: pattern k of class c is shifted[c * 25 + k]
    shifted = torch.cat(
        [torch.roll(protos, shifts=(k // 5 - 2, k % 5 - 2), dims=(2, 3)) for k in range(25)], dim=1
    ).view(250, 1, 28, 28)

    def make(n):
        y = torch.randint(0, 10, (n,), generator=generator)
        shift = torch.randint(0, 25, (n,), generator=generator)
        x = torch.randn(n, 1, 28, 28, generator=generator).mul_(1.2).add_(shifted[y * 25 + shift])
        return TensorDataset(x.sub_(x.mean()).div_(x.std()), y)

    return make(n_train), make(n_test)


def try_mnist(data_dir, download):
    """(train, test) and no problem, or (None, one-line reason)."""
    try:
        return load_mnist(data_dir, download), ""
    except Exception as e:
        # Offline, a proxy, a full disk, missing or torn files ...
        return None, f"{data_dir}: {' '.join(str(e).split())[:150] or type(e).__name__}"


def get_data(args, ddp):
    """Every rank must train on the same dataset, and each node may have its own disk. So local
    rank 0 of every node downloads if needed (N ranks writing one folder corrupt it), the node's
    other ranks wait, then load from disk; the ranks share what they found and decide together."""
    if args.data == "synthetic":
        return "synthetic", *synthetic_mnist(args.seed)
    if ddp.local_rank == 0:
        # DDP: one download per node, not per job: disks may be node-local. Nodes that share one
        # disk take turns (a lock file), so no two write the same files.
        print(f"data: node {ddp.node_rank} fetches MNIST into {args.data_dir}", flush=True)
        with folder_lock(args.data_dir):
            data, problem = try_mnist(args.data_dir, download=True)
    # DDP: the node's other ranks wait until its files are there, longer than a collective may.
    long_barrier()
    if ddp.local_rank != 0:
        data, problem = try_mnist(args.data_dir, download=False)
    problems = [None] * ddp.world_size
    # DDP: every rank learns what every other found.
    dist.all_gather_object(problems, problem)
    missing = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if not missing:
        return "mnist", *data
    where = (
        f"MNIST is not in --data-dir/MNIST/raw and could not be downloaded on "
        f"{len(missing)} of {ddp.world_size} ranks ({'; '.join(missing)[:400]})"
    )
    if args.data == "mnist":
        fail(
            f"{where}. Put the four IDX files in --data-dir on every node, or use --data synthetic",
            code=1,
            rank0_only=True,
        )
    print0(f"warning: {where}; every rank uses synthetic MNIST-shaped data instead")
    return "synthetic", *synthetic_mnist(args.seed)


@torch.no_grad()
def evaluate(model, test_set, ddp, batch_size):
    """Exact test accuracy across ranks. DistributedSampler would pad the shards with repeated
    samples to make them equal; here rank r takes samples r, r+W, r+2W, ... (no padding, no
    sample twice) and the sums are all-reduced, so the total count is exactly len(test_set).
    Pass the bare model (model.module): the shards may differ by a batch, and a forward through
    the DDP wrapper can start a collective (a buffer broadcast) that the other ranks never join."""
    model.eval()
    shard = Subset(test_set, range(ddp.rank, len(test_set), ddp.world_size))
    loss_sum = torch.zeros((), device=ddp.device)
    correct = torch.zeros((), device=ddp.device)
    for x, y in DataLoader(shard, batch_size=4 * batch_size):
        x, y = x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True)
        logits = model(x)
        # Sums stay on the device.
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
    totals = torch.stack([loss_sum, correct, torch.tensor(float(len(shard)), device=ddp.device)])
    # DDP: sum the shards' counts.
    dist.all_reduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(correct), int(count)


def make_train_loader(train_set, ddp, batch_size, seed):
    # DDP: each rank draws a different 1/world_size of the shuffled indices every epoch.
    sampler = DistributedSampler(
        train_set, num_replicas=ddp.world_size, rank=ddp.rank, shuffle=True, seed=seed
    )
    # Pinned memory: the host->GPU copies can run asynchronously.
    return DataLoader(
        train_set, batch_size=batch_size, sampler=sampler, pin_memory=ddp.device.type == "cuda"
    )


def train(args, ddp):
    # Same seed everywhere -> same initial weights (DDP also broadcasts them)
    set_seed(args.seed)
    dataset, train_set, test_set = get_data(args, ddp)
    loader = make_train_loader(train_set, ddp, args.batch_size, args.seed)
    sampler = loader.sampler
    on_gpu = ddp.device.type == "cuda"

    model = Net().to(ddp.device)
    # DDP: wrap the model; gradients are all-reduced (averaged) in buckets during backward.
    model = DDP(model, device_ids=[ddp.device.index] if on_gpu else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=on_gpu)

    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    print0(
        f"start: data {dataset} | train {len(train_set)} | test {len(test_set)} | "
        f"world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} | "
        f"batch {args.batch_size}/rank, {args.batch_size * ddp.world_size} global | "
        f"steps {total_steps}"
    )

    step = 0
    start = time.perf_counter()
    last_log = start
    # The loss summed since the last log line.
    loss_sum = torch.zeros((), device=ddp.device)
    for epoch in range(args.epochs):
        # DDP: without this every epoch repeats epoch 0's order.
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            # DDP: the all-reduce of gradients overlaps with this backward.
            loss.backward()
            optimizer.step()
            # Stays on the device: no sync with the host per step.
            loss_sum += loss.detach()
            step += 1
            if step % args.log_every == 0 or step == total_steps:
                n = (step - 1) % args.log_every + 1
                # .item() below waits for the GPU: once per log line.
                now = time.perf_counter()
                rate = n * args.batch_size * ddp.world_size / (now - last_log)
                eta = (total_steps - step) * (now - start) / step
                print0(
                    f"epoch {epoch + 1}/{args.epochs} | step {step}/{total_steps} | "
                    f"loss {loss_sum.item() / n:.4f} | {rate:.0f} samples/s | "
                    f"eta {datetime.timedelta(seconds=round(eta))}"
                )
                last_log = now
                loss_sum = torch.zeros((), device=ddp.device)
            if step == total_steps:
                break
        # DDP: evaluate the bare model: every rank holds the same weights, no wrapper needed.
        val_loss, val_acc, correct, count = evaluate(model.module, test_set, ddp, args.batch_size)
        print0(
            f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | "
            f"val_acc {100 * val_acc:.2f}% ({correct}/{count})"
        )
        # DDP: save model.module (the bare model, no 'module.' prefix); rank 0 writes atomically.
        save_checkpoint(
            {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "step": step,
            },
            os.path.join(args.checkpoint_dir, "mnist.pt"),
        )
        if step == total_steps:
            break

    print0(
        f"done: data {dataset} | world {ddp.world_size} | backend {ddp.backend} | "
        f"device {ddp.device.type} | steps {step} | val_loss {val_loss:.4f} | "
        f"val_acc {100 * val_acc:.2f}% ({correct}/{count}) | "
        f"time {time.perf_counter() - start:.1f}s"
    )
    return model


# @record: if this process dies of an exception, torchrun's failure summary shows its traceback
# (otherwise it says `error_file: <N/A>`).
@record
def main():
    args = parse_args()
    # DDP: join the process group; pick this rank's device.
    ddp = setup(args.backend)
    train(args, ddp)
    cleanup()


if __name__ == "__main__":
    main()
