"""Lesson 1: the simplest complete DDP run: a small CNN learns MNIST on every GPU of a machine.

    torchrun --standalone --nproc_per_node=4 ddp_mnist.py    # 4 GPUs, or 4 CPU processes

torchrun starts one process per GPU; each trains the same model on its own shard of the data,
and DDP averages the gradients in backward. `diff mnist_single.py ddp_mnist.py`: what DDP adds.
"""

import contextlib
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

from ddp_common import Parser, cleanup, fail, positive_int, print0, save_checkpoint, setup


def parse_args():
    parser = Parser(description="Lesson 1: a CNN learns MNIST.")
    parser.add_argument("--data", default="mnist", choices=["mnist", "synthetic"])
    parser.add_argument("--data-dir", default="./data", help="where MNIST/raw/ lives")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--max-steps", type=positive_int, help="stop after N steps (a quick run)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--checkpoint-dir", default="./checkpoints", help="for last.pt")
    parser.add_argument("--log-every", type=positive_int, default=100, help="steps per log line")
    return parser.parse_args()


class Net(nn.Module):
    """A small CNN: a 28x28 digit -> 10 class scores."""

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
    """MNIST's training and test sets through torchvision, as normalised tensors."""
    from torchvision.datasets import MNIST

    sets = [MNIST(data_dir, train=train, download=download) for train in (True, False)]
    # Pixels scaled by MNIST's mean (0.1307) and standard deviation (0.3081).
    return [TensorDataset((s.data[:, None] / 255 - 0.1307) / 0.3081, s.targets) for s in sets]


def synthetic_mnist(n_train=60000, n_test=10000):
    """Digits that need no download: a blurred random pattern per class plus noise (seed fixed)."""
    generator = torch.Generator().manual_seed(12345)
    patterns = F.interpolate(torch.rand(10, 1, 7, 7, generator=generator), size=28)
    sets = []
    for n in (n_train, n_test):
        y = torch.randint(0, 10, (n,), generator=generator)
        x = patterns[y] + 2 * torch.randn(n, 1, 28, 28, generator=generator)
        sets.append(TensorDataset((x - x.mean()) / x.std(), y))
    return sets


def get_data(args, local_rank):
    """MNIST (downloaded if missing), or generated digits: the training and test sets."""
    if args.data == "synthetic":
        return synthetic_mnist()
    if local_rank == 0:
        # DDP: one process per machine downloads: several writing one folder would corrupt it.
        with contextlib.suppress(Exception):
            load_mnist(args.data_dir, download=True)
    # DDP: the other processes wait here until the files are there.
    dist.barrier()
    try:
        return load_mnist(args.data_dir, download=False)
    except Exception as e:
        why = f"no MNIST in {args.data_dir} ({e}); offline? --data synthetic needs no download"
        fail(why, code=1, rank0_only=True)


class Trainer:
    def __init__(self, args, ddp, train_set, test_set):
        self.args = args
        self.ddp = ddp
        self.device = ddp.device
        self.test_set = test_set
        # The same initial weights in every process (DDP also copies rank 0's to all).
        torch.manual_seed(0)
        model = Net().to(self.device)
        on_gpu = self.device.type == "cuda"
        # DDP: wrap the model; its backward averages the gradients of all processes.
        self.model = DDP(model, device_ids=[ddp.device.index] if on_gpu else None)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, fused=on_gpu)
        # DDP: each process draws a different 1/world_size of the shuffled samples.
        self.sampler = DistributedSampler(train_set, ddp.world_size, ddp.rank, shuffle=True)
        self.loader = DataLoader(
            train_set, args.batch_size, sampler=self.sampler, pin_memory=on_gpu
        )
        self.total_steps = args.epochs * len(self.loader)
        if args.max_steps:
            self.total_steps = min(self.total_steps, args.max_steps)
        self.step = 0

    def _run_batch(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP: the gradients are all-reduced here, bucket by bucket, overlapped with backward.
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        # DDP: a new shuffle every epoch, the same in every process (without it: epoch 0's order).
        self.sampler.set_epoch(epoch)
        # The loss summed on the device between log lines: no wait for the GPU per step.
        loss_sum = torch.zeros((), device=self.device)
        start, logged = time.perf_counter(), self.step
        for x, y in self.loader:
            loss_sum += self._run_batch(x, y)
            self.step += 1
            if self.step % self.args.log_every == 0 or self.step == self.total_steps:
                steps = self.step - logged
                # DDP: every process trained a batch: samples/s of the whole job.
                samples = steps * self.args.batch_size * self.ddp.world_size
                # .item() waits for the device: once per log line. (Rank 0's own loss.)
                print0(
                    f"epoch {epoch + 1}/{self.args.epochs} | step {self.step}/{self.total_steps}"
                    f" | loss {loss_sum.item() / steps:.4f}"
                    f" | {samples / (time.perf_counter() - start):.0f} samples/s"
                )
                loss_sum.zero_()
                start, logged = time.perf_counter(), self.step
            if self.step == self.total_steps:
                break

    @torch.no_grad()
    def evaluate(self):
        # DDP: the bare model: a forward through the wrapper may start a collective that
        # processes with fewer test batches never join.
        model = self.model.module.eval()
        # DDP: process r scores samples r, r+W, r+2W, ...; a DistributedSampler would pad the
        # shards with repeated samples to make them equal.
        shard = Subset(self.test_set, range(self.ddp.rank, len(self.test_set), self.ddp.world_size))
        totals = torch.zeros(3, device=self.device)
        for x, y in DataLoader(shard, batch_size=1000):
            x, y = x.to(self.device), y.to(self.device)
            logits = model(x)
            totals[0] += F.cross_entropy(logits, y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        # DDP: add up every process's sums: the test loss and accuracy, each sample counted once.
        dist.all_reduce(totals)
        model.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, f"{100 * correct / count:.2f}% ({correct:.0f}/{count:.0f})"

    def _save_checkpoint(self, epoch):
        state = {
            # DDP: the bare model's weights, without the wrapper's "module." prefix.
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": epoch + 1,
        }
        # DDP: every process holds the same weights: rank 0 writes (atomically), the others wait.
        save_checkpoint(state, os.path.join(self.args.checkpoint_dir, "last.pt"))

    def train(self):
        for epoch in range(self.args.epochs):
            self._run_epoch(epoch)
            loss, accuracy = self.evaluate()
            print0(
                f"epoch {epoch + 1}/{self.args.epochs} | val_loss {loss:.4f} | val_acc {accuracy}"
            )
            self._save_checkpoint(epoch)
            if self.step == self.total_steps:
                break
        return loss, accuracy


# DDP: a rank that dies of an exception gets its traceback into torchrun's report (lesson 8).
@record
def main():
    args = parse_args()
    # DDP: join the process group; torchrun says which process this is (rank, local rank).
    ddp = setup()
    train_set, test_set = get_data(args, ddp.local_rank)
    trainer = Trainer(args, ddp, train_set, test_set)
    print0(
        f"start: data {args.data} | world {ddp.world_size} | backend {ddp.backend} | device "
        f"{ddp.device.type} | batch {args.batch_size}/process, "
        f"{args.batch_size * ddp.world_size} global | steps {trainer.total_steps}"
    )
    start = time.perf_counter()
    loss, accuracy = trainer.train()
    print0(
        f"done: data {args.data} | world {ddp.world_size} | steps {trainer.step} | val_loss "
        f"{loss:.4f} | val_acc {accuracy} | time {time.perf_counter() - start:.1f}s"
    )
    # DDP: drop the wrapper, then leave the process group.
    del trainer
    cleanup()


if __name__ == "__main__":
    main()
