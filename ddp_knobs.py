"""Lesson 7: when communication or memory is the bottleneck.

    torchrun --standalone --nproc_per_node=2 ddp_knobs.py --zero --sync-bn --comm-hook bf16

Three knobs plain DDP leaves off, on a small BatchNorm CNN and synthetic images (no download):
  --zero       ZeRO-1: each rank keeps the optimizer state of 1/world_size of the parameters.
  --sync-bn    BatchNorm statistics over the GLOBAL batch: for small per-rank batches.
  --comm-hook  fp16 / bf16 (half the gradient bytes) or powersgd (low-rank, far fewer, approximate).
Checkpoints hold the full optimizer state (with or without --zero: interchangeable) and the
PowerSGD state, so a resumed run continues exactly. The DDP-specific lines are marked `# DDP:`.
"""

import argparse
import gc
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cleanup, fail, load_checkpoint, print0, save_checkpoint, set_seed, setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Lesson 7: ZeRO-1, SyncBatchNorm and DDP communication "
        "hooks. Launch with: torchrun --standalone --nproc_per_node=N ddp_knobs.py"
    )
    a = p.add_argument
    a("--zero", action="store_true", help="shard the optimizer state over the ranks (ZeRO-1)")
    a("--sync-bn", action="store_true", help="BatchNorm statistics over the global batch")
    a(
        "--comm-hook",
        default="none",
        choices=["none", "fp16", "bf16", "powersgd"],
        help="gradient communication: none = fp32 all-reduce (default); fp16 / bf16 = 16-bit "
        "buckets; powersgd = low-rank compression with error feedback (saved in checkpoints)",
    )
    a("--powersgd-rank", type=int, default=2, help="PowerSGD approximation rank (default 2)")
    a(
        "--powersgd-warmup",
        type=int,
        default=100,
        help="steps of plain all-reduce before PowerSGD compresses (default 100, at least 2)",
    )
    a(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="DDP gradient bucket size in MiB (default 25)",
    )
    a(
        "--optimizer",
        default="sgd",
        choices=["sgd", "adamw"],
        help="SGD with momentum 0.9, or AdamW",
    )
    a(
        "--lr",
        type=float,
        default=None,
        help="learning rate, used as given for any world size (default: sgd 0.05, adamw 0.003)",
    )
    a("--epochs", type=int, default=3, help="passes over the training set (default 3)")
    a("--max-steps", type=int, default=0, help="stop after this many steps in all (0 = no cap)")
    a("--batch-size", type=int, default=32, help="samples per step PER RANK (default 32)")
    a(
        "--samples",
        type=int,
        default=4096,
        help="synthetic training images (validation: 1/4 as many)",
    )
    a("--seed", type=int, default=0, help="seed for the weights, the data and its order")
    a(
        "--checkpoint-dir",
        default="./checkpoints",
        help="where last.pt goes (default ./checkpoints)",
    )
    a(
        "--resume",
        default=None,
        metavar="PATH|auto",
        help="resume from PATH; auto = DIR/last.pt if any",
    )
    a("--log-every", type=int, default=50, help="steps between log lines (default 50)")
    a(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on GPUs, else gloo",
    )
    args = p.parse_args(argv)
    for name, low in [
        ("epochs", 1),
        ("batch_size", 1),
        ("log_every", 1),
        ("samples", 1),
        ("max_steps", 0),
        ("seed", 0),
        ("powersgd_rank", 1),
        ("powersgd_warmup", 2),
    ]:  # see PowerSGDState
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    if args.bucket_cap_mb <= 0 or (args.lr is not None and args.lr <= 0):
        p.error("--bucket-cap-mb and --lr must be > 0")
    args.lr = args.lr or (0.05 if args.optimizer == "sgd" else 0.003)
    return args


class Net(nn.Module):
    """3x16x16 image -> 10 class scores: two conv + BatchNorm blocks and a linear layer (10,266
    parameters). No conv bias: BatchNorm subtracts the mean, bias included."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def make_data(seed, n):
    """(train, val) of 10 learnable classes: each class a fixed smooth random pattern, each image
    that pattern plus noise. Built from its own generator: the same on every rank."""
    g = torch.Generator().manual_seed(seed + 12345)
    protos = F.interpolate(torch.rand(10, 3, 4, 4, generator=g), size=16, mode="bilinear")

    def draw(m):
        y = torch.randint(0, 10, (m,), generator=g)
        return protos[y] + 1.5 * torch.randn(m, 3, 16, 16, generator=g), y

    return draw(n), draw(max(1, n // 4))


class AllReduceSum(torch.autograd.Function):
    """Differentiable all-reduce (sum). Every rank's loss depends on every rank's x through the
    sum, so the gradient of x is the sum over ranks of the output's gradients: the same op."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    backward = forward


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """SyncBatchNorm for CPU ranks: nn.SyncBatchNorm refuses CPU tensors ("expected input tensor
    to be on GPU"). The same computation with the all-reduce above, in two all-reduces per layer
    (sums, then squared deviations from the global mean: exact and stable) where nn.SyncBatchNorm
    needs one. BatchNorm2d's parameters and buffers: checkpoints move freely between the two."""

    def _check_input_dim(self, input):  # _BatchNorm leaves the shape check to subclasses
        pass

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)  # eval, or one process: plain BatchNorm
        dims, shape = [0] + list(range(2, x.dim())), [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        sums = AllReduceSum.apply(torch.cat([x.sum(dims), count]))  # DDP: sums over all ranks
        n = sums[-1]
        mean = sums[:-1] / n
        centred = x - mean.view(shape)
        var = AllReduceSum.apply(centred.pow(2).sum(dims)) / n  # DDP: variance of the global batch
        with torch.no_grad():  # running variance is unbiased, over the global count
            self.num_batches_tracked.add_(1)
            m = self.momentum if self.momentum is not None else 1 / float(self.num_batches_tracked)
            self.running_mean.lerp_(mean, m)
            self.running_var.lerp_(var * n / (n - 1).clamp(min=1), m)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        return y * self.weight.view(shape) + self.bias.view(shape)


def convert_sync_bn(model, device):
    """DDP: BatchNorm -> SyncBatchNorm (the stand-in above on CPU), BEFORE wrapping in DDP."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            new = GlooSyncBatchNorm(child.num_features, child.eps, child.momentum).to(device)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
        else:
            convert_sync_bn(child, device)
    return model


def powersgd_waiting(state, bucket):
    """PowerSGD on gloo: the hook chains three all-reduces per bucket through future callbacks,
    which gloo runs on its own threads, so two ranks can issue them in different orders (abort
    "gloo::EnforceNotMet", or a hang). Finish each bucket before DDP hands over the next."""
    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def register_comm_hook(ddp_model, args):
    """DDP: replace the fp32 all-reduce of each gradient bucket by a hook. Returns PowerSGD's
    state (error feedback and warm start live there; it belongs in the checkpoint) or None."""
    if args.comm_hook in ("fp16", "bf16"):  # cast each bucket to 16 bits, all-reduce, cast back
        hook = getattr(default_hooks, f"{args.comm_hook}_compress_hook")
        ddp_model.register_comm_hook(None, hook)  # state None = the default process group
    if args.comm_hook != "powersgd":
        return None
    # Each gradient matrix M (n x m) goes as two rank-r factors P (n x r), Q (m x r); what they
    # miss stays on the rank (error feedback) and joins the next step's gradient.
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.powersgd_rank,
        start_powerSGD_iter=args.powersgd_warmup,
    )
    waiting = dist.get_backend() == "gloo"
    ddp_model.register_comm_hook(
        state, powersgd_waiting if waiting else powerSGD_hook.powerSGD_hook
    )
    return state


def powersgd_state_dict(state):
    """This rank's PowerSGD state as tensors and ints (weights_only=True loads them): the error
    left over per bucket (differs per rank), the warm-start factors, the step count, the RNG."""
    _, keys, pos, has_gauss, gauss = state.rng.get_state()
    tensors = {
        key: {k: v.cpu() for k, v in d.items()}
        for key, d in [
            ("error", state.error_dict),
            ("p", state.p_memory_dict),
            ("q", state.q_memory_dict),
        ]
    }
    return {
        "iter": state.iter,
        "rng": [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
        **tensors,
    }


def load_powersgd_state(state, saved, device):
    state.iter = saved["iter"]
    state.error_dict, state.p_memory_dict, state.q_memory_dict = (
        {k: v.to(device) for k, v in saved[key].items()} for key in ("error", "p", "q")
    )
    keys, pos, has_gauss, gauss = saved["rng"]
    state.rng.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    state.total_numel_before_compression, state.total_numel_after_compression = saved["numel"]


def rebuild_buckets_now(ddp_model, x):
    """DDP: PowerSGD's state is per bucket, so a resumed run must bucket the gradients as the saved
    run did. DDP starts with ONE bucket and rebuilds its buckets in gradient-ready order after the
    first backward (why PowerSGD's warm-up is >= 2 steps). So: one throw-away forward/backward (plain
    all-reduce: the fresh hook state is in warm-up), BatchNorm statistics put back, gradients dropped."""
    buffers = [b.clone() for b in ddp_model.module.buffers()]
    ddp_model(x).sum().backward()
    for b, saved in zip(ddp_model.module.buffers(), buffers):
        b.copy_(saved)
    ddp_model.zero_grad(set_to_none=True)


def build_optimizer(model, args, device):
    cls = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.AdamW
    extra = {"momentum": 0.9} if args.optimizer == "sgd" else {}
    kwargs = dict(
        lr=args.lr, fused=device.type == "cuda", **extra
    )  # fused: one kernel for the update
    if args.zero:
        # DDP: ZeRO-1. Each rank builds `cls` over its shard of the parameters, updates only that
        # shard in step() and broadcasts it. Gradients are still all-reduced in full.
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    return cls(model.parameters(), **kwargs)


def place_state_on_param_device(optimizer):
    """ZeroRedundancyOptimizer.load_state_dict moves 0-dim state tensors (Adam's `step`) to the CPU
    (pytorch/pytorch#124133). The fused and capturable kernels want them on the parameter's device
    and fail at the first step after a resume. Put them back, as torch.optim's own load does."""
    local = getattr(optimizer, "optim", optimizer)  # ZeRO: the optimizer over this rank's shard
    for group in local.param_groups:
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                for k, v in local.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.device != p.device:
                        local.state[p][k] = v.to(p.device)


def optimizer_state_bytes(optimizer):
    """Optimizer state held by THIS rank (with ZeRO: its shard's)."""
    local = getattr(optimizer, "optim", optimizer)
    return sum(t.nbytes for s in local.state.values() for t in s.values() if torch.is_tensor(t))


def comm_bytes_per_step(args, n_params, state):
    """Gradient bytes one rank hands to all-reduce per step: 4 per parameter in fp32, 2 with the
    16-bit hooks; PowerSGD counts the factors and uncompressed tensors it actually sent."""
    if state is not None and state.iter > state.start_powerSGD_iter:
        return 4 * state.total_numel_after_compression / (state.iter - state.start_powerSGD_iter)
    return (2 if args.comm_hook in ("fp16", "bf16") else 4) * n_params


def sync_buffers(model):
    """DDP: each rank's forward updates its own BatchNorm statistics (DDP broadcasts rank 0's only at
    the START of a forward). Before evaluating or saving every rank takes rank 0's: the saved ones."""
    for b in model.buffers():
        dist.broadcast(b, src=0)


@torch.no_grad()
def evaluate(model, x, y, ddp):
    """Exact loss and accuracy of the bare model (rank r: samples r, r+W, ...; sums all-reduced)."""
    sync_buffers(model)
    model.eval()
    logits = model(x[ddp.rank :: ddp.world_size])
    yr = y[ddp.rank :: ddp.world_size]
    totals = torch.stack(
        [F.cross_entropy(logits, yr, reduction="sum"), (logits.argmax(1) == yr).sum()]
    )
    dist.all_reduce(totals)  # DDP: sum the shards
    model.train()
    return (v / len(y) for v in totals.tolist())


def resume_path(args, ddp):
    """The checkpoint to resume from, or None. Every rank must agree: a rank that starts fresh
    while the others resume would train a different model (node-local disks)."""
    if not args.resume:
        return None
    path = os.path.join(args.checkpoint_dir, "last.pt") if args.resume == "auto" else args.resume
    seen = torch.tensor([float(os.path.isfile(path))], device=ddp.device)
    dist.all_reduce(seen)  # DDP: how many ranks see the file
    if seen.item() == 0 and args.resume == "auto":
        print0(f"resume: no {path} yet; starting from scratch")
        return None
    if seen.item() < ddp.world_size:
        fail(
            f"checkpoint {path} is missing on {ddp.world_size - int(seen.item())} of {ddp.world_size} "
            "ranks: every rank must read it (use a shared --checkpoint-dir or copy it)",
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
    hook_states = [None] * ddp.world_size if ddp.is_main and hook_state is not None else None
    if hook_state is not None:  # DDP: error feedback differs per rank: gather all of them
        dist.gather_object(powersgd_state_dict(hook_state), hook_states, dst=0)
    save_checkpoint(
        {
            "model": ddp_model.module.state_dict(),  # DDP: the bare model's weights
            "optimizer": optimizer.state_dict() if ddp.is_main or not args.zero else None,
            "powersgd": hook_states,
            "step": step,
            "world_size": ddp.world_size,
            "args": vars(args),
        },
        path,
    )


def restore(path, ddp_model, optimizer, hook_state, args, ddp, x0):
    """Every rank loads the checkpoint (to the CPU: the full optimizer state on every GPU would undo
    --zero's saving; load_state_dict moves each piece to its parameter); returns the step reached."""
    ckpt = load_checkpoint(path, torch.device("cpu"), model=ddp_model.module, optimizer=optimizer)
    if args.zero:  # each rank kept its shard of the full state
        place_state_on_param_device(optimizer)
    if hook_state is not None:
        saved = ckpt.get("powersgd")
        layout = (ckpt["world_size"], ckpt["args"]["bucket_cap_mb"])  # what the buckets depend on
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


def build(args, ddp):
    """The model (SyncBN converted first), its DDP wrapper with the chosen hook, the optimizer."""
    set_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = Net().to(ddp.device)
    if args.sync_bn:
        model = convert_sync_bn(model, ddp.device)
    ddp_model = DDP(
        model,
        device_ids=[ddp.device.index] if ddp.device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )  # DDP: all-reduce gradients in buckets
    return (
        ddp_model,
        register_comm_hook(ddp_model, args),
        build_optimizer(ddp_model, args, ddp.device),
    )


def train(args, ddp):
    """Train; returns a summary (the tests call this inside spawned ranks)."""
    (x, y), (xv, yv) = (
        tuple(t.to(ddp.device) for t in xy) for xy in make_data(args.seed, args.samples)
    )
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
    run_steps = min(args.epochs * per_epoch, args.max_steps or args.epochs * per_epoch)
    ddp_model, hook_state, optimizer = build(args, ddp)
    last, path = os.path.join(args.checkpoint_dir, "last.pt"), resume_path(args, ddp)
    step = restore(path, ddp_model, optimizer, hook_state, args, ddp, x[:2]) if path else 0
    n_params = sum(p.numel() for p in ddp_model.parameters())
    print0(
        f"start: data synthetic | params {n_params} | world {ddp.world_size} | backend {ddp.backend} "
        f"| device {ddp.device.type} | batch {args.batch_size}/rank, {args.batch_size * ddp.world_size} "
        f"global | optimizer {args.optimizer}{' zero' if args.zero else ''} | sync_bn {args.sync_bn} "
        f"| comm_hook {args.comm_hook} | steps {step}->{run_steps}"
    )
    stats = torch.zeros(2, device=ddp.device)  # loss sum, correct since the last log line
    t0 = t_log = time.perf_counter()
    loss = val_loss = val_acc = float("nan")
    order, logged = None, step
    while step < run_steps:
        epoch, i = divmod(step, per_epoch)
        if i == 0 or order is None:
            sampler.set_epoch(epoch)  # DDP: without this every epoch repeats epoch 0's order
            order = torch.tensor(list(sampler), device=ddp.device)
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        optimizer.zero_grad(set_to_none=True)
        logits = ddp_model(x[idx])
        batch_loss = F.cross_entropy(logits, y[idx])
        batch_loss.backward()  # DDP: all-reduces the gradient buckets (through the hook, if any)
        optimizer.step()  # ZeRO: updates this rank's shard, then broadcasts it
        stats += torch.stack([batch_loss.detach() * len(idx), (logits.argmax(1) == y[idx]).sum()])
        step += 1
        if step % args.log_every == 0 or step == run_steps:
            dist.all_reduce(stats)  # DDP: global figures, once per log line
            count, now = (step - logged) * args.batch_size * ddp.world_size, time.perf_counter()
            loss, acc = (v / count for v in stats.tolist())
            print0(
                f"epoch {epoch + 1}/{args.epochs} | step {step}/{run_steps} | loss {loss:.4f} | "
                f"acc {100 * acc:.2f}% | {count / (now - t_log):.0f} samples/s"
            )
            stats.zero_()
            t_log, logged = now, step
        if step % per_epoch == 0 or step == run_steps:
            val_loss, val_acc = evaluate(ddp_model.module, xv, yv, ddp)  # DDP: the bare model
            print0(
                f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | "
                f"val_acc {100 * val_acc:.2f}%"
            )
            save(last, ddp_model, optimizer, hook_state, args, ddp, step)
            t_log = time.perf_counter()  # samples/s counts training only
    if val_loss != val_loss:  # NaN: resumed with nothing left to train
        val_loss, val_acc = evaluate(ddp_model.module, xv, yv, ddp)
    opt_bytes, comm = (
        optimizer_state_bytes(optimizer),
        comm_bytes_per_step(args, n_params, hook_state),
    )
    print0(
        f"done: data synthetic | world {ddp.world_size} | backend {ddp.backend} | device "
        f"{ddp.device.type} | steps {step} | loss {loss:.4f} | val_loss {val_loss:.4f} | val_acc "
        f"{100 * val_acc:.2f}% | opt_state {opt_bytes / 2**20:.3f} MiB/rank | grad_comm "
        f"{comm / 2**10:.1f} KiB/step/rank | time {time.perf_counter() - t0:.1f}s"
    )
    weights = {k: v.detach().cpu().clone() for k, v in ddp_model.module.state_dict().items()}
    del ddp_model, optimizer, hook_state  # DDP: drop the wrapper before the process group (gc)
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


def main(argv=None):
    args = parse_args(argv)
    ddp = setup(args.backend)  # DDP: join the process group; pick this rank's device
    result = train(args, ddp)
    cleanup()
    return result


if __name__ == "__main__":
    main()
