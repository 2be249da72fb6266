"""What every lesson needs, written once: join the group (torchrun, mp.spawn, srun), pick the
device, print on rank 0, stop in one line, save and load checkpoints, leave. Lesson 0 by hand."""

import argparse
import datetime
import gc
import os
import socket
import sys
from collections import namedtuple

import torch
import torch.distributed as dist

# rank: 0 .. world_size-1 over all nodes (picks the data shard); local_rank: on this node (GPU).
Dist = namedtuple("Dist", "rank local_rank world_size device backend")


def fail(message, code=2, rank0_only=False):
    """One `error:` line, no traceback. Exit 2: a mistake to fix; 1: a failure at run time."""
    if not rank0_only or get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one `error:` line (from rank 0: every rank parses)."""

    def error(self, message):
        fail(f"{message} (see --help)", rank0_only=True)


def positive_int(text):
    """argparse type=positive_int: a whole number >= 1, else one `error:` line."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def setup(backend="auto", rank=None, world_size=None, timeout_s=None):
    """Join the group. mp.spawn passes rank and world size; torchrun and srun set RANK etc."""
    env = os.environ
    if rank is None:
        try:
            rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank, local_world_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
        except KeyError as e:
            fail(f"{e.args[0]} is not set: start it with torchrun --nproc_per_node=2 {sys.argv[0]}")
    else:
        # mp.spawn starts every process on this machine: local and global rank are the same.
        local_rank, local_world_size = rank, world_size
    device, backend = pick_device(local_rank, local_world_size, backend)
    if device.type == "cuda":
        # Before joining: NCCL binds each process to the GPU that is current when it joins.
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in env:
        # CPU ranks share the cores: a full thread pool each would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    store = None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun may hand a restarted attempt the old store, holding dead peers' addresses:
        # a namespace per attempt (docs/multinode.md#restarts-the-rule).
        agent = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size)
        store = dist.PrefixStore(f"attempt{env['TORCHELASTIC_RESTART_COUNT']}", agent)
    try:
        # Rank 0 hosts a store at MASTER_ADDR:MASTER_PORT; the others meet there.
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s or float(env.get("DDP_TIMEOUT", 600))),
            device_id=device if device.type == "cuda" else None,
            store=store,
        )
    except dist.DistError as e:
        # A rank that never comes, an address no one reaches, a port in use: one line, no hang.
        why = str(e).splitlines()[0][:200]
        fail(f"rank {rank} of {world_size} could not join the process group: {why}", code=1)
    return Dist(rank, local_rank, world_size, device, backend)


def pick_device(local_rank, local_world_size, backend="auto"):
    """The local rank's GPU when this node has one per process, else the CPU and gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # srun --gpus-per-task shows each task its own GPU, as cuda:0 (RANK from srun, not mp.spawn).
    srun = "RANK" in os.environ and "SLURM_PROCID" in os.environ
    bound = gpus == 1 and srun and "TORCHELASTIC_RUN_ID" not in os.environ
    if gpus >= local_world_size or bound:
        # The LOCAL rank: on node 1 of two 8-GPU nodes the global ranks are 8..15, GPUs 0..7.
        device = torch.device("cuda", 0 if bound else local_rank)
        return device, "nccl" if backend == "auto" else backend
    if backend == "nccl":
        fail(f"--backend nccl needs a GPU per process: {gpus} visible for {local_world_size}")
    if gpus and local_rank == 0:
        print(f"warning: {gpus} GPU(s), {local_world_size} processes: all on CPUs", file=sys.stderr)
    return torch.device("cpu"), "gloo"


def free_port():
    """A port free now: where mp.spawn's parent tells its workers to meet."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def cleanup():
    """Leave the group. `del` the DDP model first: alive at exit, it can abort gloo."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank():
    """The global rank; before the group is joined, what the launcher says (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def print0(*args):
    """Print on global rank 0 only (not N copies), in one write: no other print lands inside."""
    if get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)


def save_checkpoint(state, path, writer=None):
    """Every rank calls it; the writer (rank 0 unless told) writes atomically: a crash keeps the
    old file (a new temp file, fsync, rename, fsync the folder)."""
    if get_rank() == 0 if writer is None else writer:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.urandom(8).hex()}.tmp"
        with open(tmp, "xb") as f:
            torch.save(state, f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder_fd = os.open(folder, os.O_RDONLY)
        os.fsync(folder_fd)
        os.close(folder_fd)
    if dist.is_initialized():
        # Nobody reads or resumes from a file still being written.
        dist.barrier()


def load_checkpoint(path, **targets):
    """load_checkpoint(p, model=m, optimizer=o): each from its key; weights_only: no code runs."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        for key, obj in targets.items():
            obj.load_state_dict(ckpt[key])
    except Exception as e:
        fail(f"checkpoint {path} cannot be used ({str(e).splitlines()[0][:200]})", code=1)
    return ckpt
