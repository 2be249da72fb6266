"""Lesson 2's default job written the way a Lightning user would write it, for bench/compare.py.

    python bench/lightning_cifar.py --devices 2 --max-steps 40     # CPU: 2 processes, DDP on gloo

The same ResNet-18 (CIFAR stem, imported from the lesson's training_data.py so the model is
identical), the same synthetic CIFAR-shaped data, random crop + flip as torchvision transforms in
the Dataset, SGD with momentum and weight decay, linear warm-up then cosine, the lesson's LR rule
(0.1 for a global batch of 256, scaled linearly). Lightning adds the DistributedSampler, the DDP
wrap and the process launch. Prints one `done:` line with its steady-state samples/s: the steps
after --warmup-steps, timed at the end of each training batch on rank 0.
"""

import argparse
import math
import os
import sys
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The lesson's model and data (its companion module).
from training_data import MEAN, STD, build_model, synthetic_cifar  # noqa: E402


class Images(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y
        self.transform = v2.Compose(
            [
                v2.RandomCrop(32, padding=4),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(MEAN, STD),
            ]
        )

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


class Classifier(L.LightningModule):
    def __init__(self, lr, warmup_steps, total_steps):
        super().__init__()
        self.model, self.lr, self.warmup, self.total = (
            build_model("resnet18"),
            lr,
            warmup_steps,
            total_steps,
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        warmup = self.warmup
        total = self.total

        # Lesson 2's schedule: linear warm-up, then cosine decay to zero.
        def lr_factor(step):
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class StepClock(L.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_end(self, trainer, *args):
        self.times.append(time.perf_counter())


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the timing")
    p.add_argument(
        "--subset",
        type=int,
        default=2000,
        help="synthetic training images (as the lesson's --subset)",
    )
    p.add_argument(
        "--epochs", type=int, default=30, help="the lr schedule's length, as in the lesson"
    )
    return p.parse_args()


def training_loader(args, cuda):
    """The lesson's synthetic training images (10% held out, as it does), augmented."""
    (x, y), _ = synthetic_cifar(0, args.subset, 1)
    n_train = len(y) - len(y) // 10
    # As the lesson: DataLoader workers on GPUs only.
    return DataLoader(
        Images(x[:n_train], y[:n_train]),
        args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=4 if cuda else 0,
        pin_memory=cuda,
    )


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    loader = training_loader(args, cuda)
    steps_per_epoch = len(loader.dataset) // args.devices // args.batch_size
    # The lesson's rule: --lr 0.1 for a global batch of 256, scaled linearly (SGD).
    lr = 0.1 * args.batch_size * args.devices / 256
    model = Classifier(lr, steps_per_epoch, args.epochs * steps_per_epoch)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        times, warmup = clock.times, args.warmup_steps
        timed_steps = len(times) - warmup
        rate = timed_steps * args.batch_size * trainer.world_size / (times[-1] - times[warmup - 1])
        print(
            f"done: lightning {L.__version__} | world {trainer.world_size}"
            f" | threads {torch.get_num_threads()} | steps {len(times)} | {rate:.1f} samples/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
