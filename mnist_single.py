"""Lesson 1's starting point: a small CNN learns MNIST on one GPU (or the CPU), no DDP.

    python mnist_single.py

`diff mnist_single.py ddp_mnist.py` shows what DDP adds to it: the lines marked `# DDP:`.
"""

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ddp_common import Parser, fail, positive_int


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


def get_data(args):
    """MNIST (downloaded if missing), or generated digits: the training and test sets."""
    if args.data == "synthetic":
        return synthetic_mnist()
    try:
        return load_mnist(args.data_dir, download=True)
    except Exception as e:
        why = f"no MNIST in {args.data_dir} ({e}); offline? --data synthetic needs no download"
        fail(why, code=1)


class Trainer:
    def __init__(self, args, device, train_set, test_set):
        self.args = args
        self.device = device
        self.test_set = test_set
        torch.manual_seed(0)
        self.model = Net().to(self.device)
        on_gpu = self.device.type == "cuda"
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, fused=on_gpu)
        self.loader = DataLoader(train_set, args.batch_size, shuffle=True, pin_memory=on_gpu)
        self.total_steps = args.epochs * len(self.loader)
        if args.max_steps:
            self.total_steps = min(self.total_steps, args.max_steps)
        self.step = 0

    def _run_batch(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        # The loss summed on the device between log lines: no wait for the GPU per step.
        loss_sum = torch.zeros((), device=self.device)
        start, logged = time.perf_counter(), self.step
        for x, y in self.loader:
            loss_sum += self._run_batch(x, y)
            self.step += 1
            if self.step % self.args.log_every == 0 or self.step == self.total_steps:
                steps = self.step - logged
                samples = steps * self.args.batch_size
                # .item() waits for the device: once per log line.
                print(
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
        model = self.model.eval()
        totals = torch.zeros(3, device=self.device)
        for x, y in DataLoader(self.test_set, batch_size=1000):
            x, y = x.to(self.device), y.to(self.device)
            logits = model(x)
            totals[0] += F.cross_entropy(logits, y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        model.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, f"{100 * correct / count:.2f}% ({correct:.0f}/{count:.0f})"

    def _save_checkpoint(self, epoch):
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": epoch + 1,
        }
        os.makedirs(self.args.checkpoint_dir, exist_ok=True)
        torch.save(state, os.path.join(self.args.checkpoint_dir, "last.pt"))

    def train(self):
        for epoch in range(self.args.epochs):
            self._run_epoch(epoch)
            loss, accuracy = self.evaluate()
            print(
                f"epoch {epoch + 1}/{self.args.epochs} | val_loss {loss:.4f} | val_acc {accuracy}"
            )
            self._save_checkpoint(epoch)
            if self.step == self.total_steps:
                break
        return loss, accuracy


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, test_set = get_data(args)
    trainer = Trainer(args, device, train_set, test_set)
    print(
        f"start: data {args.data} | device {device.type} | batch {args.batch_size} | steps "
        f"{trainer.total_steps}"
    )
    start = time.perf_counter()
    loss, accuracy = trainer.train()
    print(
        f"done: data {args.data} | steps {trainer.step} | val_loss {loss:.4f} | val_acc "
        f"{accuracy} | time {time.perf_counter() - start:.1f}s"
    )


if __name__ == "__main__":
    main()
