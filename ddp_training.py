"""Lesson 2: the production template. What a real DDP training job needs, in one file.

    torchrun --standalone --nproc_per_node=4 ddp_training.py   # CIFAR-10, ResNet-18 (CPU: --model cnn)

DDP with LR scaling, warm-up + cosine, no_sync accumulation, clipping, bf16 / fp16 + GradScaler,
compile, exact resume, best-k checkpoints, early stopping, exact evaluation, a weight-sync check and
a profiler trace; DDP lines are marked `# DDP:`. To adapt it, replace build_model and load_data.
"""

import argparse
import contextlib
import datetime
import gc
import math
import os
import pickle
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cleanup, fail, load_checkpoint, print0, save_checkpoint, set_seed, setup

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 channel statistics
CIFAR_DIR, CIFAR_FILES = (
    "cifar-10-batches-py",
    [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Lesson 2: the production DDP template (launch with torchrun)"
    )
    a = p.add_argument
    a(
        "--model",
        default="resnet18",
        choices=["resnet18", "cnn", "cnn-bn"],
        help="cnn*: small, for CPUs",
    )
    a(
        "--data",
        default="auto",
        choices=["auto", "cifar10", "synthetic"],
        help="auto: cifar10, else synthetic",
    )
    a("--data-dir", default="./data", help="where cifar-10-batches-py/ is; may be node-local")
    a("--subset", type=int, default=0, help="use the first N train and N/5 test samples (0: all)")
    a("--epochs", type=int, default=30)
    a(
        "--max-steps",
        type=int,
        default=0,
        help="stop after N steps; the schedule still spans --epochs",
    )
    a("--batch-size", type=int, default=128, help="PER RANK and micro-step")
    a("--accum-steps", type=int, default=1, help="micro-steps per optimizer step")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd: momentum 0.9")
    a(
        "--lr",
        type=float,
        default=None,
        help="for ONE process, x world size (default sgd 0.1, cnn 0.01; adamw 1e-3)",
    )
    a("--weight-decay", type=float, default=5e-4)
    a("--warmup-epochs", type=float, default=1.0, help="linear warm-up, then cosine to 0")
    a("--clip-grad", type=float, default=0.0, help="max global gradient norm (0: off)")
    a("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"], help="auto: see pick_amp")
    a("--compile", action="store_true", help="torch.compile the DDP model")
    a("--seed", type=int, default=0, help="for init, data order, augmentation, synthetic data")
    a("--checkpoint-dir", default="./checkpoints", help="for last.pt and best-epochNNN.pt")
    a("--resume", default=None, metavar="PATH|auto", help="a checkpoint, or DIR/last.pt if there")
    a("--save-every", type=int, default=0, help="also save last.pt every N steps (0: epoch ends)")
    a("--keep-best", type=int, default=1, help="keep the K best checkpoints by val_acc")
    a(
        "--patience",
        type=int,
        default=0,
        help="stop after N epochs without a better val_acc (0: off)",
    )
    a(
        "--verify-sync",
        type=int,
        default=0,
        metavar="N",
        help="every N steps compare all ranks' weights",
    )
    a(
        "--profile",
        action="store_true",
        help="trace steps 3-5 of rank 0 into DIR/profile_rank0.json",
    )
    a("--log-every", type=int, default=50, help="steps between log lines")
    a(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: nccl on GPUs, else gloo",
    )
    args = p.parse_args(argv)
    for name, value in vars(args).items():
        low = 1 if name in ("epochs", "batch_size", "accum_steps", "log_every") else 0
        if (
            type(value) in (int, float)
            and value < low
            or name == "lr"
            and value is not None
            and value <= 0
        ):
            p.error(
                f"--{name.replace('_', '-')} must be {'> 0' if name == 'lr' else f'at least {low}'}"
            )
    if (
        args.lr is None
    ):  # BatchNorm lets ResNet take a large step; the plain CNN diverges at 0.1 x W
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.1 if args.model == "resnet18" else 0.01
    return args


def build_model(name):
    """ResNet-18 with the CIFAR stem, or a small CNN (~0.03 M parameters; cnn-bn: with BatchNorm)."""
    if name != "resnet18":
        layers = []
        for c_in, c_out in [
            (3, 16),
            (16, 32),
            (32, 64),
        ]:  # (no conv bias before BN: it takes the mean)
            layers += [
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=name == "cnn"),
                nn.BatchNorm2d(c_out) if name == "cnn-bn" else nn.Identity(),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10))
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=10)
    # ImageNet's stem (7x7 stride-2 conv + max-pool) shrinks 32x32 to 8x8 before the first block.
    model.conv1, model.maxpool = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False), nn.Identity()
    return model


def synthetic_cifar(seed, n_train, n_test):
    """Learnable CIFAR-shaped images, the same on every rank: each class a smooth colour pattern."""
    g = torch.Generator().manual_seed(seed + 12345)
    protos = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=32, mode="bilinear")
    y = torch.randint(0, 10, (n_train + n_test,), generator=g)
    x = torch.cat(
        [
            (protos[c] + 0.25 * torch.randn(len(c), 3, 32, 32, generator=g))
            .clamp(0, 1)
            .mul(255)
            .byte()
            for c in y.split(4096)
        ]
    )  # in chunks: 60,000 float images would take 700 MB
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def load_data(args, ddp):
    """-> name, train (with sample indices: they seed augmentation), val, test. --data-dir may be node-
    local: local rank 0 of EVERY node downloads, each rank reads its own, all agree on one dataset."""
    files, xs, ys, problem = (
        [os.path.join(args.data_dir, CIFAR_DIR, f) for f in CIFAR_FILES],
        [],
        [],
        None,
    )
    if args.data != "synthetic":
        if ddp.local_rank == 0 and not all(
            map(os.path.isfile, files)
        ):  # once per node: ranks downloading
            with contextlib.suppress(
                Exception
            ):  # into one folder corrupt it. Offline? The read says so
                from torchvision.datasets import CIFAR10

                CIFAR10(args.data_dir, train=True, download=True)  # fetch, check the md5, extract
        dist.barrier()  # DDP: the node's other ranks wait for its download
        try:  # the python version: pickled {"data": N x 3072 uint8, "labels": N ints}, 5 train + 1 test
            for file in files:
                with open(file, "rb") as f:
                    entry = pickle.load(f, encoding="latin1")
                xs.append(
                    torch.from_numpy(np.asarray(entry["data"], dtype=np.uint8)).view(-1, 3, 32, 32)
                )
                ys.append(torch.tensor(entry["labels"], dtype=torch.int64))
                if len(xs[-1]) != len(ys[-1]):
                    raise ValueError(f"{file} holds {len(xs[-1])} images but {len(ys[-1])} labels")
        except Exception as e:  # missing, truncated, not CIFAR-10
            problem = f"rank {ddp.rank} (node {ddp.node_rank}) in {args.data_dir}: {' '.join(str(e).split())[:150]}"
    problems = [None] * ddp.world_size
    dist.all_gather_object(problems, problem)  # DDP: every rank learns every rank's outcome
    if bad := [p for p in problems if p]:
        where = f"on {len(bad)} of {ddp.world_size} ranks ({bad[0]})"
        if args.data == "cifar10":
            fail(
                f"CIFAR-10 is not readable {where}: copy it to every node, or use --data synthetic",
                code=1,
            )
        print0(f"warning: no CIFAR-10 {where}; training on synthetic CIFAR-shaped data instead")
    n_train, n_test = args.subset or 50000, max(1, args.subset // 5) if args.subset else 10000
    name = "synthetic" if bad or args.data == "synthetic" else "cifar10"
    (x, y), (tx, ty) = (
        synthetic_cifar(args.seed, n_train, n_test)
        if name == "synthetic"
        else ((torch.cat(xs[:5]), torch.cat(ys[:5])), (xs[5], ys[5]))
    )
    # A fixed 10% held out for validation (seed 0, not --seed: every run validates on the same images).
    order = torch.randperm(min(n_train, len(x)), generator=torch.Generator().manual_seed(0))
    tr, va = order[len(order) // 10 :].sort().values, order[: len(order) // 10].sort().values
    return (
        name,
        TensorDataset(x[tr], y[tr], torch.arange(len(tr))),
        TensorDataset(x[va], y[va]),
        TensorDataset(tx[:n_test], ty[:n_test]),
    )


def to_input(x, norm, augment=None):
    """uint8 images -> normalised floats on norm's device. augment = (index, epoch, seed): a random crop
    and flip per sample, hashed from them: the same on any number of ranks, and after a resume."""
    x = x.to(norm[0].device, non_blocking=True)
    if augment:
        index, epoch, seed = augment
        r = (
            index.to(x.device, non_blocking=True) * 7919 + epoch * 104729 + seed * 1299709 + 1
        ) % 2147483647
        for _ in range(3):  # Lehmer steps: scramble neighbouring indices
            r = r * 48271 % 2147483647
        crops = (
            F.pad(x, (4,) * 4).unfold(2, x.shape[2], 1).unfold(3, x.shape[3], 1)
        )  # (n, c, 9, 9, h, w) view
        x = crops[torch.arange(len(x), device=x.device), :, r % 9, r // 9 % 9]  # each sample's crop
        x = torch.where((r // 81 % 2).bool()[:, None, None, None], x.flip(3), x)  # and flip
    return (x.contiguous(memory_format=torch.channels_last).float().div_(255) - norm[0]) / norm[1]


def pick_amp(choice, device):
    """auto: bf16 where the GPU has it natively (not emulated: T4), else fp16 + GradScaler; CPU: off."""
    if choice != "auto" or device.type != "cuda":
        return "off" if choice == "auto" else choice
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def train_step(ddp_model, forward, optimizer, scaler, micro_batches, amp_dtype, clip_grad):
    """One step over (x, y) micro-batches (forward: ddp_model, or compiled); (loss sum, correct)."""
    optimizer.zero_grad(
        set_to_none=False
    )  # DDP: in place; None would drop the bucket views (a copy per step)
    n, device = len(micro_batches), micro_batches[0][0].device
    stats = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(micro_batches):
        # DDP: no_sync must cover the forward too: DDP decides in forward whether the coming
        # backward all-reduces. Wrapping only backward() still communicates on every micro-step.
        with ddp_model.no_sync() if i < n - 1 else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = forward(x)
                loss = F.cross_entropy(logits, y)
            scaler.scale(loss / n).backward()  # / n: the sum over micro-steps is the mean
        stats += torch.stack(
            [loss.detach().float() * len(y), (logits.argmax(1) == y).sum().float()]
        )
    if clip_grad:
        scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the loss-scaled ones
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), clip_grad)  # same on every rank
    scaler.step(optimizer)  # fp16: skips the step if any gradient is inf/nan (scale too high)
    scaler.update()
    return stats


def sync_buffers(model):
    """DDP: BatchNorm statistics are buffers each rank updates from its own batches (DDP copies rank
    0's when a training forward starts). Before evaluating or saving, all ranks take rank 0's."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(job, dataset):
    """Exact: rank r takes samples r, r+W, ... (no padding repeats), sums are all-reduced. On the bare
    model.module: shards differ by a batch, and a DDP forward may run a collective (a hang)."""
    model, ddp, amp_dtype = job.model, job.ddp, job.amp_dtype
    sync_buffers(model)
    model.eval()
    totals = torch.zeros(3, device=ddp.device, dtype=torch.float64)  # loss sum, correct, count
    for x, y in DataLoader(
        Subset(dataset, range(ddp.rank, len(dataset), ddp.world_size)), 2 * job.args.batch_size
    ):
        x, y = to_input(x, job.norm), y.to(ddp.device, non_blocking=True)
        with torch.autocast(ddp.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x).float()
        totals[0] += F.cross_entropy(logits, y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(y)  # a Python number: no tensor built and copied to the device every batch
    dist.all_reduce(totals)  # DDP: sum over the shards
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), int(correct), int(count)


@torch.no_grad()
def verify_sync(model):
    """None if all ranks' weights are bitwise equal, else (first differing name, max |difference|)."""
    named = list(model.named_parameters())
    both = torch.cat([p.detach().reshape(-1).double() for _, p in named]).repeat(2, 1)
    both[1].neg_()
    dist.all_reduce(
        both, op=dist.ReduceOp.MAX
    )  # DDP: max and -min over ranks, the same on every rank
    diff = (both[0] + both[1]).nan_to_num(nan=float("inf"))  # max - min; NaN counts as a difference
    for (name, _), d in zip(named, diff.split([p.numel() for _, p in named])):
        if bool(d.any()):
            return name, float(d.max())


def save(job, filename):
    """Every rank calls this (it gathers); global rank 0 writes the file atomically."""
    sync_buffers(job.model)
    rngs = [None] * job.ddp.world_size  # DDP: every rank's random generators, for an exact resume
    cuda = [torch.cuda.get_rng_state()] if job.ddp.device.type == "cuda" else []
    dist.all_gather_object(rngs, [torch.get_rng_state()] + cuda)
    save_checkpoint(
        {
            "model": job.model.state_dict(),
            "optimizer": job.optimizer.state_dict(),
            "scheduler": job.scheduler.state_dict(),
            "scaler": job.scaler.state_dict(),
            "rng": rngs,
            "world_size": job.ddp.world_size,
            "args": vars(job.args),
            **job.state,
        },
        os.path.join(job.args.checkpoint_dir, filename),
    )


def resume(job):
    """--resume PATH|auto, before the DDP wrap. All ranks must agree: with node-local disks some may
    lack last.pt, and a rank starting fresh beside resumed ones trains other steps, then hangs."""
    args, ddp, state = job.args, job.ddp, job.state
    path = os.path.join(args.checkpoint_dir, "last.pt") if args.resume == "auto" else args.resume
    path = None if args.resume == "auto" and not os.path.isfile(path) else path
    # To the CPU (no GPU holds a second copy); load_state_dict copies it to the model's device.
    ckpt = path and load_checkpoint(
        path, model=job.model, optimizer=job.optimizer, scheduler=job.scheduler, scaler=job.scaler
    )
    found = [None] * ddp.world_size
    dist.all_gather_object(found, ckpt and (ckpt["step"], ckpt["world_size"]))  # DDP: compare
    if len(set(found)) > 1:
        fail(
            f"ranks found different checkpoints to resume from ((step, world size) by rank: {found}): give every "
            "node the same one (a shared --checkpoint-dir, or a copy on each), or remove them all",
            code=1,
        )
    if not ckpt:
        return (
            print0(f"resume: no {args.checkpoint_dir}/last.pt yet; starting from scratch")
            if args.resume
            else None
        )
    # Steps count global batches and the schedule saved lr x world size: both change with the world.
    saved = ckpt["args"]["batch_size"] * ckpt["args"]["accum_steps"] * ckpt["world_size"]
    if saved != job.global_batch or ckpt["world_size"] != ddp.world_size:
        fail(
            f"{path} was saved by {ckpt['world_size']} ranks with a global batch of {saved}; this run has "
            f"{ddp.world_size} and {job.global_batch}. Resume with the same world size and batch",
            code=2,
        )
    state.update({k: ckpt[k] for k in state})
    torch.set_rng_state(ckpt["rng"][ddp.rank][0])  # DDP: each rank its own generators
    if ddp.device.type == "cuda":
        torch.cuda.set_rng_state(ckpt["rng"][ddp.rank][1])
    print0(f"resume: {path} at epoch {min(state['epoch'] + 1, args.epochs)}, step {state['step']}")


def build(args, ddp):
    """Data, model, optimizer, schedule and progress (restored by --resume), then the DDP wrap."""
    job = SimpleNamespace(args=args, ddp=ddp, amp=pick_amp(args.amp, ddp.device), loss=float("nan"))
    job.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.amp)
    job.dataset, job.train_set, job.val_set, job.test_set = load_data(args, ddp)
    job.norm = [torch.tensor(v, device=ddp.device).view(1, 3, 1, 1) for v in (MEAN, STD)]
    # DDP: each rank reads its own 1/world_size of the shuffled indices; the padded shards and drop_last
    # give every rank the same number of steps (a mismatch would hang in all-reduce).
    job.sampler = DistributedSampler(
        job.train_set, ddp.world_size, ddp.rank, shuffle=True, seed=args.seed
    )
    job.global_batch = args.batch_size * args.accum_steps * ddp.world_size
    job.steps_per_epoch = len(job.sampler) // args.batch_size // args.accum_steps
    if job.steps_per_epoch == 0:
        fail(
            f"{len(job.train_set)} training samples give each of {ddp.world_size} ranks {len(job.sampler)}, "
            f"less than one step of {args.batch_size} x {args.accum_steps}: lower --batch-size or --accum-steps"
        )
    job.total_steps = args.epochs * job.steps_per_epoch
    job.run_steps = min(job.total_steps, args.max_steps or job.total_steps)
    job.world_lr = args.lr * ddp.world_size  # linear scaling rule: W x the batch, W x the LR
    job.model = build_model(args.model).to(
        ddp.device, memory_format=torch.channels_last
    )  # NHWC: faster convs
    opt = dict(
        lr=job.world_lr, weight_decay=args.weight_decay, fused=True
    )  # fused: 1 kernel (CPU too)
    job.optimizer = (
        torch.optim.SGD(job.model.parameters(), momentum=0.9, **opt)
        if args.optimizer == "sgd"
        else torch.optim.AdamW(job.model.parameters(), **opt)
    )
    warm, total = (
        min(job.total_steps, round(args.warmup_epochs * job.steps_per_epoch)),
        job.total_steps,
    )

    def factor(s):  # linear warm-up, then cosine decay to 0
        return (
            (s + 1) / warm
            if s < warm
            else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))
        )

    job.scheduler = torch.optim.lr_scheduler.LambdaLR(job.optimizer, factor)
    job.scaler = torch.amp.GradScaler(ddp.device.type, enabled=job.amp == "fp16")
    job.state = {
        "epoch": 0,
        "epoch_step": 0,
        "step": 0,
        "best_acc": -1.0,
        "bad_epochs": 0,
        "best": [],
    }
    resume(job)
    # DDP: broadcasts rank 0's weights; in backward, averages gradients in buckets, overlapped (.grads: bucket views)
    job.ddp_model = DDP(
        job.model,
        device_ids=[ddp.device.index] if ddp.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    # DDP first, then compile: the compiler sees DDP's buckets and overlaps their all-reduce with backward.
    job.forward = torch.compile(job.ddp_model) if args.compile else job.ddp_model
    return job


def train_epoch(job):
    """Optimizer steps to the end of the epoch or to --max-steps; True if the epoch ended."""
    args, ddp, state = job.args, job.ddp, job.state
    epoch, on_gpu = state["epoch"], ddp.device.type == "cuda"
    job.sampler.set_epoch(epoch)  # DDP: else every epoch repeats epoch 0's order
    order = list(job.sampler)[
        state["epoch_step"] * args.accum_steps * args.batch_size :
    ]  # resumed: skip
    rng = torch.Generator().manual_seed(
        args.seed * 100003 + epoch * 1009 + ddp.rank
    )  # workers' seeds: not global
    batches = iter(
        DataLoader(
            job.train_set,
            args.batch_size,
            sampler=order,
            drop_last=True,
            generator=rng,
            num_workers=4 * on_gpu,
            pin_memory=on_gpu,
        )
    )  # workers: on GPUs, keep it fed
    job.t_log, job.n_seen, job.stats = time.perf_counter(), 0, torch.zeros(2, device=ddp.device)
    while state["epoch_step"] < job.steps_per_epoch and state["step"] < job.run_steps:
        micro = [
            (to_input(x, job.norm, (i, epoch, args.seed)), y.to(ddp.device, non_blocking=True))
            for x, y, i in (next(batches) for _ in range(args.accum_steps))
        ]
        job.stats += train_step(
            job.ddp_model,
            job.forward,
            job.optimizer,
            job.scaler,
            micro,
            job.amp_dtype,
            args.clip_grad,
        )
        job.scheduler.step()
        job.n_seen += args.batch_size * args.accum_steps
        state["step"], state["epoch_step"] = state["step"] + 1, state["epoch_step"] + 1
        step = state["step"]
        if job.prof:
            job.prof.step()
        if args.verify_sync and step % args.verify_sync == 0 and (bad := verify_sync(job.model)):
            fail(
                f"parameters differ across ranks at step {step}: first '{bad[0]}' (max difference "
                f"{bad[1]:.3g}). A rank changed its weights outside DDP's all-reduce",
                code=1,
            )
        if (
            step % args.log_every == 0
            or step == job.run_steps
            or state["epoch_step"] == job.steps_per_epoch
        ):
            dist.all_reduce(
                job.stats
            )  # DDP: global loss and accuracy; the loop's only wait for the device
            (loss_sum, correct), count, now = (
                job.stats.tolist(),
                job.n_seen * ddp.world_size,
                time.perf_counter(),
            )
            job.loss, eta = (
                loss_sum / count,
                (job.run_steps - step) * (now - job.t_start) / (step - job.start_step),
            )
            print0(
                f"epoch {epoch + 1}/{args.epochs} | step {step}/{job.run_steps} | loss {job.loss:.4f} | acc "
                f"{100 * correct / count:.2f}% | lr {job.scheduler.get_last_lr()[0]:.4g} | "
                f"{count / (now - job.t_log):.0f} samples/s | eta {datetime.timedelta(seconds=round(eta))}"
            )
            job.t_log, job.n_seen = now, 0
            job.stats.zero_()
        if (
            args.save_every
            and step % args.save_every == 0
            and state["epoch_step"] < job.steps_per_epoch
        ):
            save(job, "last.pt")
    return state["epoch_step"] == job.steps_per_epoch


def end_epoch(job, epoch):
    """Validate, keep the best-k checkpoints, decide early stopping; returns True to stop."""
    args, ddp, state = job.args, job.ddp, job.state
    val_loss, job.val_acc, correct, count = evaluate(job, job.val_set)
    state["bad_epochs"] = 0 if job.val_acc > state["best_acc"] else state["bad_epochs"] + 1
    state["best_acc"] = max(state["best_acc"], job.val_acc)
    # DDP: rank 0 decides for all: a rank that stopped alone would leave the others waiting forever.
    stop = torch.tensor(
        [bool(args.patience) and state["bad_epochs"] >= args.patience], device=ddp.device
    )
    dist.broadcast(stop, src=0)
    state["epoch"], state["epoch_step"] = epoch + 1, 0
    best = (
        f"best-epoch{epoch + 1:03d}.pt"  # best-k: highest accuracy first, the earlier epoch on ties
    )
    ranked = sorted(state["best"] + [[job.val_acc, epoch + 1, best]], key=lambda b: (-b[0], b[1]))
    state["best"], evicted = ranked[: args.keep_best], [b[2] for b in ranked[args.keep_best :]]
    print0(
        f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | val_acc {100 * job.val_acc:.2f}% "
        f"({correct}/{count}) | best {100 * state['best_acc']:.2f}%"
        + (" | early stop" if stop else "")
    )
    save(job, "last.pt")
    if best not in evicted:
        save(job, best)
    for name in evicted if ddp.is_main else []:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.checkpoint_dir, name))
    return bool(stop)


def main(argv=None):
    """Train; returns the progress state and final metrics (the tests call this under mp.spawn)."""
    args = parse_args(argv)
    ddp = setup(args.backend)  # DDP: join the process group; pick this rank's device
    set_seed(
        args.seed
    )  # the same seed everywhere: the same initial weights (DDP broadcasts them too)
    job = build(args, ddp)
    state, job.prof = job.state, None
    print0(
        f"start: data {job.dataset} | model {args.model} | train {len(job.train_set)} | val {len(job.val_set)} "
        f"| test {len(job.test_set)} | world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} "
        f"| amp {job.amp} | batch {args.batch_size}/rank x {args.accum_steps} accum, {job.global_batch} global "
        f"| lr {job.world_lr:g} | steps {state['step']}->{job.run_steps} of {job.total_steps}"
    )
    if (
        args.profile and ddp.is_main
    ):  # steps 3-5 of rank 0 -> a Chrome trace (https://ui.perfetto.dev)
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        trace = os.path.join(args.checkpoint_dir, "profile_rank0.json")
        job.prof = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(trace),
        )
    job.t_start, job.start_step, job.val_acc = time.perf_counter(), state["step"], float("nan")
    stop = (
        bool(args.patience) and state["bad_epochs"] >= args.patience
    )  # resumed after an early stop
    with job.prof or contextlib.nullcontext():
        while state["epoch"] < args.epochs and state["step"] < job.run_steps and not stop:
            if not train_epoch(job):  # --max-steps stopped it inside the epoch
                save(job, "last.pt")
                break
            stop = end_epoch(job, state["epoch"])
    if state["step"] == job.start_step or state["epoch_step"]:  # no epoch ended in this run
        job.val_acc = evaluate(job, job.val_set)[1]
    _, test_acc, correct, count = evaluate(job, job.test_set)
    print0(
        f"done: data {job.dataset} | model {args.model} | world {ddp.world_size} | backend {ddp.backend} "
        f"| device {ddp.device.type} | epochs {state['epoch']} | steps {state['step']} | loss {job.loss:.4f} "
        f"| val_acc {100 * job.val_acc:.2f}% | best_val_acc {100 * max(state['best_acc'], 0):.2f}% "
        f"| test_acc {100 * test_acc:.2f}% ({correct}/{count}) | time {time.perf_counter() - job.t_start:.1f}s"
    )
    # DDP: free the wrapper (a reference cycle, hence gc) before leaving the group: on gloo a DDP that
    # never ran a backward (a finished run resumed) can abort the process at exit.
    del job.forward, job.ddp_model
    gc.collect()
    cleanup()
    return {
        **state,
        "dataset": job.dataset,
        "loss": job.loss,
        "val_acc": job.val_acc,
        "test_acc": test_acc,
        "test_count": count,
    }


if __name__ == "__main__":
    main()
