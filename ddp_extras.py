"""Rules that several lessons share but not every one: the `--amp auto` choice (lessons 2, 5, 6),
one download per node (1, 2, 5), PowerSGD on gloo (6, 7) and a free port for mp.spawn (5, 6). Each
is written once, here; what every lesson needs stays in ddp_common.py, which this module does not
repeat."""

import contextlib
import datetime
import fcntl
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook


def pick_amp(choice, device):
    """--amp auto: bf16 where the GPU has it natively (a T4 only emulates it), else fp16 (with a
    GradScaler); off on the CPU. Returns "bf16", "fp16" or "off"."""
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "off"
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16"
    return "fp16"


@contextlib.contextmanager
def folder_lock(folder):
    """Hold an exclusive lock on FOLDER/.lock. Why: each node's local rank 0 downloads, and nodes
    that share a disk (a home directory on NFS) must take turns, not write the same files."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def long_barrier(seconds=3600):
    """A barrier with a limit of its own. Why: the ranks that wait for a download or a
    tokenizer would otherwise be ended by the collective timeout (600 s) of the default group."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def powersgd_hook(state, bucket):
    """PowerSGD for any backend: ddp_model.register_comm_hook(state, powersgd_hook). Why: the hook
    chains three all-reduces per bucket through future callbacks, which gloo runs on its own
    threads, so with 2+ buckets two ranks can issue them in different orders (gloo aborts or
    hangs). On gloo each bucket finishes before DDP hands over the next: correct, less overlap."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    if dist.get_backend(state.process_group) == "gloo":
        future.wait()
    return future


def free_port(host="127.0.0.1"):
    """A port free now: the parent of mp.spawn picks MASTER_PORT for its workers."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
