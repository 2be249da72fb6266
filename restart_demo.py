"""What lesson 3 (multi_gpu_torchrun.py, its only importer) needs but does not teach: a task
worth learning that every rank can make (generated data, a small MLP) and the demo's crash."""

import os
import signal

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def make_dataset(n, seed, dim=20):
    """Targets come from a fixed random 'teacher' network plus a little noise; the student must
    find the function. The same on every rank (its own generator)."""
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(n, dim, generator=g)
    w1 = torch.randn(dim, 64, generator=g) / dim**0.5
    w2 = torch.randn(64, 1, generator=g)
    y = torch.tanh(x @ w1) @ w2
    y = (y - y.mean()) / y.std() + 0.05 * torch.randn(n, 1, generator=g)
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
