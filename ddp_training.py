"""Lesson 2: the production template. What a real DDP training job needs.

    torchrun --standalone --nproc_per_node=4 ddp_training.py   # CIFAR-10, ResNet-18
    torchrun --standalone --nproc_per_node=2 ddp_training.py --model cnn   # on a CPU

A fixed global batch (the accumulation steps absorb the world size, so a run resumes on any
number of ranks), the LR scaled by that batch, no_sync accumulation, clipping, bf16 / fp16 +
GradScaler, compile, exact resume, exact evaluation, best-k checkpoints, early stopping. DDP lines
are marked `# DDP:`. Beside it: training_data.py (the data, the models, augmentation: replace it
to adapt the template) and training_run.py (flags, schedule, best-k files, checkpoint checks,
the weight-sync check, the profiler).
"""

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_checkpoint import load_checkpoint, save_checkpoint
from ddp_common import cleanup, fail, print0, set_seed, setup
from ddp_extras import pick_amp
from training_data import MEAN, STD, build_model, load_data, to_input
from training_run import (
    best_name,
    build_optimizer,
    check_in_sync,
    check_progress,
    fresh_progress,
    parse_args,
    record_epoch,
    remove_best,
    resume_path,
    scaled_lr,
    start_profiler,
    warmup_cosine,
)


def train_step(ddp_model, forward, optimizer, scaler, micro_batches, amp_dtype, clip_grad):
    """One optimizer step over (x, y) micro-batches (forward: ddp_model, or compiled).
    Returns (loss sum, correct) on the device."""
    # DDP: zero in place; None would drop the bucket views (a copy per step).
    optimizer.zero_grad(set_to_none=False)
    n = len(micro_batches)
    device = micro_batches[0][0].device
    stats = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(micro_batches):
        # DDP: no_sync must cover the forward too: DDP decides in forward whether the coming
        # backward all-reduces. Wrapping only backward() still communicates on every micro-step.
        sync = contextlib.nullcontext()
        if i < n - 1:
            sync = ddp_model.no_sync()
        with sync:
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = forward(x)
                loss = F.cross_entropy(logits, y)
            # / n: the sum over micro-steps is the mean; DDP averages over the ranks.
            scaler.scale(loss / n).backward()
        correct = (logits.argmax(1) == y).sum()
        stats += torch.stack([loss.detach().float() * len(y), correct.float()])
    if clip_grad:
        # fp16: clip the true gradients, not the loss-scaled ones.
        scaler.unscale_(optimizer)
        # The gradients are all-reduced: every rank computes the same norm.
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), clip_grad)
    # fp16: skips the step if any gradient is inf/nan (the scale was too high).
    scaler.step(optimizer)
    scaler.update()
    return stats


def sync_buffers(model):
    """DDP: BatchNorm statistics are buffers each rank updates from its own batches (DDP copies
    rank 0's when a training forward starts). Before evaluating or saving, all take rank 0's."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(model, dataset, ddp, norm, amp_dtype, batch_size):
    """Exact: rank r takes samples r, r+W, ... (no padding repeats), sums are all-reduced. On the
    bare model: shards differ by a batch, and a DDP forward may run a collective (a hang)."""
    sync_buffers(model)
    model.eval()
    # Loss sum, correct, count.
    totals = torch.zeros(3, device=ddp.device, dtype=torch.float64)
    shard = Subset(dataset, range(ddp.rank, len(dataset), ddp.world_size))
    for images, labels in DataLoader(shard, batch_size):
        x = to_input(images, norm)
        y = labels.to(ddp.device, non_blocking=True)
        with torch.autocast(ddp.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x).float()
        totals[0] += F.cross_entropy(logits, y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        # A Python number: no tensor built and copied to the device every batch.
        totals[2] += len(y)
    # DDP: sum over the shards
    dist.all_reduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), int(correct), int(count)


class Trainer:
    """The run: built once, then fit(). Progress is a dict of counts, saved in every checkpoint."""

    def __init__(self, args, ddp):
        self.args = args
        self.ddp = ddp
        self.amp = pick_amp(args.amp, ddp.device)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.amp)
        self.dataset, self.train_set, self.val_set, self.test_set = load_data(
            args.data, args.data_dir, args.subset, args.seed, ddp
        )
        self.norm = [torch.tensor(v, device=ddp.device).view(1, 3, 1, 1) for v in (MEAN, STD)]
        self.plan_batches()
        # DDP: each rank reads its own 1/world_size of the shuffled indices (train_epoch).
        self.sampler = DistributedSampler(
            self.train_set, ddp.world_size, ddp.rank, shuffle=True, seed=args.seed
        )
        # NHWC: faster convolutions on GPUs (tensor cores) and CPUs (oneDNN).
        self.model = build_model(args.model).to(ddp.device, memory_format=torch.channels_last)
        self.lr = scaled_lr(args, self.global_batch)
        self.optimizer = build_optimizer(self.model, args, self.lr)
        # The schedule counts optimizer steps: the same on any world size.
        warmup = min(self.total_steps, round(args.warmup_epochs * self.steps_per_epoch))
        self.scheduler = warmup_cosine(self.optimizer, warmup, self.total_steps)
        self.scaler = torch.amp.GradScaler(ddp.device.type, enabled=self.amp == "fp16")
        self.progress = fresh_progress()
        self.resume()
        # DDP: broadcasts rank 0's weights; in backward, averages the gradients in buckets,
        # overlapped with the backward pass (.grad tensors become views into the buckets).
        device_ids = None
        if ddp.device.type == "cuda":
            device_ids = [ddp.device.index]
        self.ddp_model = DDP(self.model, device_ids=device_ids, gradient_as_bucket_view=True)
        # DDP first, then compile: the compiler sees DDP's buckets and overlaps their all-reduce.
        self.forward = self.ddp_model
        if args.compile:
            self.forward = torch.compile(self.ddp_model)
        self.loss = float("nan")
        self.val_acc = float("nan")
        self.profiler = None

    def plan_batches(self):
        """The global batch G is fixed; the accumulation steps absorb the world size."""
        args = self.args
        per_step = args.batch_size * self.ddp.world_size
        self.accum_steps = args.accum_steps
        self.global_batch = per_step * args.accum_steps
        if args.global_batch_size:
            if args.global_batch_size % per_step:
                fail(
                    f"--global-batch-size {args.global_batch_size} is not a multiple of "
                    f"{self.ddp.world_size} ranks x --batch-size {args.batch_size}",
                    rank0_only=True,
                )
            self.global_batch = args.global_batch_size
            self.accum_steps = self.global_batch // per_step
        # An epoch is every whole global batch of the training set, on any world size.
        self.steps_per_epoch = len(self.train_set) // self.global_batch
        self.epoch_size = self.steps_per_epoch * self.global_batch
        if self.steps_per_epoch == 0:
            fail(
                f"{len(self.train_set)} training samples are fewer than one global batch of "
                f"{self.global_batch}: lower --batch-size, --accum-steps or --global-batch-size",
                rank0_only=True,
            )
        self.total_steps = args.epochs * self.steps_per_epoch
        self.run_steps = min(self.total_steps, args.max_steps or self.total_steps)

    def resume(self):
        """--resume PATH|auto, before the DDP wrap. All ranks must agree: with node-local disks
        some may lack last.pt, and a rank starting fresh beside resumed ones hangs later."""
        args = self.args
        path = resume_path(args.resume, args.checkpoint_dir)
        ckpt = None
        found = None
        if path:
            # To the CPU (no GPU holds a second copy); load_state_dict copies to the device.
            targets = ["model", "optimizer", "scheduler", "scaler"]
            ckpt = load_checkpoint(path, **{name: getattr(self, name) for name in targets})
            found = (ckpt.get("step"), ckpt.get("global_batch"))
        everyone = [None] * self.ddp.world_size
        # DDP: what did every rank find?
        dist.all_gather_object(everyone, found)
        if len(set(everyone)) > 1:
            fail(
                f"ranks found different checkpoints ((step, global batch) by rank: {everyone}): "
                "give every node the same one (a shared --checkpoint-dir), or remove them all",
                code=1,
            )
        if ckpt is None:
            if args.resume:
                print0(f"resume: no {args.checkpoint_dir}/last.pt yet; starting from scratch")
            return
        check_progress(ckpt, path)
        # A step is one global batch: with another one, step counts and positions mean other
        # samples. The world size may change: the accumulation steps absorb it.
        if ckpt["global_batch"] != self.global_batch:
            fail(
                f"{path} was saved with a global batch of {ckpt['global_batch']}, this run has "
                f"{self.global_batch}: resume with --global-batch-size {ckpt['global_batch']}",
                rank0_only=True,
            )
        for key in self.progress:
            self.progress[key] = ckpt[key]
        # Each rank its own generators; on another world size there is no rank-for-rank match
        # (nothing here draws random numbers while training: augmentation is a hash).
        if ckpt["world_size"] == self.ddp.world_size:
            states = ckpt["rng"][self.ddp.rank]
            torch.set_rng_state(states[0])
            # (A checkpoint saved on CPUs holds no CUDA generator.)
            if self.ddp.device.type == "cuda" and len(states) > 1:
                torch.cuda.set_rng_state(states[1])
        epoch = min(self.progress["epoch"] + 1, args.epochs)
        print0(
            f"resume: {path} at epoch {epoch}, step {self.progress['step']}, saved by "
            f"{ckpt['world_size']} ranks"
        )

    def save(self, filename):
        """Every rank calls this (it gathers); global rank 0 writes the file atomically."""
        sync_buffers(self.model)
        # DDP: every rank's random generators, for an exact resume.
        rngs = [None] * self.ddp.world_size
        mine = [torch.get_rng_state()]
        if self.ddp.device.type == "cuda":
            mine.append(torch.cuda.get_rng_state())
        dist.all_gather_object(rngs, mine)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rngs,
            "global_batch": self.global_batch,
            "world_size": self.ddp.world_size,
            "args": vars(self.args),
            **self.progress,
        }
        save_checkpoint(state, os.path.join(self.args.checkpoint_dir, filename))

    def train_epoch(self):
        """Optimizer steps to the end of the epoch or to --max-steps; True if the epoch ended."""
        args = self.args
        ddp = self.ddp
        progress = self.progress
        epoch = progress["epoch"]
        # DDP: else every epoch repeats epoch 0's order
        self.sampler.set_epoch(epoch)
        # DDP: rank r holds positions r, r+W, r+2W, ... of the epoch's permutation, so the global
        # batch of step s (positions sG .. (s+1)G) is items sG/W .. (s+1)G/W of every rank's
        # shard, on any world size. A resume starts at the first global sample not yet seen.
        start = progress["epoch_samples"] // ddp.world_size
        end = self.epoch_size // ddp.world_size
        shard = list(self.sampler)[start:end]
        on_gpu = ddp.device.type == "cuda"
        # Seeds for the workers from a generator of our own: the global one is left untouched.
        generator = torch.Generator().manual_seed(args.seed * 100003 + epoch * 1009 + ddp.rank)
        loader = DataLoader(
            self.train_set,
            args.batch_size,
            sampler=shard,
            generator=generator,
            num_workers=4 * on_gpu,
            pin_memory=on_gpu,
        )
        self.stats = torch.zeros(2, device=ddp.device)
        self.log_time = time.perf_counter()
        self.log_samples = 0
        micro = []
        for images, labels, index in loader:
            x = to_input(images, self.norm, (index, epoch, args.seed))
            micro.append((x, labels.to(ddp.device, non_blocking=True)))
            if len(micro) < self.accum_steps:
                continue
            self.stats += train_step(
                self.ddp_model,
                self.forward,
                self.optimizer,
                self.scaler,
                micro,
                self.amp_dtype,
                args.clip_grad,
            )
            micro = []
            self.scheduler.step()
            progress["step"] += 1
            progress["epoch_samples"] += self.global_batch
            self.log_samples += self.global_batch
            self.after_step()
            if progress["step"] == self.run_steps:
                break
        return progress["epoch_samples"] == self.epoch_size

    def after_step(self):
        """The profiler, the sync check, a log line, a save: each when it is due."""
        args = self.args
        step = self.progress["step"]
        epoch_done = self.progress["epoch_samples"] == self.epoch_size
        if self.profiler:
            self.profiler.step()
        if args.verify_sync and step % args.verify_sync == 0:
            check_in_sync(self.model, step)
        if step % args.log_every == 0 or step == self.run_steps or epoch_done:
            self.log()
        if args.save_every and step % args.save_every == 0 and not epoch_done:
            self.save("last.pt")

    def log(self):
        """One line: the training loss and accuracy since the last line, over all ranks."""
        # DDP: global loss and accuracy; the loop's only wait for the device.
        dist.all_reduce(self.stats)
        loss_sum, correct = self.stats.tolist()
        now = time.perf_counter()
        step = self.progress["step"]
        self.loss = loss_sum / self.log_samples
        eta = (self.run_steps - step) * (now - self.start_time) / (step - self.start_step)
        print0(
            f"epoch {self.progress['epoch'] + 1}/{self.args.epochs} | step {step}/{self.run_steps}"
            f" | loss {self.loss:.4f} | acc {100 * correct / self.log_samples:.2f}%"
            f" | lr {self.scheduler.get_last_lr()[0]:.4g}"
            f" | {self.log_samples / (now - self.log_time):.0f} samples/s"
            f" | eta {datetime.timedelta(seconds=round(eta))}"
        )
        self.log_time = now
        self.log_samples = 0
        self.stats.zero_()

    def evaluate_on(self, dataset):
        """Loss, accuracy, correct and count over the whole dataset, the same on every rank."""
        batch_size = 2 * self.args.batch_size
        return evaluate(self.model, dataset, self.ddp, self.norm, self.amp_dtype, batch_size)

    def end_epoch(self):
        """Validate, keep the best-k checkpoints, decide early stopping; True to stop."""
        args = self.args
        progress = self.progress
        val_loss, self.val_acc, correct, count = self.evaluate_on(self.val_set)
        evicted = record_epoch(progress, self.val_acc, args.keep_best)
        epoch = progress["epoch"]
        # DDP: rank 0 decides for all: a rank that stopped alone would leave the others waiting.
        patience_out = args.patience > 0 and progress["bad_epochs"] >= args.patience
        stop = torch.tensor([patience_out], device=self.ddp.device)
        dist.broadcast(stop, src=0)
        line = f"epoch {epoch}/{args.epochs} | val_loss {val_loss:.4f}"
        line += f" | val_acc {100 * self.val_acc:.2f}% ({correct}/{count})"
        line += f" | best {100 * progress['best_acc']:.2f}%"
        if stop:
            line += " | early stop"
        print0(line)
        self.save("last.pt")
        if [self.val_acc, epoch] in progress["best"]:
            self.save(best_name(epoch))
        if self.ddp.is_main:
            remove_best(args.checkpoint_dir, evicted)
        return bool(stop)

    def fit(self):
        """Train to the end (or --max-steps, or early stopping), then test; returns the results."""
        args = self.args
        ddp = self.ddp
        progress = self.progress
        print0(
            f"start: data {self.dataset} | model {args.model} | train {len(self.train_set)}"
            f" | val {len(self.val_set)} | test {len(self.test_set)} | world {ddp.world_size}"
            f" | backend {ddp.backend} | device {ddp.device.type} | amp {self.amp}"
            f" | batch {args.batch_size}/rank x {self.accum_steps} accum"
            f", {self.global_batch} global"
            f" | lr {self.lr:g} | steps {progress['step']}->{self.run_steps} of {self.total_steps}"
        )
        if args.profile and ddp.is_main:
            self.profiler = start_profiler(args.checkpoint_dir)
        self.start_time = time.perf_counter()
        self.start_step = progress["step"]
        # A run resumed after an early stop has nothing left to do.
        stop = args.patience > 0 and progress["bad_epochs"] >= args.patience
        with self.profiler or contextlib.nullcontext():
            while (
                progress["epoch"] < args.epochs and progress["step"] < self.run_steps and not stop
            ):
                if not self.train_epoch():
                    # --max-steps stopped it inside the epoch.
                    self.save("last.pt")
                    break
                stop = self.end_epoch()
        # No epoch ended in this run: validate now.
        if progress["step"] == self.start_step or progress["epoch_samples"]:
            self.val_acc = self.evaluate_on(self.val_set)[1]
        _, test_acc, correct, count = self.evaluate_on(self.test_set)
        best = max(progress["best_acc"], 0)
        print0(
            f"done: data {self.dataset} | model {args.model} | world {ddp.world_size}"
            f" | backend {ddp.backend} | device {ddp.device.type} | epochs {progress['epoch']}"
            f" | steps {progress['step']} | loss {self.loss:.4f}"
            f" | val_acc {100 * self.val_acc:.2f}% | best_val_acc {100 * best:.2f}%"
            f" | test_acc {100 * test_acc:.2f}% ({correct}/{count})"
            f" | time {time.perf_counter() - self.start_time:.1f}s"
        )
        return {
            **progress,
            "dataset": self.dataset,
            "loss": self.loss,
            "val_acc": self.val_acc,
            "test_acc": test_acc,
            "test_count": count,
        }


@record
def main(argv=None):
    """Train; returns the progress and final metrics (the tests call this under mp.spawn)."""
    args = parse_args(argv)
    # DDP: join the process group; pick this rank's device
    ddp = setup(args.backend)
    # The same seed everywhere: the same initial weights (DDP broadcasts rank 0's too).
    set_seed(args.seed)
    trainer = Trainer(args, ddp)
    results = trainer.fit()
    # DDP: free the wrapper before leaving the group: on gloo a DDP that never ran a backward
    # (a finished run resumed) can abort the process at exit. cleanup() collects its cycles.
    del trainer
    cleanup()
    return results


if __name__ == "__main__":
    main()
