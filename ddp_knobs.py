"""Lesson 7: when communication or memory is the bottleneck.

    torchrun --standalone --nproc_per_node=2 ddp_knobs.py --zero --sync-bn --comm-hook bf16

Three knobs plain DDP leaves off, each a few lines marked `# DDP:`, on a small BatchNorm CNN and
synthetic images (no download):

    --zero       ZeRO-1 (build_optimizer): each rank keeps the optimizer state of 1/world_size
                 of the parameters.
    --sync-bn    SyncBatchNorm (convert_sync_bn): BatchNorm statistics over the GLOBAL batch,
                 for small per-rank batches.
    --comm-hook  a DDP communication hook (register_comm_hook): fp16 / bf16 send half the
                 gradient bytes, powersgd far fewer (low-rank, approximate).

Checkpoints hold the full optimizer state (with or without --zero: interchangeable) and PowerSGD's
state, so a resumed run continues exactly (save, restore). What the knobs need but this lesson
does not teach (SyncBatchNorm on CPU ranks, PowerSGD's state as tensors, a ZeRO workaround) is in
knobs_extras.py.
"""

import argparse
import gc
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_checkpoint import load_checkpoint, save_checkpoint
from ddp_common import cleanup, fail, print0, set_seed, setup
from ddp_extras import powersgd_hook
from knobs_extras import (
    comm_bytes_per_step,
    convert_to_gloo_sync_batchnorm,
    load_powersgd_state,
    optimizer_state_bytes,
    place_state_on_param_device,
    powersgd_state_dict,
    rebuild_buckets_now,
)


def build_optimizer(model, args, device):
    """Knob 1, --zero: the optimizer, with its state sharded over the ranks (ZeRO-1)."""
    optimizer_class = torch.optim.SGD
    extra = {"momentum": 0.9}
    if args.optimizer == "adamw":
        optimizer_class = torch.optim.AdamW
        extra = {}
    # fused: one kernel for the whole update, on GPUs.
    kwargs = dict(lr=args.lr, fused=device.type == "cuda", **extra)
    if args.zero:
        # DDP: each rank builds optimizer_class over its shard of the parameters, updates only
        # that shard in step() and broadcasts it. Gradients are still all-reduced in full.
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=optimizer_class, **kwargs
        )
    return optimizer_class(model.parameters(), **kwargs)


def convert_sync_bn(model, device):
    """Knob 2, --sync-bn: every BatchNorm normalises with the statistics of the global batch."""
    if device.type == "cuda":
        # DDP: BatchNorm -> SyncBatchNorm BEFORE wrapping in DDP, so DDP registers the new layers.
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # nn.SyncBatchNorm runs on GPUs only: the same computation for CPU ranks (knobs_extras.py).
    return convert_to_gloo_sync_batchnorm(model)


def register_comm_hook(ddp_model, args):
    """Knob 3, --comm-hook: replace the fp32 all-reduce of each gradient bucket. Returns PowerSGD's
    state (error feedback and warm start live there; it belongs in the checkpoint) or None."""
    if args.comm_hook in ("fp16", "bf16"):
        # DDP: cast each bucket to 16 bits, all-reduce, cast back (state None: the default group).
        hook = getattr(default_hooks, f"{args.comm_hook}_compress_hook")
        ddp_model.register_comm_hook(None, hook)
    if args.comm_hook != "powersgd":
        return None
    # DDP: each gradient matrix M (n x m) goes as two rank-r factors P (n x r), Q (m x r); what
    # they miss stays on the rank (error feedback) and joins the next step's gradient.
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.powersgd_rank,
        start_powerSGD_iter=args.powersgd_warmup,
    )
    # torch's powerSGD_hook, finishing each bucket before the next on gloo (ddp_extras.py).
    ddp_model.register_comm_hook(state, powersgd_hook)
    return state


def build(args, ddp):
    """The model (SyncBN converted first), its DDP wrapper with the chosen hook, the optimizer."""
    # Same initial weights on every rank (DDP also broadcasts rank 0's).
    set_seed(args.seed)
    model = Net().to(ddp.device)
    if args.sync_bn:
        model = convert_sync_bn(model, ddp.device)
    device_ids = None
    if ddp.device.type == "cuda":
        device_ids = [ddp.device.index]
    # DDP: all-reduce the gradients in buckets of --bucket-cap-mb.
    ddp_model = DDP(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
    hook_state = register_comm_hook(ddp_model, args)
    optimizer = build_optimizer(ddp_model, args, ddp.device)
    return ddp_model, hook_state, optimizer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 7: ZeRO-1, SyncBatchNorm and DDP communication hooks. "
        "Launch with: torchrun --standalone --nproc_per_node=N ddp_knobs.py"
    )
    parser.add_argument("--zero", action="store_true", help="shard the optimizer state (ZeRO-1)")
    parser.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch")
    parser.add_argument(
        "--comm-hook",
        default="none",
        choices=["none", "fp16", "bf16", "powersgd"],
        help="none = fp32 all-reduce (default); fp16 / bf16 = 16-bit buckets; powersgd = "
        "low-rank compression with error feedback (saved in checkpoints)",
    )
    parser.add_argument(
        "--powersgd-rank", type=int, default=2, help="approximation rank (default 2)"
    )
    parser.add_argument(
        "--powersgd-warmup",
        type=int,
        default=100,
        help="steps of plain all-reduce before PowerSGD compresses (default 100, at least 2)",
    )
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size, MiB")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"], help="default sgd")
    parser.add_argument(
        "--lr", type=float, help="as given for any world size (sgd 0.05, adamw 0.003)"
    )
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many (0 = no cap)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step PER RANK")
    parser.add_argument(
        "--samples", type=int, default=4096, help="training images (validation: 1/4)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights, data and order")
    parser.add_argument("--checkpoint-dir", default="./checkpoints", help="where last.pt goes")
    parser.add_argument(
        "--resume", metavar="PATH|auto", help="resume from PATH; auto = DIR/last.pt"
    )
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.samples < 1 or args.log_every < 1:
        fail("--epochs, --batch-size, --samples and --log-every must be at least 1")
    if args.max_steps < 0 or args.seed < 0:
        fail("--max-steps and --seed must be at least 0")
    if args.powersgd_rank < 1:
        fail("--powersgd-rank must be at least 1")
    # DDP rebuilds its buckets after step 1: PowerSGD's per-bucket state must start after that.
    if args.powersgd_warmup < 2:
        fail("--powersgd-warmup must be at least 2")
    if args.bucket_cap_mb <= 0:
        fail("--bucket-cap-mb must be > 0")
    if args.lr is not None and args.lr <= 0:
        fail("--lr must be > 0")
    if args.lr is None:
        args.lr = 0.05
        if args.optimizer == "adamw":
            args.lr = 0.003
    return args


class Net(nn.Module):
    """3x16x16 image -> 10 class scores: two conv + BatchNorm blocks and a linear layer (10,266
    parameters). No conv bias: BatchNorm subtracts the mean, bias included."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def make_data(seed, n):
    """(train, val) of 10 learnable classes: each class a fixed smooth random pattern, each image
    that pattern plus noise. Built from its own generator: the same on every rank."""
    generator = torch.Generator().manual_seed(seed + 12345)
    patterns = F.interpolate(torch.rand(10, 3, 4, 4, generator=generator), size=16, mode="bilinear")

    def draw(m):
        y = torch.randint(0, 10, (m,), generator=generator)
        return patterns[y] + 1.5 * torch.randn(m, 3, 16, 16, generator=generator), y

    return draw(n), draw(max(1, n // 4))


def sync_buffers(model):
    """Each rank's forward updates its own BatchNorm statistics (DDP broadcasts rank 0's only at
    the START of a forward). Before evaluating or saving, every rank takes rank 0's."""
    for b in model.buffers():
        # DDP: rank 0's statistics to every rank.
        dist.broadcast(b, src=0)


@torch.no_grad()
def evaluate(model, x, y, ddp):
    """Exact loss and accuracy of the bare model (rank r: samples r, r+W, ...; sums all-reduced)."""
    sync_buffers(model)
    model.eval()
    logits = model(x[ddp.rank :: ddp.world_size])
    labels = y[ddp.rank :: ddp.world_size]
    loss_sum = F.cross_entropy(logits, labels, reduction="sum")
    totals = torch.stack([loss_sum, (logits.argmax(1) == labels).sum()])
    # DDP: sum the shards.
    dist.all_reduce(totals)
    model.train()
    return (v / len(y) for v in totals.tolist())


def resume_path(args, ddp):
    """The checkpoint to resume from, or None. Every rank must agree: a rank that starts fresh
    while the others resume would train a different model (node-local disks)."""
    if not args.resume:
        return None
    path = args.resume
    if args.resume == "auto":
        path = os.path.join(args.checkpoint_dir, "last.pt")
    seen = torch.tensor([float(os.path.isfile(path))], device=ddp.device)
    # DDP: how many ranks see the file.
    dist.all_reduce(seen)
    ranks_seeing = int(seen.item())
    if ranks_seeing == 0 and args.resume == "auto":
        print0(f"resume: no {path} yet; starting from scratch")
        return None
    if ranks_seeing < ddp.world_size:
        fail(
            f"checkpoint {path} is missing on {ddp.world_size - ranks_seeing} of "
            f"{ddp.world_size} ranks: every rank must read it (use a shared --checkpoint-dir or "
            "copy it)",
            rank0_only=True,
        )
    return path


def save(path, ddp_model, optimizer, hook_state, args, ddp, step):
    """Every rank calls this (the gathers below are collectives); rank 0 writes."""
    sync_buffers(ddp_model.module)
    if args.zero:
        # DDP: consolidate_state_dict is a collective: every rank sends its shard, then rank 0
        # alone holds the full state_dict, in the unsharded optimizer's format.
        optimizer.consolidate_state_dict(to=0)
    optimizer_state = None
    if ddp.is_main or not args.zero:
        optimizer_state = optimizer.state_dict()
    hook_states = None
    if hook_state is not None:
        if ddp.is_main:
            hook_states = [None] * ddp.world_size
        # DDP: PowerSGD's error feedback differs per rank: rank 0 gathers every rank's.
        dist.gather_object(powersgd_state_dict(hook_state), hook_states, dst=0)
    checkpoint = {
        # DDP: the bare model's weights (no "module." prefix).
        "model": ddp_model.module.state_dict(),
        "optimizer": optimizer_state,
        "powersgd": hook_states,
        "step": step,
        "world_size": ddp.world_size,
        "args": vars(args),
    }
    save_checkpoint(checkpoint, path)


def restore(path, ddp_model, optimizer, hook_state, args, ddp, x0):
    """Every rank loads the checkpoint to the CPU (the full optimizer state on every GPU would undo
    --zero's saving; load_state_dict keeps each rank's shard); returns the step reached."""
    ckpt = load_checkpoint(path, "cpu", model=ddp_model.module, optimizer=optimizer)
    if args.zero:
        place_state_on_param_device(optimizer)
    if hook_state is not None:
        saved = ckpt.get("powersgd")
        # What the buckets depend on: the saved state maps onto the same layout only.
        layout = (ckpt["world_size"], ckpt["args"]["bucket_cap_mb"])
        if saved and layout == (ddp.world_size, args.bucket_cap_mb):
            rebuild_buckets_now(ddp_model, x0)
            load_powersgd_state(hook_state, saved[ddp.rank], ddp.device)
        else:
            print0(
                f"warning: {path} has no PowerSGD state for {ddp.world_size} ranks and "
                f"{args.bucket_cap_mb:g} MiB buckets: error feedback restarts at zero (not exact)"
            )
    print0(f"resume: {path} at step {ckpt['step']}")
    return ckpt["step"]


def train(args, ddp):
    """Train; returns a summary (the tests call this inside spawned ranks)."""
    train_set, val_set = make_data(args.seed, args.samples)
    x, y = (t.to(ddp.device) for t in train_set)
    x_val, y_val = (t.to(ddp.device) for t in val_set)
    # DDP: each rank reads its own 1/world_size of the shuffled indices, every epoch a new order.
    sampler = DistributedSampler(
        range(len(x)), num_replicas=ddp.world_size, rank=ddp.rank, seed=args.seed
    )
    per_epoch = len(sampler) // args.batch_size
    if per_epoch == 0:
        fail(
            f"{len(sampler)} samples per rank is less than one batch of {args.batch_size}: "
            "lower --batch-size or raise --samples"
        )
    run_steps = args.epochs * per_epoch
    if args.max_steps:
        run_steps = min(run_steps, args.max_steps)
    ddp_model, hook_state, optimizer = build(args, ddp)
    last = os.path.join(args.checkpoint_dir, "last.pt")
    path = resume_path(args, ddp)
    step = 0
    if path:
        step = restore(path, ddp_model, optimizer, hook_state, args, ddp, x[:2])
    n_params = sum(p.numel() for p in ddp_model.parameters())
    optimizer_name = args.optimizer
    if args.zero:
        optimizer_name += " zero"
    print0(
        f"start: data synthetic | params {n_params} | world {ddp.world_size} | "
        f"backend {ddp.backend} | device {ddp.device.type} | batch {args.batch_size}/rank, "
        f"{args.batch_size * ddp.world_size} global | optimizer {optimizer_name} | "
        f"sync_bn {args.sync_bn} | comm_hook {args.comm_hook} | steps {step}->{run_steps}"
    )
    # Loss sum and correct count since the last log line.
    stats = torch.zeros(2, device=ddp.device)
    t0 = time.perf_counter()
    t_log = t0
    loss = float("nan")
    val_loss = float("nan")
    val_acc = float("nan")
    order = None
    logged = step
    while step < run_steps:
        epoch, i = divmod(step, per_epoch)
        if i == 0 or order is None:
            # DDP: without set_epoch every epoch repeats epoch 0's order.
            sampler.set_epoch(epoch)
            order = torch.tensor(list(sampler), device=ddp.device)
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        optimizer.zero_grad(set_to_none=True)
        logits = ddp_model(x[idx])
        batch_loss = F.cross_entropy(logits, y[idx])
        # DDP: all-reduces the gradient buckets (through the hook, if any) during backward.
        batch_loss.backward()
        # ZeRO: updates this rank's shard, then broadcasts it.
        optimizer.step()
        correct = (logits.argmax(1) == y[idx]).sum()
        stats += torch.stack([batch_loss.detach() * len(idx), correct])
        step += 1
        if step % args.log_every == 0 or step == run_steps:
            # DDP: global figures, once per log line.
            dist.all_reduce(stats)
            count = (step - logged) * args.batch_size * ddp.world_size
            now = time.perf_counter()
            loss, acc = (v / count for v in stats.tolist())
            print0(
                f"epoch {epoch + 1}/{args.epochs} | step {step}/{run_steps} | loss {loss:.4f} | "
                f"acc {100 * acc:.2f}% | {count / (now - t_log):.0f} samples/s"
            )
            stats.zero_()
            t_log = now
            logged = step
        if step % per_epoch == 0 or step == run_steps:
            # DDP: evaluate the bare model (ddp_model.module): no collectives in its forward.
            val_loss, val_acc = evaluate(ddp_model.module, x_val, y_val, ddp)
            print0(
                f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | "
                f"val_acc {100 * val_acc:.2f}%"
            )
            save(last, ddp_model, optimizer, hook_state, args, ddp, step)
            # samples/s counts training only.
            t_log = time.perf_counter()
    if math.isnan(val_loss):
        # Resumed with nothing left to train: evaluate what was loaded.
        val_loss, val_acc = evaluate(ddp_model.module, x_val, y_val, ddp)
    opt_bytes = optimizer_state_bytes(optimizer)
    comm = comm_bytes_per_step(args.comm_hook, n_params, hook_state)
    print0(
        f"done: data synthetic | world {ddp.world_size} | backend {ddp.backend} | "
        f"device {ddp.device.type} | steps {step} | loss {loss:.4f} | val_loss {val_loss:.4f} | "
        f"val_acc {100 * val_acc:.2f}% | opt_state {opt_bytes / 2**20:.3f} MiB/rank | "
        f"grad_comm {comm / 2**10:.1f} KiB/step/rank | time {time.perf_counter() - t0:.1f}s"
    )
    weights = {k: v.detach().cpu().clone() for k, v in ddp_model.module.state_dict().items()}
    # DDP: free the wrapper (it sits in reference cycles) before anyone leaves the group.
    del ddp_model, optimizer, hook_state
    gc.collect()
    return {
        "step": step,
        "loss": loss,
        "val_loss": val_loss,
        "val_acc": val_acc,
        "model": weights,
        "opt_state_bytes": opt_bytes,
        "comm_bytes": comm,
    }


@record
def main(argv=None):
    args = parse_args(argv)
    # DDP: join the process group; pick this rank's device.
    ddp = setup(args.backend)
    result = train(args, ddp)
    cleanup()
    return result


if __name__ == "__main__":
    main()
