"""What every lesson must get right, once: join the group, device, cleanup, print, checkpoints."""

import datetime
import gc
import os
import random
import socket
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Dist:  # where this process sits in the job
    rank: int  # global rank: 0 .. world_size-1, across all nodes
    local_rank: int  # rank on this node: picks the GPU
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    launcher: str  # "torchrun" (or env set by hand), "spawn" or "slurm" (srun tasks)
    is_main = property(lambda self: self.rank == 0)


def fail(message, code=2, rank0_only=False):
    """One `error:` line, no traceback; exit 2: a mistake to fix, 1: run time. rank0_only: once."""
    if not rank0_only or get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _launch_env(rank, world_size):
    env = os.environ
    if rank is not None:  # mp.spawn passes them (one node); torchrun (or srun: slurm/) sets env
        return "spawn", rank, world_size, rank, world_size, 0
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        fail(
            f"{', '.join(missing)} not set (a launcher sets them). Launch with: torchrun "
            f"--standalone --nproc_per_node=2 {os.path.basename(sys.argv[0])} (or see slurm/)"
        )
    # The local rank picks the GPU; the global rank equals it only when the job is one node.
    if "LOCAL_RANK" not in env and env["WORLD_SIZE"] not in ("1", env.get("LOCAL_WORLD_SIZE")):
        fail(
            f"LOCAL_RANK is not set (RANK {env['RANK']} of WORLD_SIZE {env['WORLD_SIZE']}): the "
            "global rank is this node's GPU index only on one node. Export LOCAL_RANK per process"
        )
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    node_rank = int(env.get("GROUP_RANK", rank // local_world))  # torchrun's name for it
    launcher = "slurm" if "SLURM_PROCID" in env and "TORCHELASTIC_RUN_ID" not in env else "torchrun"
    return launcher, rank, world_size, int(env.get("LOCAL_RANK", rank)), local_world, node_rank


def pick_device(local_rank, backend="auto"):
    """The local rank's GPU when there is one, else the CPU; NCCL on CUDA, gloo otherwise."""
    if not torch.cuda.is_available():
        if backend == "nccl":
            fail("--backend nccl needs CUDA GPUs, and none is visible: use --backend gloo")
        return torch.device("cpu"), "gloo"
    if local_rank >= torch.cuda.device_count():
        fail(
            f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible. "
            "Start at most one process per GPU (--nproc_per_node)"
        )
    # Local rank, never global rank: on node 2 the global ranks are 8..15 but the GPUs are 0..7.
    return torch.device("cuda", local_rank), ("nccl" if backend == "auto" else backend)


def setup(backend="auto", rank=None, world_size=None, timeout_s=None):
    """Join the process group. Pass rank and world_size under mp.spawn; torchrun/srun set env."""
    launcher, rank, world_size, local_rank, local_world, node_rank = _launch_env(rank, world_size)
    device, backend = pick_device(local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds each process to its own GPU
    else:  # CPU ranks share the cores: one thread pool each would oversubscribe them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("DDP_TIMEOUT", 600)))
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    try:  # env://: rank 0 hosts a store at MASTER_ADDR:MASTER_PORT, the other ranks connect to it
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=_torchrun_shared_store(world_size, timeout),
        )
    except dist.DistError as e:
        if "EADDRINUSE" in str(e):
            fail(
                f"port {port} is already in use on {addr}: pick a free one "
                "(torchrun --master-port, or MASTER_PORT=...)"
            )
        fail(
            f"rank {rank} could not join the process group at {addr}:{port} within "
            f"{timeout.total_seconds():.0f} s ({str(e).splitlines()[0]}). Are all {world_size} "
            "ranks started, and is MASTER_ADDR reachable?",
            code=1,
        )
    return Dist(rank, local_rank, world_size, local_world, node_rank, device, backend, launcher)


def _torchrun_shared_store(world_size, timeout):
    """Why: plain torchrun keeps ONE store for all restart attempts, so each attempt gets its own
    namespace (the dead attempt's keys hold addresses of gone peers). A node whose workers did
    not fail restarts uncounted: 2+ nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (fresh ones)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # torchrun gave this attempt a fresh store: the standard env:// path
    restarts, nodes = int(env["TORCHELASTIC_MAX_RESTARTS"]), int(env["GROUP_WORLD_SIZE"])
    if env["RANK"] == "0" and restarts > 0 and nodes > 1:
        print(
            "warning: torchrun shares one store across restarts, and on several nodes a restart "
            "can hang: start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            file=sys.stderr,
        )
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, timeout=timeout)
    return dist.PrefixStore(f"attempt{env['TORCHELASTIC_RESTART_COUNT']}", store)


def cleanup():
    """Leave the group. `del model` first: DDP alive at exit can abort gloo; gc frees its cycles."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def print0(*args, **kwargs):
    """Print on global rank 0 only, so N ranks do not print N copies."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def set_seed(seed, rank=0):
    """Same seed on every rank -> same init; add the rank for per-rank randomness (augmentation)."""
    for seed_fn in (random.seed, np.random.seed, torch.manual_seed):
        seed_fn(seed + rank)


def free_port(host="127.0.0.1"):  # a port free now: mp.spawn launchers must pick MASTER_PORT
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def save_checkpoint(state, path, writer=None):
    """Atomic: temp file, fsync, rename (a crash mid-save leaves the old file). Call on every rank:
    rank 0 writes (or where `writer` is True: local rank 0 on node-local disks), all then wait."""
    if writer if writer is not None else get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp := f"{path}.tmp{os.getpid()}", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody reads or resumes from a file still being written


def load_checkpoint(path, device="cpu", **targets):
    """load_checkpoint(p, model=m, optimizer=opt): restore each object from the key of its name.
    To the CPU (load_state_dict copies to each parameter's device); weights_only: no pickles."""
    if not os.path.isfile(path):
        fail(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupt, or not a torch file
        fail(f"checkpoint {path} is unreadable ({str(e).splitlines()[0][:120]}). Delete it", code=1)
    for key, obj in targets.items():
        try:
            obj.load_state_dict(ckpt[key])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            fail(f"checkpoint {path} does not match this run's {key}: {str(e)[:200]!r}", code=1)
    return ckpt
