"""Lesson 2's bookkeeping around the DDP lines (ddp_training.py imports it): the flags, the LR
schedule, the best-k checkpoint files and the checks on a loaded checkpoint, the profiler."""

import argparse
import contextlib
import math
import os

import torch
import torch.distributed as dist

from ddp_common import fail

# --lr is the learning rate of a global batch of this many samples; see scaled_lr.
REFERENCE_BATCH = 256


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 2: the production DDP template")
    parser.add_argument(
        "--model", default="resnet18", choices=["resnet18", "cnn", "cnn-bn"], help="cnn*: for CPUs"
    )
    parser.add_argument(
        "--data",
        default="auto",
        choices=["auto", "cifar10", "synthetic"],
        help="auto: cifar10, else synthetic",
    )
    parser.add_argument(
        "--data-dir", default="./data", help="holds cifar-10-batches-py/; may be node-local"
    )
    parser.add_argument(
        "--subset", type=int, default=0, help="the first N train and N/5 test images (0: all)"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after N steps; the schedule still spans --epochs",
    )
    parser.add_argument("--batch-size", type=int, default=128, help="PER RANK and micro-step")
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=0,
        help="samples per optimizer step, kept on any world size: the accumulation steps "
        "follow (0: batch size x world size x --accum-steps)",
    )
    parser.add_argument("--accum-steps", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument(
        "--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd: momentum 0.9"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"the LR at a global batch of {REFERENCE_BATCH}, scaled to this run's by --lr-scaling "
        "(default sgd 0.1, cnn 0.04; adamw 1e-3)",
    )
    parser.add_argument(
        "--lr-scaling",
        default="auto",
        choices=["auto", "linear", "sqrt", "none"],
        help=f"--lr x (global batch / {REFERENCE_BATCH}), or its square root; "
        "auto: linear for sgd, sqrt for adamw",
    )
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument(
        "--warmup-epochs", type=float, default=1.0, help="linear warm-up, then cosine to 0"
    )
    parser.add_argument(
        "--clip-grad", type=float, default=0.0, help="max global gradient norm (0: off)"
    )
    parser.add_argument(
        "--amp",
        default="auto",
        choices=["auto", "bf16", "fp16", "off"],
        help="auto: bf16 or fp16 on GPUs",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument(
        "--seed", type=int, default=0, help="init, data order, augmentation, synthetic data"
    )
    parser.add_argument(
        "--checkpoint-dir", default="./checkpoints", help="for last.pt and best-epochNNN.pt"
    )
    parser.add_argument(
        "--resume", default=None, metavar="PATH|auto", help="a checkpoint, or DIR/last.pt if there"
    )
    parser.add_argument("--save-every", type=int, default=0, help="also save last.pt every N steps")
    parser.add_argument(
        "--keep-best", type=int, default=1, help="keep the K best checkpoints by val_acc"
    )
    parser.add_argument(
        "--patience",
        type=int,
        default=0,
        help="stop after N epochs without a better val_acc (0: off)",
    )
    parser.add_argument(
        "--verify-sync",
        type=int,
        default=0,
        metavar="N",
        help="every N steps compare all ranks' weights",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="trace steps 3-5 of rank 0 into DIR/profile_rank0.json",
    )
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "nccl", "gloo"], help="auto: nccl on GPUs"
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "accum_steps", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    at_least_0 = ["subset", "max_steps", "global_batch_size", "weight_decay", "warmup_epochs"]
    at_least_0 += ["clip_grad", "save_every", "keep_best", "patience", "verify_sync"]
    for name in at_least_0:
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be at least 0")
    if args.lr is not None and args.lr <= 0:
        fail("--lr must be > 0")
    if args.lr is None:
        # BatchNorm lets ResNet take a large step; the plain CNN diverges at 0.1.
        args.lr = {"sgd": 0.1, "adamw": 1e-3}[args.optimizer]
        if args.model != "resnet18" and args.optimizer == "sgd":
            args.lr = 0.04
    if args.global_batch_size and args.accum_steps != 1:
        fail("--global-batch-size sets the accumulation steps: leave out --accum-steps")
    return args


def build_optimizer(model, args, lr):
    """SGD with momentum 0.9, or AdamW; fused: one kernel for the whole update (CPUs too)."""
    options = {"lr": lr, "weight_decay": args.weight_decay, "fused": True}
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), momentum=0.9, **options)
    return torch.optim.AdamW(model.parameters(), **options)


def scaled_lr(args, global_batch):
    """--lr is the LR of a global batch of REFERENCE_BATCH samples; a run with k times that batch
    takes k fewer steps. SGD: linear scaling, k x the LR (with a warm-up; Goyal et al. 2017).
    AdamW normalises its steps: linear overshoots, and the square root is the usual rule."""
    scaling = args.lr_scaling
    if scaling == "auto":
        scaling = {"sgd": "linear", "adamw": "sqrt"}[args.optimizer]
    k = global_batch / REFERENCE_BATCH
    return args.lr * {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[scaling]


def warmup_cosine(optimizer, warmup, total):
    """Linear warm-up over `warmup` optimizer steps, then cosine decay to 0 at `total`."""

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fresh_progress():
    """Where a run stands; every checkpoint holds it. epoch_samples: global samples trained in the
    epoch in progress (the data position, the same count on any world size)."""
    return {
        "epoch": 0,
        "epoch_samples": 0,
        "step": 0,
        "best_acc": -1.0,
        "bad_epochs": 0,
        "best": [],
    }


def resume_path(resume, checkpoint_dir):
    """--resume PATH, or with `auto` DIR/last.pt if it exists; None: start from scratch."""
    if resume != "auto":
        return resume
    path = os.path.join(checkpoint_dir, "last.pt")
    if os.path.isfile(path):
        return path
    return None


def best_name(epoch):
    """The file of a best-k checkpoint: derived from its epoch, never read from a checkpoint."""
    return f"best-epoch{epoch:03d}.pt"


def check_progress(ckpt, path):
    """A checkpoint is input from outside: its counters must be counts, and `best` a list of
    [accuracy, epoch] pairs. The run deletes old best-k files by the names best_name() derives
    from those epochs, so a path smuggled in there ("../../x") is refused, never deleted."""
    for key in ("epoch", "epoch_samples", "step", "bad_epochs", "global_batch", "world_size"):
        if type(ckpt.get(key)) is not int or ckpt[key] < 0:
            fail(f"checkpoint {path}: '{key}' is not a count (not one of this script's)", code=1)
    best = ckpt.get("best")
    if type(ckpt.get("best_acc")) is not float or type(best) is not list:
        fail(f"checkpoint {path}: no best-k record (not one of this script's)", code=1)
    for entry in best:
        pair = type(entry) is list and len(entry) == 2
        if not pair or type(entry[0]) is not float or type(entry[1]) is not int or entry[1] < 1:
            fail(f"checkpoint {path}: 'best' holds {entry!r}, not [accuracy, epoch]", code=1)


def record_epoch(progress, accuracy, keep):
    """An epoch ended with this validation accuracy: count it for early stopping and best-k
    ([accuracy, epoch] pairs, the highest first, the earlier epoch on ties). Returns the epochs
    whose best-k files to delete."""
    if accuracy > progress["best_acc"]:
        progress["best_acc"] = accuracy
        progress["bad_epochs"] = 0
    else:
        progress["bad_epochs"] += 1
    progress["epoch"] += 1
    progress["epoch_samples"] = 0
    entries = progress["best"] + [[accuracy, progress["epoch"]]]
    ranked = sorted(entries, key=lambda entry: (-entry[0], entry[1]))
    progress["best"] = ranked[:keep]
    return [epoch for _, epoch in ranked[keep:]]


def remove_best(checkpoint_dir, epochs):
    """Delete the best-k files of these epochs: names derived from the numbers, inside the dir."""
    for epoch in epochs:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(checkpoint_dir, best_name(epoch)))


def start_profiler(checkpoint_dir):
    """Steps 3-5 -> a Chrome trace in DIR/profile_rank0.json (open it in ui.perfetto.dev)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    trace = os.path.join(checkpoint_dir, "profile_rank0.json")
    return torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda profiler: profiler.export_chrome_trace(trace),
    )


@torch.no_grad()
def verify_sync(model):
    """None if all ranks' weights are bitwise equal, else (first differing name, max difference)."""
    named = list(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1).double() for _, p in named])
    both = torch.stack([flat, -flat])
    # DDP: max and -min over the ranks, the same on every rank.
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    # max - min; NaN counts as a difference.
    diff = (both[0] + both[1]).nan_to_num(nan=float("inf"))
    for (name, _), d in zip(named, diff.split([p.numel() for _, p in named]), strict=True):
        if bool(d.any()):
            return name, float(d.max())
    return None


def check_in_sync(model, step):
    """--verify-sync: every rank stops with one line if the ranks' weights have drifted apart."""
    bad = verify_sync(model)
    if bad:
        fail(
            f"parameters differ across ranks at step {step}: first '{bad[0]}' (max difference "
            f"{bad[1]:.3g}). A rank changed its weights outside DDP's all-reduce",
            code=1,
        )
