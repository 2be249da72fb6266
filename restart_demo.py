"""What lesson 3 (multi_gpu_torchrun.py, its only importer) needs but does not teach: a task
worth learning that every rank can make (generated data, a small MLP), the demo's crash, how a
surviving rank tells a lost peer from a bug in its own code, and one error line for a bad flag."""

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import TensorDataset

from ddp_common import fail


def make_dataset(n, seed, dim=20):
    """Targets come from a fixed random 'teacher' network plus a little noise; the student must
    find the function. The same on every rank (its own generator)."""
    generator = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(n, dim, generator=generator)
    w1 = torch.randn(dim, 64, generator=generator) / dim**0.5
    w2 = torch.randn(64, 1, generator=generator)
    y = torch.tanh(x @ w1) @ w2
    y = (y - y.mean()) / y.std() + 0.05 * torch.randn(n, 1, generator=generator)
    return TensorDataset(x, y)


def make_model(hidden, dropout, dim=20):
    """No BatchNorm: its statistics depend on the per-rank batch, so the same run on another
    world size would differ by more than float rounding."""
    # Dropout draws random numbers every step: the snapshot must hold each rank's RNG state.
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def maybe_fail(args, step, rank):
    """--fail-at-step: die like a real crash would (SIGKILL: no exception, no cleanup)."""
    marker = args.snapshot + ".failed"
    if step != args.fail_at_step or rank != args.fail_rank or os.path.exists(marker):
        return
    # Remember, so the restarted worker does not die again.
    with open(marker, "w") as f:
        f.write(f"rank {rank} killed itself at step {step}\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"fail: rank {rank} | step {step} | SIGKILL (--fail-at-step)", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def lost_peer(error):
    """Did a collective fail because another rank went away? (gloo raises a plain RuntimeError
    from inside backward; newer code raises dist.DistError.)"""
    text = str(error)
    if isinstance(error, dist.DistError):
        return True
    # A peer cut off the network closes nothing: gloo's collective times out instead.
    signs = ("Connection closed by", "Connection reset by", "remote worker", "Timed out", "NCCL")
    return any(sign in text for sign in signs)


def usage_error(message):
    """Under torchrun every rank parses the arguments: only rank 0 prints the mistake, once."""
    if os.environ.get("RANK", "0") == "0":
        fail(message)
    sys.exit(2)
