"""Lesson 2: the production template. Everything a real DDP training job needs, in one file.

    torchrun --standalone --nproc_per_node=4 ddp_training.py                     # CIFAR-10, ResNet-18
    torchrun --standalone --nproc_per_node=2 ddp_training.py --model cnn --amp off  # on a CPU

CIFAR-10 with a torchvision ResNet-18 (or `--model cnn`, a small CNN that trains on a CPU),
trained with plain DistributedDataParallel: linear LR scaling, warm-up + cosine schedule,
gradient accumulation with `no_sync`, clipping, mixed precision (bf16, or fp16 with a
GradScaler), optional `torch.compile`, atomic checkpoints that resume exactly (mid-epoch
included), best-k checkpoints by validation accuracy, early stopping, exact sharded evaluation,
a parameter-sync check and a profiler trace. The DDP-specific lines are marked `# DDP:`.

Advanced knobs for when communication or memory is the bottleneck: `--sync-bn` (SyncBatchNorm),
`--comm-hook fp16|bf16|powersgd` (DDP communication hooks) and `--zero` (ZeroRedundancyOptimizer,
optimizer state sharded over the ranks); `ddp_benchmark.py --comm-hook ...` measures them.

Copy it and swap in your own model (`build_model`) and data (`get_data`). The rest is the part
that is easy to get subtly wrong.
"""
import argparse
import contextlib
import datetime
import gc
import math
import os
import pickle
import random
import resource
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cleanup, fail, load_checkpoint, print0, save_checkpoint, set_seed, setup

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 channel statistics
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Lesson 2: the production DDP template (CIFAR-10, ResNet-18). "
                    "Launch with: torchrun --standalone --nproc_per_node=N ddp_training.py")
    a = p.add_argument
    a("--model", default="resnet18", choices=["resnet18", "cnn", "cnn-bn"],
      help="resnet18: torchvision ResNet-18, random init, CIFAR stem (default); "
           "cnn: a small CNN (~0.03 M parameters) that trains in seconds on a CPU; "
           "cnn-bn: the same CNN with BatchNorm after each convolution (for --sync-bn)")
    a("--data", default="auto", choices=["auto", "cifar10", "synthetic"],
      help="cifar10: the real set (downloaded into --data-dir if missing, error if it cannot be); "
           "synthetic: generated CIFAR-shaped images of 10 learnable classes, no download; "
           "auto: cifar10, or synthetic with a warning when it cannot be had (default)")
    a("--data-dir", default="./data", help="where cifar-10-batches-py/ lives (default ./data)")
    a("--subset", type=int, default=0,
      help="use only the first N training and N/5 test samples (0 = all); for quick checks")
    a("--val-fraction", type=float, default=0.1,
      help="share of the training set held out for validation, best-k and early stopping "
           "(default 0.1; 0 = validate on the test set)")
    a("--epochs", type=int, default=30, help="passes over the training set (default 30)")
    a("--max-steps", type=int, default=0,
      help="stop after this many optimizer steps in all (0 = no cap); the LR schedule still "
           "spans --epochs, so a capped run can be resumed and continue exactly")
    a("--batch-size", type=int, default=128,
      help="samples per micro-step PER RANK; global batch = this x accum-steps x world size "
           "(default 128)")
    a("--accum-steps", type=int, default=1,
      help="micro-steps per optimizer step (gradient accumulation, default 1)")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"],
      help="sgd: SGD with momentum (default); adamw: AdamW")
    a("--lr", type=float, default=None,
      help="learning rate for ONE process's batch; multiplied by the world size unless "
           "--no-lr-scaling (default: sgd 0.1 for resnet18, 0.02 for cnn and cnn-bn; adamw 1e-3)")
    a("--no-lr-scaling", action="store_true",
      help="use --lr as given instead of lr x world size (the linear scaling rule)")
    a("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    a("--weight-decay", type=float, default=None,
      help="weight decay (default 5e-4 for sgd, 0.05 for adamw)")
    a("--warmup-epochs", type=float, default=1.0,
      help="linear LR warm-up length in epochs, then cosine decay to 0 (default 1)")
    a("--clip-grad", type=float, default=0.0,
      help="clip the global gradient norm to this value (0 = off, default)")
    a("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"],
      help="mixed precision: bf16 autocast (also on CPU), fp16 autocast with a GradScaler, or "
           "off; auto = bf16 on CUDA, off on CPU (default)")
    a("--compile", action="store_true", help="torch.compile the model (after wrapping it in DDP)")
    a("--bucket-cap-mb", type=float, default=25.0,
      help="DDP gradient bucket size in MiB (default 25): smaller buckets start communicating "
           "earlier, larger ones make fewer, bigger all-reduces")
    a("--static-graph", action="store_true",
      help="tell DDP the set of used parameters never changes (enables some optimisations)")
    a("--find-unused-parameters", action="store_true",
      help="let DDP handle parameters that get no gradient in some steps (costs a graph "
           "traversal every step; only for models with conditional branches)")
    a("--gradient-as-bucket-view", action="store_true",
      help="let .grad tensors alias DDP's communication buckets (saves one gradient copy of memory)")
    # Advanced knobs (README: "When communication or memory is the bottleneck").
    a("--sync-bn", action="store_true",
      help="convert BatchNorm layers to SyncBatchNorm before wrapping: batch statistics over the "
           "GLOBAL batch instead of each rank's own (for small per-GPU batches; one extra "
           "all-reduce per BN layer in every forward)")
    a("--comm-hook", default="none", choices=["none", "fp16", "bf16", "powersgd"],
      help="DDP communication hook: none = all-reduce fp32 gradients (default); fp16 / bf16 = "
           "cast each bucket to 16 bits before the all-reduce (half the bytes); powersgd = "
           "low-rank gradient compression with error feedback (far fewer bytes, approximate)")
    a("--powersgd-rank", type=int, default=2,
      help="PowerSGD matrix approximation rank (default 2; higher = more accurate, more bytes)")
    a("--powersgd-warmup", type=int, default=100,
      help="PowerSGD: optimizer steps of plain all-reduce before compression starts (default "
           "100; at least 2)")
    a("--zero", action="store_true",
      help="ZeroRedundancyOptimizer (ZeRO stage 1): each rank keeps the optimizer state of only "
           "1/world_size of the parameters and broadcasts its updated shard after each step")
    a("--seed", type=int, default=0, help="seed for init, data order, augmentation, synthetic data")
    a("--workers", type=int, default=None,
      help="DataLoader worker processes per rank (default: 4 on GPU, 0 on CPU)")
    a("--checkpoint-dir", default="./checkpoints",
      help="where last.pt and the best-k checkpoints go (default ./checkpoints)")
    a("--resume", default=None, metavar="PATH|auto",
      help="resume from this checkpoint; auto = DIR/last.pt when it exists, else start fresh")
    a("--save-every", type=int, default=0,
      help="also save last.pt every N optimizer steps inside an epoch (0 = at epoch ends only)")
    a("--keep-best", type=int, default=1,
      help="keep the K checkpoints with the best validation accuracy (default 1; 0 = none)")
    a("--patience", type=int, default=0,
      help="early stopping: stop after N epochs without a better validation accuracy (0 = off)")
    a("--verify-sync", type=int, default=0, metavar="N",
      help="every N steps check that all ranks hold identical parameters (0 = off)")
    a("--profile", action="store_true",
      help="profile steps 2-4 on rank 0 with torch.profiler; writes DIR/profile_rank0.json")
    a("--log-every", type=int, default=50, help="steps between log lines (default 50)")
    a("--backend", default="auto", choices=["auto", "nccl", "gloo"],
      help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "accum_steps", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("max_steps", "subset", "save_every", "keep_best", "patience", "verify_sync",
                 "seed", "clip_grad", "warmup_epochs", "momentum", "weight_decay"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    if args.lr is not None and not args.lr > 0:
        p.error("--lr must be > 0")
    if not 0 <= args.val_fraction < 1:
        p.error("--val-fraction must be in [0, 1)")
    if args.workers is not None and args.workers < 0:
        p.error("--workers must not be negative")
    if args.bucket_cap_mb <= 0:
        p.error("--bucket-cap-mb must be > 0")
    if args.powersgd_rank < 1:
        p.error("--powersgd-rank must be at least 1")
    if args.powersgd_warmup < 2:  # PowerSGDState refuses fewer: DDP rebuilds its buckets after step 1
        p.error("--powersgd-warmup must be at least 2")
    if args.sync_bn and args.model == "cnn":
        p.error("--sync-bn needs a model with BatchNorm layers: --model cnn-bn or resnet18 (cnn has none)")
    if args.lr is None:
        # BatchNorm lets ResNet take a large SGD step; the plain CNN diverges at 0.1 x world size.
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.1 if args.model == "resnet18" else 0.02
    if args.weight_decay is None:
        args.weight_decay = 5e-4 if args.optimizer == "sgd" else 0.05
    return args


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    """32x32 RGB image -> 10 class scores (~0.03 M parameters). No BatchNorm, unless bn=True
    (`--model cnn-bn`): then a BatchNorm2d follows each convolution."""

    def __init__(self, bn=False):
        super().__init__()
        # (a bias before BatchNorm is wasted: BN subtracts the mean, bias included, so none then)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=not bn)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=not bn)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1, bias=not bn)
        norm = nn.BatchNorm2d if bn else lambda _: nn.Identity()
        self.bn1, self.bn2, self.bn3 = norm(16), norm(32), norm(64)
        self.fc = nn.Linear(64 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = F.max_pool2d(F.relu(self.bn3(self.conv3(x))), 2)
        return self.fc(x.flatten(1))


def build_model(name):
    if name in ("cnn", "cnn-bn"):
        return SmallCNN(bn=name == "cnn-bn")
    from torchvision.models import resnet18
    model = resnet18(weights=None, num_classes=10)
    # The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks a 32x32 image to 8x8 before the
    # first block; for CIFAR the usual stem is one 3x3 stride-1 conv and no pool (~+7% accuracy).
    model.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class AllReduceSum(torch.autograd.Function):
    """Differentiable all-reduce (sum): y = sum over ranks of x. Every rank's loss depends on every
    rank's x through y, so the gradient of x is the sum over ranks of the gradients of y."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """SyncBatchNorm for CPU ranks. PyTorch's nn.SyncBatchNorm runs on GPUs only (on a CPU tensor
    it raises "SyncBatchNorm expected input tensor to be on GPU"), so on CPU `--sync-bn` uses this
    stand-in: the same computation, written with the differentiable all-reduce above. It takes
    two all-reduces per layer (sums, then squared deviations from the global mean: exact and
    stable) where nn.SyncBatchNorm takes one; fine for the CPU runs of this course. Same
    parameters and buffers as BatchNorm2d, so checkpoints move freely between the two."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)  # eval, or one process: plain BatchNorm
        dims = [0] + list(range(2, x.dim()))  # every dim but the channels
        xf = x.float()
        count = torch.tensor([xf.numel() // xf.shape[1]], dtype=xf.dtype, device=xf.device)
        sums = AllReduceSum.apply(torch.cat([xf.sum(dims), count]))  # DDP: sum over all ranks' samples
        n = sums[-1]
        mean = sums[:-1] / n
        shape = [1, -1] + [1] * (x.dim() - 2)
        centred = xf - mean.view(shape)
        var = AllReduceSum.apply(centred.pow(2).sum(dims)) / n  # DDP: biased variance of the global batch
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            with torch.no_grad():  # running variance is unbiased, over the global count
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(var.detach() * n / (n - 1).clamp(min=1), momentum)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_bn(model, device):
    """DDP: every BatchNorm layer -> SyncBatchNorm (nn.SyncBatchNorm on GPUs, the CPU stand-in
    above otherwise). Do it BEFORE wrapping in DDP, so DDP registers the converted layers."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)

    def convert(module):
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlooSyncBatchNorm):
            new = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                    module.track_running_stats).to(device)
            new.load_state_dict(module.state_dict())
            return new
        for name, child in module.named_children():
            setattr(module, name, convert(child))
        return module
    return convert(model)


def register_comm_hook(ddp_model, name, powersgd_rank=2, powersgd_warmup=100):
    """DDP: replace DDP's built-in fp32 all-reduce of each gradient bucket by a communication
    hook. Returns the hook's state (PowerSGD keeps its error feedback there), or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if name == "none":
        return None
    if name in ("fp16", "bf16"):  # cast the bucket to 16 bits, all-reduce, cast back
        hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
        ddp_model.register_comm_hook(None, hook)  # state None = the default process group
        return None
    # PowerSGD: each gradient matrix M (n x m) is sent as two rank-r factors P (n x r), Q (m x r);
    # what the approximation misses is kept per rank (error feedback) and added to the next
    # step's gradient. Plain all-reduce for the first `powersgd_warmup` steps.
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                        start_powerSGD_iter=powersgd_warmup)
    hook = powerSGD_hook.powerSGD_hook
    if dist.get_backend() == "gloo":
        # The hook chains three all-reduces per bucket through future callbacks. On gloo those
        # callbacks run on gloo's worker threads, so with 2+ buckets two ranks can issue their
        # collectives in a different order, and gloo aborts ("gloo::EnforceNotMet") or hangs.
        # Finish each bucket before DDP hands over the next: correct, with less overlap.
        def hook(state, bucket, _powersgd=powerSGD_hook.powerSGD_hook):
            fut = _powersgd(state, bucket)
            fut.wait()
            return fut
    ddp_model.register_comm_hook(state, hook)
    return state


def wrap_model(model, args, ddp):
    """DDP: wrap the model; during backward its gradients are all-reduced (averaged) in buckets
    of --bucket-cap-mb, overlapping communication with the rest of the backward."""
    if args.sync_bn:
        model = convert_sync_bn(model, ddp.device)
    ddp_model = DDP(model, device_ids=[ddp.device.index] if ddp.device.type == "cuda" else None,
                    bucket_cap_mb=args.bucket_cap_mb, static_graph=args.static_graph,
                    find_unused_parameters=args.find_unused_parameters,
                    gradient_as_bucket_view=args.gradient_as_bucket_view)
    register_comm_hook(ddp_model, args.comm_hook, args.powersgd_rank, args.powersgd_warmup)
    return ddp_model


def build_optimizer(model, args, lr, device):
    fused = device.type == "cuda"  # one kernel for the whole update on GPU
    if args.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, dict(momentum=args.momentum)
    else:
        cls, kwargs = torch.optim.AdamW, {}
    kwargs.update(lr=lr, weight_decay=args.weight_decay, fused=fused)
    if args.zero:
        # DDP: ZeRO-1. Each rank builds `cls` over its own shard of the parameters (~1/world of the
        # state: momentum, Adam's two moments), updates only that shard in step(), then broadcasts
        # it so every rank again holds all the weights. Gradients are still all-reduced in full.
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    return cls(model.parameters(), **kwargs)


def optimizer_state_bytes(optimizer):
    """Bytes of optimizer state (momentum, moments, step counts) held by THIS rank; with ZeRO
    that is the local optimizer over this rank's shard."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    return sum(t.nbytes for s in local.state.values() for t in s.values() if torch.is_tensor(t))


def build_scheduler(optimizer, warmup_steps, total_steps):
    """Linear warm-up from lr/warmup to lr, then cosine decay to 0 at total_steps."""
    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def read_cifar10(root):
    """The CIFAR-10 python version: cifar-10-batches-py/{data_batch_1..5,test_batch} are pickled
    dicts with 'data' (N x 3072 uint8, RGB planes) and 'labels'. Returns uint8 images, labels."""
    def read(names):
        xs, ys = [], []
        for name in names:
            with open(os.path.join(root, CIFAR_DIR, name), "rb") as f:
                entry = pickle.load(f, encoding="latin1")
            x, y = np.asarray(entry["data"], dtype=np.uint8), entry["labels"]
            if x.ndim != 2 or x.shape[1] != 3072 or len(y) != len(x):
                raise ValueError(f"{name} does not hold N x 3072 images with N labels")
            xs.append(torch.from_numpy(x.copy()).view(-1, 3, 32, 32))
            ys.append(torch.as_tensor(y, dtype=torch.int64))
        return torch.cat(xs), torch.cat(ys)
    return read(CIFAR_TRAIN), read(["test_batch"])


def cifar_on_disk(root):
    return all(os.path.isfile(os.path.join(root, CIFAR_DIR, n)) for n in CIFAR_TRAIN + ["test_batch"])


def synthetic_cifar(seed, n_train, n_test):
    """CIFAR-shaped uint8 images that can be learned: each class is a fixed random smooth colour
    pattern, each sample that pattern shifted by up to 2 pixels plus noise. Same on every rank."""
    g = torch.Generator().manual_seed(seed + 12345)
    protos = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=32, mode="bilinear")

    def make(n):
        y = torch.randint(0, 10, (n,), generator=g)
        xs = []
        for start in range(0, n, 4096):  # in chunks: float images of 50 000 samples are 600 MB
            x, shift = protos[y[start:start + 4096]], torch.randint(0, 25, (min(4096, n - start),), generator=g)
            for k in range(25):  # move each sample by (-2..2, -2..2) pixels
                x[shift == k] = torch.roll(x[shift == k], shifts=(k // 5 - 2, k % 5 - 2), dims=(2, 3))
            x = x + 0.25 * torch.randn(x.shape, generator=g)
            xs.append(x.clamp(0, 1).mul(255).round().to(torch.uint8))
        return torch.cat(xs), y
    return make(n_train), make(n_test)


def get_data(args, ddp):
    """Rank 0 alone downloads (N ranks downloading into one folder corrupt it) and decides which
    dataset to use; the decision is broadcast so every rank trains on the same data. Returns the
    name and (train, val, test) datasets of uint8 images; train samples also carry their index,
    which seeds their augmentation."""
    choice = [args.data]
    if ddp.is_main and args.data != "synthetic":
        try:
            if not cifar_on_disk(args.data_dir):
                from torchvision.datasets import CIFAR10
                CIFAR10(args.data_dir, train=True, download=True)  # fetch, check md5, extract
            read_cifar10(args.data_dir)  # readable?
            choice = ["cifar10"]
        except Exception as e:  # offline, proxy, disk full, damaged files ...
            reason = " ".join(str(e).split())[:150] or type(e).__name__
            if args.data == "cifar10":
                choice = [f"error:{reason}"]
            else:
                print0(f"warning: CIFAR-10 is not in {args.data_dir}/{CIFAR_DIR} and could not be "
                       f"downloaded ({reason}); using synthetic CIFAR-shaped data instead")
                choice = ["synthetic"]
    dist.broadcast_object_list(choice, src=0)  # DDP: all ranks agree on the dataset
    if choice[0].startswith("error:"):
        fail(f"CIFAR-10 is not readable in {args.data_dir}/{CIFAR_DIR} and could not be "
             f"downloaded ({choice[0][6:]}). Put the python version there, or use --data synthetic",
             code=1)
    n_train = args.subset or 50000
    n_test = max(1, args.subset // 5) if args.subset else 10000
    if choice[0] == "cifar10":
        (x, y), (tx, ty) = read_cifar10(args.data_dir)
        (x, y), (tx, ty) = (x[:n_train], y[:n_train]), (tx[:n_test], ty[:n_test])
    else:
        (x, y), (tx, ty) = synthetic_cifar(args.seed, n_train, n_test)
    test_set = TensorDataset(tx, ty)
    # A fixed split (seed 0, not --seed) so runs with different seeds validate on the same images.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = round(len(x) * args.val_fraction)
    tr, va = order[n_val:].sort().values, order[:n_val].sort().values
    train_set = TensorDataset(x[tr], y[tr], torch.arange(len(tr)))
    val_set = TensorDataset(x[va], y[va]) if n_val else test_set
    return choice[0], train_set, val_set, test_set


class SkipSampler(Sampler):
    """Yields the wrapped sampler's indices after skipping the first `skip`: a run resumed in the
    middle of an epoch continues with the very samples the interrupted run would have seen next."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        for i, index in enumerate(self.sampler):
            if i >= self.skip:
                yield index

    def __len__(self):
        return len(self.sampler) - self.skip


def augment(x, index, epoch, seed, pad=4):
    """Random crop (zero padding 4) and horizontal flip of a uint8 batch, on its device. Each
    sample's crop and flip are a hash of (seed, epoch, sample index), not a draw from a random
    generator: the same on any number of ranks, and a resumed run repeats them exactly."""
    n, c, h, w = x.shape
    r = (index.to(x.device) * 7919 + epoch * 104729 + seed * 1299709 + 1) % 2147483647
    for _ in range(3):  # Lehmer steps: scramble neighbouring indices
        r = r * 48271 % 2147483647
    k = 2 * pad + 1
    dy, dx, flip = r % k, r // k % k, (r // (k * k) % 2).bool()
    ar_h, ar_w = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
    rows = dy[:, None] + ar_h  # (n, h)
    cols = dx[:, None] + torch.where(flip[:, None], w - 1 - ar_w, ar_w)  # (n, w), reversed = flip
    xp = F.pad(x, (pad, pad, pad, pad))
    return xp[torch.arange(n, device=x.device)[:, None, None, None],
              torch.arange(c, device=x.device)[None, :, None, None],
              rows[:, None, :, None], cols[:, None, None, :]]


def to_input(x, device, mean, std, augment_args=None):
    """uint8 images -> normalised float on the device (optionally augmented first)."""
    x = x.to(device, non_blocking=True)
    if augment_args is not None:
        x = augment(x, *augment_args)
    return (x.float().div_(255) - mean) / std


# ----------------------------------------------------------------------------------------------
# Training and evaluation
# ----------------------------------------------------------------------------------------------
def train_step(ddp_model, forward, optimizer, scaler, micro_batches, amp_dtype, clip_grad):
    """One optimizer step over a list of (x, y) micro-batches. Gradients of all micro-steps add up
    locally; only the last micro-step's backward all-reduces. Returns (loss sum, correct) over
    the micro-batches as device tensors (no host sync). `forward` is the DDP model or its
    torch.compile'd wrapper; `ddp_model` is the DDP module itself (for no_sync)."""
    optimizer.zero_grad(set_to_none=True)
    device = micro_batches[0][0].device
    stats = torch.zeros(2, device=device)
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        # DDP: no_sync must cover the forward too: DDP decides in forward whether the coming
        # backward all-reduces. Wrapping only backward() still communicates on every micro-step.
        with ddp_model.no_sync() if i < n - 1 else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = forward(x)
                loss = F.cross_entropy(logits, y)
            scaler.scale(loss / n).backward()  # / n: the sum over micro-steps is the mean
        stats += torch.stack([loss.detach().float() * len(y), (logits.argmax(1) == y).sum().float()])
    if clip_grad:
        scaler.unscale_(optimizer)  # fp16: clip the true gradients, not the loss-scaled ones
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), clip_grad)  # same on every rank
    scaler.step(optimizer)  # fp16: skips the step if any gradient is inf/nan (scale too high)
    scaler.update()
    return stats


@torch.no_grad()
def evaluate(model, dataset, ddp, batch_size, mean, std, amp_dtype):
    """Exact accuracy across ranks. DistributedSampler would pad the shards with repeated samples
    to make them equal; here rank r takes samples r, r+W, r+2W, ... (no padding, no sample twice)
    and the sums are all-reduced, so the count is exactly len(dataset). `model` is the bare
    model (model.module): the shards may differ by one batch, and a DDP forward can run a
    collective (buffer broadcast) that would then wait forever for the rank that has finished."""
    model.eval()
    shard = Subset(dataset, range(ddp.rank, len(dataset), ddp.world_size))
    totals = torch.zeros(3, device=ddp.device, dtype=torch.float64)  # loss sum, correct, count
    for x, y in DataLoader(shard, batch_size=2 * batch_size, generator=torch.Generator()):
        x, y = to_input(x, ddp.device, mean, std), y.to(ddp.device, non_blocking=True)
        with torch.autocast(ddp.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x)
        totals += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                               (logits.argmax(1) == y).sum().double(),
                               torch.tensor(float(len(y)), device=ddp.device, dtype=torch.float64)])
    dist.all_reduce(totals)  # DDP: sum the shards' counts
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), int(correct), int(count)


@torch.no_grad()
def verify_sync(model):
    """None if every rank holds bitwise-identical parameters, else (name, max |difference|) of the
    first tensor that differs. Elementwise max and min over ranks are equal iff all ranks agree."""
    named = [(n, p.detach().reshape(-1).double()) for n, p in model.named_parameters()]
    hi = torch.cat([p for _, p in named])
    lo = hi.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)  # DDP: same result on every rank, so every rank
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)  # takes the same decision below
    diff = hi - lo
    bad = diff != 0  # NaN counts as a difference too
    if not bool(bad.any()):
        return None
    first = int(bad.nonzero()[0])
    start = 0
    for name, p in named:
        if first < start + p.numel():
            return name, float(diff[start:start + p.numel()].nan_to_num(nan=float("inf")).max())
        start += p.numel()


def peak_memory(device):
    """Peak memory of this rank in bytes: CUDA max allocated, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rng_state(device):
    """This rank's random generator states, as tensors and ints (weights_only=True loads them)."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": torch.tensor(mt, dtype=torch.int64), "python_gauss": gauss,
             "numpy": torch.from_numpy(np_keys.astype(np.int64)),
             "numpy_pos": int(np_pos), "numpy_gauss": [int(np_has_gauss), float(np_gauss)]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"].cpu())  # map_location moved it to `device`: bring it back
    random.setstate((3, tuple(state["python"].tolist()), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].cpu().numpy().astype(np.uint32),
                         state["numpy_pos"], *state["numpy_gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def make_profiler(args, ddp):
    """torch.profiler on rank 0: skip step 1 (warm-up effects), record steps 3-5 after one more
    warm-up step, then print the top operators and write a Chrome trace (chrome://tracing,
    https://ui.perfetto.dev)."""
    path = os.path.join(args.checkpoint_dir, "profile_rank0.json")

    def on_ready(prof):
        sort = "self_cuda_time_total" if ddp.device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=12), flush=True)
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        prof.export_chrome_trace(path)
        print(f"profile: trace of 3 steps written to {path}", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if ddp.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts, on_trace_ready=on_ready,
                                  schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1))


def main(argv=None):
    """Train; returns the final progress state and metrics (the tests call this under mp.spawn)."""
    args = parse_args(argv)
    ddp = setup(args.backend)  # DDP: join the process group; pick this rank's device
    on_gpu = ddp.device.type == "cuda"
    amp = {"auto": "bf16" if on_gpu else "off"}.get(args.amp, args.amp)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[amp]
    set_seed(args.seed)  # same seed everywhere -> same initial weights (DDP also broadcasts them)
    dataset, train_set, val_set, test_set = get_data(args, ddp)
    mean = torch.tensor(MEAN, device=ddp.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=ddp.device).view(1, 3, 1, 1)

    # DDP: each rank reads a different 1/world_size of the shuffled indices. Every shard has the
    # same length (the sampler pads) and drop_last drops the same short final batch on every
    # rank, so all ranks run the same number of steps: a mismatch would hang in all-reduce.
    sampler = DistributedSampler(train_set, num_replicas=ddp.world_size, rank=ddp.rank,
                                 shuffle=True, seed=args.seed)
    skipper = SkipSampler(sampler)
    workers = args.workers if args.workers is not None else (4 if on_gpu else 0)
    # Its own generator: every iter(loader) draws the workers' base seed from it, and drawing from
    # the global RNG instead would shift that stream differently in a resumed run.
    loader_rng = torch.Generator()
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=skipper, drop_last=True,
                        num_workers=workers, pin_memory=on_gpu, generator=loader_rng)
    steps_per_epoch = len(sampler) // args.batch_size // args.accum_steps
    if steps_per_epoch == 0:
        fail(f"the training set ({len(train_set)} samples) gives each of the {ddp.world_size} ranks "
             f"{len(sampler)} samples, less than one step of {args.batch_size} x "
             f"{args.accum_steps} micro-batches: lower --batch-size or --accum-steps")
    total_steps = args.epochs * steps_per_epoch
    run_steps = min(total_steps, args.max_steps) if args.max_steps else total_steps
    warmup_steps = min(total_steps, round(args.warmup_epochs * steps_per_epoch))

    model = build_model(args.model).to(ddp.device)
    ddp_model = wrap_model(model, args, ddp)
    # DDP first, then compile: the compiler then sees DDP's bucket boundaries and can overlap
    # each bucket's all-reduce with the rest of the backward (compiling first hides them).
    forward = torch.compile(ddp_model) if args.compile else ddp_model
    world_lr = args.lr if args.no_lr_scaling else args.lr * ddp.world_size  # linear scaling rule
    optimizer = build_optimizer(ddp_model, args, world_lr, ddp.device)
    scheduler = build_scheduler(optimizer, warmup_steps, total_steps)
    scaler = torch.amp.GradScaler(ddp.device.type, enabled=amp == "fp16")

    # Progress state: `epoch` is the epoch in progress, `epoch_step` its optimizer steps done.
    state = {"epoch": 0, "epoch_step": 0, "step": 0, "best_acc": -1.0, "bad_epochs": 0, "best": []}
    path = args.resume
    if path == "auto":
        path = os.path.join(args.checkpoint_dir, "last.pt")
        if not os.path.isfile(path):
            print0(f"resume: no {path} yet; starting from scratch")
            path = None
    if path:
        # DDP: every rank loads the same file onto its own device (map_location), weights only.
        ckpt = load_checkpoint(path, ddp.device, model=ddp_model.module, optimizer=optimizer,
                               scheduler=scheduler, scaler=scaler)
        state.update({k: ckpt[k] for k in state if k in ckpt})
        if ckpt.get("world_size") == ddp.world_size and "rng" in ckpt:
            set_rng_state(ckpt["rng"][ddp.rank], ddp.device)  # DDP: each rank its own state
        else:
            print0(f"warning: {path} was saved by {ckpt.get('world_size')} ranks, this run has "
                   f"{ddp.world_size}: data order and random state differ from the original run")
        if state["epoch_step"] >= steps_per_epoch:
            state["epoch"], state["epoch_step"] = state["epoch"] + 1, 0
        print0(f"resume: {path} at epoch {state['epoch'] + 1}, step {state['step']}"
               if state["epoch"] < args.epochs else f"resume: {path} has finished all {args.epochs} epochs")

    def save(filename):
        """Every rank calls this: the RNG states are gathered from all ranks, rank 0 writes."""
        rngs = [None] * ddp.world_size
        dist.all_gather_object(rngs, rng_state(ddp.device))  # DDP: collect every rank's RNG
        if args.zero:
            # DDP: ZeRO's state is spread over the ranks. consolidate_state_dict is a collective
            # (every rank must call it); afterwards rank 0 alone can build the full state_dict,
            # in the same format as the unsharded optimizer's. Resume loads it on every rank and
            # each keeps its own shard.
            optimizer.consolidate_state_dict(to=0)
        opt_state = optimizer.state_dict() if ddp.is_main or not args.zero else None
        save_checkpoint({"model": ddp_model.module.state_dict(),  # DDP: the bare model's weights
                         "optimizer": opt_state, "scheduler": scheduler.state_dict(),
                         "scaler": scaler.state_dict(), "rng": rngs, "world_size": ddp.world_size,
                         "args": vars(args), **state},
                        os.path.join(args.checkpoint_dir, filename))

    print0(f"start: data {dataset} | model {args.model} | train {len(train_set)} | val {len(val_set)} "
           f"| test {len(test_set)} | world {ddp.world_size} | backend {ddp.backend} | device "
           f"{ddp.device.type} | amp {amp} | batch {args.batch_size}/rank x {args.accum_steps} accum, "
           f"{args.batch_size * args.accum_steps * ddp.world_size} global | lr {world_lr:g} | "
           f"steps {state['step']}->{run_steps} of {total_steps}"
           + (" | sync_bn" if args.sync_bn else "") + (" | zero" if args.zero else "")
           + (f" | comm_hook {args.comm_hook}" if args.comm_hook != "none" else ""))

    prof = make_profiler(args, ddp) if args.profile and ddp.is_main else None
    if prof:
        prof.start()
    t_start = t_log = time.perf_counter()
    start_step = state["step"]
    stats = torch.zeros(2, device=ddp.device)  # loss sum, correct since the last log line
    n_seen, train_loss, val_acc = 0, float("nan"), float("nan")
    stop = bool(args.patience) and state["bad_epochs"] >= args.patience  # resumed after a stop
    while state["epoch"] < args.epochs and state["step"] < run_steps and not stop:
        epoch = state["epoch"]
        sampler.set_epoch(epoch)  # DDP: without this every epoch repeats epoch 0's order
        skipper.skip = state["epoch_step"] * args.accum_steps * args.batch_size
        loader_rng.manual_seed(args.seed * 100003 + epoch * 1009 + ddp.rank)  # worker seeds
        batches = iter(loader)
        while state["epoch_step"] < steps_per_epoch and state["step"] < run_steps:
            micro = []
            for _ in range(args.accum_steps):
                x, y, index = next(batches)
                micro.append((to_input(x, ddp.device, mean, std, (index, epoch, args.seed)),
                              y.to(ddp.device, non_blocking=True)))
            stats += train_step(ddp_model, forward, optimizer, scaler, micro, amp_dtype, args.clip_grad)
            scheduler.step()
            n_seen += args.batch_size * args.accum_steps
            state["step"] += 1
            state["epoch_step"] += 1
            step = state["step"]
            if prof:
                prof.step()
            if args.verify_sync and step % args.verify_sync == 0:
                mismatch = verify_sync(ddp_model.module)
                if mismatch:
                    fail(f"parameters differ across ranks at step {step}: first differing tensor "
                         f"'{mismatch[0]}' (max difference {mismatch[1]:.3g}). A rank changed its "
                         "weights outside DDP's all-reduce", code=1)
            if step % args.log_every == 0 or step == run_steps:
                # DDP: one small all-gather per log line: global loss/accuracy, every rank's memory.
                mine = torch.cat([stats.double(), torch.tensor([n_seen, peak_memory(ddp.device)],
                                                               dtype=torch.float64, device=ddp.device)])
                every = [torch.zeros_like(mine) for _ in range(ddp.world_size)]
                dist.all_gather(every, mine)
                every = torch.stack(every).cpu()  # waits for the device: once per log line
                loss_sum, correct, count = every[:, :3].sum(0).tolist()
                now = time.perf_counter()
                eta = (run_steps - step) * (now - t_start) / (step - start_step)
                train_loss = loss_sum / count
                print0(f"epoch {epoch + 1}/{args.epochs} | step {step}/{run_steps} | "
                       f"loss {train_loss:.4f} | acc {100 * correct / count:.2f}% | "
                       f"lr {scheduler.get_last_lr()[0]:.4g} | {count / (now - t_log):.0f} samples/s | "
                       f"mem {every[:, 3].max() / 2**20:.0f} MiB | eta {datetime.timedelta(seconds=round(eta))}")
                t_log, n_seen = now, 0
                stats.zero_()
            if (args.save_every and step % args.save_every == 0
                    and state["epoch_step"] < steps_per_epoch):
                save("last.pt")
        if state["epoch_step"] < steps_per_epoch:  # stopped by --max-steps inside the epoch
            save("last.pt")
            break
        val_loss, val_acc, correct, count = evaluate(ddp_model.module, val_set, ddp, args.batch_size,
                                                     mean, std, amp_dtype)
        improved = val_acc > state["best_acc"]
        if improved:
            state["best_acc"] = val_acc
        state["bad_epochs"] = 0 if improved else state["bad_epochs"] + 1
        # DDP: rank 0 decides whether to stop and tells everyone: a rank that stopped alone would
        # leave the others waiting in their next all-reduce.
        flag = torch.tensor([int(bool(args.patience) and state["bad_epochs"] >= args.patience)],
                            device=ddp.device)
        dist.broadcast(flag, src=0)
        stop = bool(flag.item())
        state["epoch"], state["epoch_step"] = epoch + 1, 0
        best_name, evicted = f"best-epoch{epoch + 1:03d}.pt", []
        if args.keep_best:  # highest accuracy first, the earlier epoch on ties
            ranked = sorted(state["best"] + [[val_acc, epoch + 1, best_name]], key=lambda b: (-b[0], b[1]))
            state["best"], evicted = ranked[:args.keep_best], [b[2] for b in ranked[args.keep_best:]]
        if not args.keep_best or best_name in evicted:
            best_name = None
        print0(f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | "
               f"val_acc {100 * val_acc:.2f}% ({correct}/{count}) | best {100 * state['best_acc']:.2f}%"
               + (" | early stop" if stop else ""))
        save("last.pt")
        if best_name:
            save(best_name)
        if ddp.is_main:
            for name in evicted:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(args.checkpoint_dir, name))
    if prof:
        prof.stop()

    if state["step"] == start_step or state["epoch_step"]:  # no epoch ended in this run
        _, val_acc, _, _ = evaluate(ddp_model.module, val_set, ddp, args.batch_size, mean, std, amp_dtype)
    test_loss, test_acc, correct, count = evaluate(ddp_model.module, test_set, ddp, args.batch_size,
                                                   mean, std, amp_dtype)
    opt_bytes = optimizer_state_bytes(optimizer)  # this rank's; with --zero ~1/world of the total
    print0(f"done: data {dataset} | model {args.model} | world {ddp.world_size} | backend "
           f"{ddp.backend} | device {ddp.device.type} | epochs {state['epoch']} | steps {state['step']} "
           f"| loss {train_loss:.4f} | val_acc {100 * val_acc:.2f}% | best_val_acc "
           f"{100 * max(state['best_acc'], 0):.2f}% | test_acc {100 * test_acc:.2f}% ({correct}/{count}) "
           f"| opt_state {opt_bytes / 2**20:.3f} MiB/rank | time {time.perf_counter() - t_start:.1f}s")
    # DDP: free the DDP wrapper (it sits in a reference cycle, hence gc) before the process group:
    # a DDP that never ran a backward (a resumed run with nothing left to do) was seen to abort
    # the process at exit ("terminate called without an active exception") on gloo otherwise.
    del forward, ddp_model
    gc.collect()
    cleanup()
    return {**state, "dataset": dataset, "loss": train_loss, "val_acc": val_acc, "test_acc": test_acc,
            "opt_state_bytes": opt_bytes}


if __name__ == "__main__":
    main()
