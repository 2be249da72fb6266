"""Lesson 2: the production template: ResNet-18 learns CIFAR-10, the way a real job trains.

    torchrun --standalone --nproc_per_node=4 ddp_training.py    # 4 GPUs (CPUs: --model cnn)

One idea: a step is one global batch G, the same samples on any world size; each rank trains its
share (my_share) in micro-batches, all-reducing after the last (no_sync). Around it, in lesson 1's
Trainer: AMP, clipping, warm-up + cosine, exact resume, best-k. Data, models: training_data.py."""

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import (
    Parser,
    cleanup,
    fail,
    load_checkpoint,
    positive_int,
    print0,
    save_checkpoint,
    setup,
)
from training_data import build_model, get_data, loader, to_input


def parse_args():
    parser = Parser(description="Lesson 2: the production DDP template, under torchrun.")
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "cnn", "cnn-bn"])
    parser.add_argument("--data", default="auto", choices=["auto", "cifar10", "synthetic"])
    parser.add_argument("--data-dir", default="./data", help="holds cifar-10-batches-py/")
    parser.add_argument("--subset", type=positive_int, help="N images (10%% for val), N/5 test")
    parser.add_argument("--epochs", type=positive_int, default=30)
    parser.add_argument("--max-steps", type=positive_int, help="stop at step N (of --epochs)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="per micro-batch")
    parser.add_argument("--global-batch-size", type=positive_int, help="over all ranks; B x W")
    parser.add_argument("--lr", type=float, default=0.1, help="at a global batch of 256")
    parser.add_argument("--warmup-epochs", type=float, default=1.0, help="then cosine to 0")
    parser.add_argument("--clip-grad", type=float, help="max global gradient norm")
    parser.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--seed", type=int, default=0, help="weights, data order, augmentation")
    parser.add_argument("--checkpoint-dir", default="./checkpoints/lesson2", help="last.pt, best-*")
    parser.add_argument("--resume", metavar="PATH|auto", help="auto: DIR/last.pt if it exists")
    parser.add_argument("--save-every", type=positive_int, help="also save last.pt every N steps")
    parser.add_argument("--keep-best", type=positive_int, default=1, help="checkpoints by val_acc")
    parser.add_argument("--log-every", type=positive_int, default=50, help="steps per log line")
    return parser.parse_args()


def my_share(mine, step, global_batch, rank, world_size):
    """DDP: rank r's part of step s: positions sG .. (s+1)G - 1 of the epoch's shuffle, where
    mine[j] is position r + jW, so j runs ceil((sG - r) / W) .. ceil(((s+1)G - r) / W) - 1
    (-(-a // b) is ceil(a / b)). The same samples on any W (G 16, W 3: 6, 5 and 5 at step 0)."""
    begin = -(-(step * global_batch - rank) // world_size)
    end = -(-((step + 1) * global_batch - rank) // world_size)
    return mine[begin:end]


def pick_amp(choice, device):
    """--amp auto: bf16 where the GPU has it, else fp16 (with a GradScaler); off on CPUs."""
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "off"
    # A T4 or a V100 only emulates bf16, slowly: is_bf16_supported() alone says yes there.
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


class Trainer:
    def __init__(self, args, ddp, data):
        self.args = args
        self.ddp = ddp
        self.device = ddp.device
        self.data_name, self.train_set, self.val_set, self.test_set = data
        self.amp = pick_amp(args.amp, ddp.device)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[self.amp]
        # The same initial weights in every process (DDP also copies rank 0's to all).
        torch.manual_seed(args.seed)
        # NHWC: faster convolutions on GPUs (tensor cores) and CPUs (oneDNN).
        model = build_model(args.model).to(self.device, memory_format=torch.channels_last)
        # fused: one kernel for the whole update. Momentum starts at zero: fused SGD's own start is
        # new memory, kept as it is if fp16's scaler skips the first step (torch 2.11-2.14).
        self.optimizer = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, fused=True
        )
        for p in model.parameters():
            self.optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        # fp16's small gradients underflow unless the loss is scaled up; bf16's do not.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp == "fp16")
        self.best = []
        checkpoint = self._resume(model)
        self._plan_batches(checkpoint)
        # DDP: wrap the model; its backward averages the gradients of all processes.
        on_gpu = self.device.type == "cuda"
        self.model = DDP(model, device_ids=[self.device.index] if on_gpu else None)
        # DDP first, then compile: the compiler sees DDP's buckets and overlaps their all-reduce.
        self.forward = torch.compile(self.model) if args.compile else self.model
        # DDP: rank r draws positions r, r+W, r+2W, ... of the epoch's shuffle (see my_share).
        self.sampler = DistributedSampler(self.train_set, seed=args.seed)

    def _resume(self, model):
        """--resume PATH|auto: every rank loads the checkpoint (to the CPU, before the DDP wrap)
        and takes up its step, best-k, loss scale and random state. Returns it, or {}."""
        path = self.args.resume
        if path == "auto":
            path = os.path.join(self.args.checkpoint_dir, "last.pt")
            if not os.path.isfile(path):
                print0(f"resume: no {path} yet; starting from scratch")
                path = None
        ckpt = load_checkpoint(path, model=model, optimizer=self.optimizer) if path else {}
        found = [None] * self.ddp.world_size
        # DDP: every rank must start from the same step, or they take different steps and hang.
        # With node-local disks some ranks may not see the file: compare what each found.
        dist.all_gather_object(found, ckpt.get("step"))
        if len(set(found)) > 1:
            why = f"ranks found different checkpoints (step by rank: {found})"
            fail(f"{why}: give every rank the same one, or remove them all", 1, rank0_only=True)
        self.step = ckpt.get("step", 0)
        # Each rank a random stream of its own (dropout's; these models draw none), seeded by the
        # step; on the same world size each takes back the one it saved (a CPU run's: no CUDA's).
        torch.manual_seed(self.args.seed + 1000 * self.step + self.ddp.rank)
        if ckpt.get("world_size") == self.ddp.world_size:
            rng = ckpt["rng"][self.ddp.rank]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"])
        if not ckpt:
            return ckpt
        # A file from elsewhere: its best-k entries name files to delete, so they must be numbers.
        try:
            self.best = [[float(accuracy), int(epoch)] for accuracy, epoch in ckpt["best"]]
        except (KeyError, TypeError, ValueError):
            fail(f"{path}: no best-k list of [accuracy, epoch] pairs", 1, rank0_only=True)
        # Saved without fp16 (an H100 run, requeued on a V100): no loss scale to take over.
        if ckpt["scaler"]:
            self.scaler.load_state_dict(ckpt["scaler"])
        was = ckpt["world_size"]
        print0(f"resumed: {path} | step {self.step} | world {was} -> {self.ddp.world_size}")
        return ckpt

    def _plan_batches(self, checkpoint):
        """G, samples per step over all ranks: --global-batch-size, the checkpoint's, or B x W."""
        args = self.args
        saved = checkpoint.get("global_batch")
        if saved and args.global_batch_size not in (None, saved):
            fail(f"the checkpoint has --global-batch-size {saved}: resume with it", 2, True)
        if checkpoint.get("data", self.data_name) != self.data_name:
            fail(f"the checkpoint trained on {checkpoint['data']}, not {self.data_name}", 1, True)
        self.global_batch = saved or args.global_batch_size or args.batch_size * self.ddp.world_size
        if self.ddp.world_size > self.global_batch:
            # A rank without a sample would not join the step's all-reduce.
            fail(f"a global batch of {self.global_batch} leaves ranks without a sample", 2, True)
        # An epoch is every whole global batch of the training set, on any world size.
        self.steps_per_epoch = len(self.train_set) // self.global_batch
        if self.steps_per_epoch == 0:
            fail(f"{len(self.train_set)} training samples: fewer than {self.global_batch}", 2, True)
        self.total_steps = args.epochs * self.steps_per_epoch
        self.last_step = min(self.total_steps, args.max_steps or self.total_steps)
        self.warmup_steps = round(args.warmup_epochs * self.steps_per_epoch)
        # --lr is for a global batch of 256, scaled linearly (safe for SGD after the warm-up).
        self.peak_lr = args.lr * self.global_batch / 256

    def _learning_rate(self):
        """Up linearly over the warm-up steps, then down to 0 along a cosine."""
        if self.step < self.warmup_steps:
            return self.peak_lr * (self.step + 1) / self.warmup_steps
        done = (self.step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return self.peak_lr * 0.5 * (1 + math.cos(math.pi * done))

    def _run_batch(self, images, labels, index, epoch):
        """One optimizer step on this rank's share of the global batch, in micro-batches."""
        self.lr = self._learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        # Micro-batches of --batch-size bound the activations' memory; the step trains them all.
        size = self.args.batch_size
        inputs = to_input(images, self.device, augment=(index, epoch, self.args.seed)).split(size)
        targets = labels.to(self.device, non_blocking=True).split(size)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            # DDP: only the step's last micro-batch all-reduces. no_sync must cover the forward
            # too: DDP decides in forward whether the coming backward all-reduces.
            last = i == len(inputs) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with torch.autocast(self.device.type, self.amp_dtype, self.amp != "off"):
                    loss = F.cross_entropy(self.forward(x), y, reduction="sum")
                # DDP: the sum x W/G: DDP averages the W ranks' gradients, so the step's is the
                # mean over its G samples, however they are split into ranks and micro-batches.
                self.scaler.scale(loss * self.ddp.world_size / self.global_batch).backward()
            loss_sum += loss.detach()
        if self.args.clip_grad:
            # fp16: clip the true gradients, not the scaled ones (all ranks' are the same).
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
        # fp16: the step is skipped if a gradient overflowed, and the scale lowered.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def _run_epoch(self, epoch):
        # DDP: a new shuffle every epoch, the same in every process (without it: epoch 0's order).
        self.sampler.set_epoch(epoch)
        mine = list(self.sampler)
        first = epoch * self.steps_per_epoch
        steps = range(self.step, min(first + self.steps_per_epoch, self.last_step))
        rank, world_size = self.ddp.rank, self.ddp.world_size
        shares = [my_share(mine, s - first, self.global_batch, rank, world_size) for s in steps]
        # The loss summed on the device between log lines: no wait for the GPU per step.
        loss_sum = torch.zeros((), device=self.device)
        logged = self.step
        start = time.perf_counter()
        # The sampler only orders: the loader reads each step's share, prefetched on GPUs.
        worker_seed = self.args.seed + 1000 * epoch + rank
        for images, labels, index in loader(self.train_set, shares, self.device, worker_seed):
            loss_sum += self._run_batch(images, labels, index, epoch)
            self.step += 1
            if self.step % self.args.log_every == 0 or self.step == steps.stop:
                samples = (self.step - logged) * self.global_batch
                # DDP: add up every rank's loss: the mean over all samples since the last line.
                dist.all_reduce(loss_sum)
                # .item() waits for the device: once per log line.
                print0(
                    f"epoch {epoch + 1}/{self.args.epochs} | step {self.step}/{self.last_step}"
                    f" | loss {loss_sum.item() / samples:.4f} | lr {self.lr:.4g}"
                    f" | {samples / (time.perf_counter() - start):.0f} samples/s"
                )
                loss_sum.zero_()
                logged = self.step
                start = time.perf_counter()
            every = self.args.save_every
            if every and self.step % every == 0 and self.step != steps.stop:
                self._save_checkpoint("last.pt")

    @torch.no_grad()
    def evaluate(self, dataset):
        """Loss, correct and count over the whole dataset, the same on every rank."""
        # DDP: the bare model: a forward through the wrapper may start a collective that
        # processes with fewer test batches never join.
        model = self.model.module
        # DDP: BatchNorm's running statistics differ by rank: all take rank 0's (its checkpoints').
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        model.eval()
        # DDP: process r scores samples r, r+W, r+2W, ... (DistributedSampler would add repeats).
        shard = Subset(dataset, range(self.ddp.rank, len(dataset), self.ddp.world_size))
        totals = torch.zeros(3, device=self.device)
        for images, labels in DataLoader(shard, batch_size=2 * self.args.batch_size):
            y = labels.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, self.amp_dtype, self.amp != "off"):
                logits = model(to_input(images, self.device)).float()
            totals[0] += F.cross_entropy(logits, y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        # DDP: add up every process's sums: each sample counted once.
        dist.all_reduce(totals)
        model.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, correct, count

    def _save_checkpoint(self, filename):
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        rngs = [None] * self.ddp.world_size
        # DDP: every rank's random state, so each takes its own back on resume.
        dist.all_gather_object(rngs, rng)
        state = {
            # DDP: the bare model's weights, without the wrapper's "module." prefix.
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "global_batch": self.global_batch,
            "world_size": self.ddp.world_size,
            "data": self.data_name,
            "rng": rngs,
            # [val_acc, epoch] of the best-k checkpoints, the best first.
            "best": self.best,
        }
        # DDP: every process holds the same weights: rank 0 writes, the others wait.
        save_checkpoint(state, os.path.join(self.args.checkpoint_dir, filename))

    def _keep_best(self, epoch, accuracy):
        """last.pt, and best-epochNNN.pt while the epoch is among the --keep-best best."""
        keep = self.args.keep_best
        ranked = sorted(self.best + [[accuracy, epoch]], key=lambda entry: (-entry[0], entry[1]))
        self.best = ranked[:keep]
        if [accuracy, epoch] in self.best:
            self._save_checkpoint(f"best-epoch{epoch:03d}.pt")
        self._save_checkpoint("last.pt")
        for _, old in ranked[keep:]:
            if self.ddp.rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.args.checkpoint_dir, f"best-epoch{old:03d}.pt"))

    def train(self):
        while self.step < self.last_step:
            epoch = self.step // self.steps_per_epoch
            self._run_epoch(epoch)
            if self.step % self.steps_per_epoch:
                # --max-steps stopped the run inside the epoch.
                self._save_checkpoint("last.pt")
                break
            loss, correct, count = self.evaluate(self.val_set)
            self._keep_best(epoch + 1, correct / count)
            print0(
                f"epoch {epoch + 1}/{self.args.epochs} | val_loss {loss:.4f} | val_acc "
                f"{100 * correct / count:.2f}% ({correct:.0f}/{count:.0f}) | best "
                f"{100 * self.best[0][0]:.2f}%"
            )
        return self.evaluate(self.test_set)


@record
def main():
    args = parse_args()
    # DDP: join the process group; torchrun says which process this is (rank, local rank).
    ddp = setup()
    trainer = Trainer(args, ddp, get_data(args, ddp))
    print0(
        f"start: data {trainer.data_name} | model {args.model} | world {ddp.world_size} | device "
        f"{ddp.device.type} | amp {trainer.amp} | batch {args.batch_size}/micro-batch, "
        f"{trainer.global_batch} global | lr {trainer.peak_lr:g} | steps {trainer.step}->"
        f"{trainer.last_step} of {trainer.total_steps}"
    )
    start = time.perf_counter()
    loss, correct, count = trainer.train()
    print0(
        f"done: data {trainer.data_name} | world {ddp.world_size} | steps {trainer.step} | "
        f"test_loss {loss:.4f} | test_acc {100 * correct / count:.2f}% ({correct:.0f}/{count:.0f})"
        f" | time {time.perf_counter() - start:.1f}s"
    )
    # DDP: drop the wrapper, then leave the process group.
    del trainer
    cleanup()


if __name__ == "__main__":
    main()
