"""Checkpoints a long job can trust: written atomically, so a crash mid-write leaves the last good
file, and read back safely, so a file handed to you cannot run code or crowd every rank onto
GPU 0. Lessons 1-5 and 7 save and resume through these two functions."""

import os

import torch
import torch.distributed as dist

from ddp_common import fail, get_rank


def save_checkpoint(state, path, writer=None):
    """Atomic: a temp file beside `path`, fsync, rename, fsync the directory: a crash leaves the
    old file. Call on every rank: rank 0 writes (or where `writer` is True, say local rank 0 on
    node-local disks), then all wait."""
    if writer is None:
        writer = get_rank() == 0
    if writer:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        # A fresh random name, created exclusively (O_EXCL): a link planted in a shared folder is
        # not followed, and two nodes saving to one path never write the same temp file.
        tmp = f"{path}.{os.urandom(8).hex()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # The rename lives in the directory: sync it too, or a power cut can forget it.
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    if dist.is_available() and dist.is_initialized():
        # Nobody reads or resumes from a file still being written.
        dist.barrier()


def load_checkpoint(path, device="cpu", **targets):
    """load_checkpoint(p, model=m, optimizer=opt): restore each object from the key of its name.
    To the CPU (load_state_dict copies to each parameter's device); weights_only: no pickles."""
    if not os.path.isfile(path):
        fail(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        # Truncated, corrupt, or not a torch file.
        fail(f"checkpoint {path} is unreadable ({str(e).splitlines()[0][:120]}). Delete it", code=1)
    for key, obj in targets.items():
        try:
            obj.load_state_dict(ckpt[key])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            fail(f"checkpoint {path} does not match this run's {key}: {str(e)[:200]!r}", code=1)
    return ckpt
