"""What every lesson must get right, once: join the group, pick the device, print, seed, leave.
Checkpoints are in ddp_checkpoint.py; rules that only some lessons share (--amp auto, one download
per node, PowerSGD on gloo, a free port for mp.spawn) are in ddp_extras.py."""

import datetime
import gc
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Dist:
    """Where this process sits in the job."""

    rank: int  # global rank: 0 .. world_size-1, across all nodes
    local_rank: int  # rank on this node: picks the GPU
    world_size: int
    local_world_size: int  # processes on this node
    node_rank: int
    device: torch.device
    backend: str
    launcher: str  # "torchrun" (or env set by hand), "spawn" or "slurm" (srun tasks)

    @property
    def is_main(self):
        return self.rank == 0


def fail(message, code=2, rank0_only=False):
    """One `error:` line, no traceback. Exit 2: a mistake to fix; 1: a failure at run time."""
    if not rank0_only or get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def setup(backend="auto", rank=None, world_size=None, timeout_s=None):
    """Join the process group: lesson 0's calls. Pass rank and world_size under mp.spawn; torchrun
    (and slurm/train_srun.sbatch) tell each process who it is in environment variables."""
    if rank is None:
        launcher = read_launcher_env()
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
        # torchrun calls the node's rank GROUP_RANK; srun tasks are laid out node by node.
        node_rank = int(os.environ.get("GROUP_RANK", rank // local_world_size))
    else:
        # mp.spawn starts every process on this machine: global and local rank are the same.
        launcher = "spawn"
        local_rank = rank
        local_world_size = world_size
        node_rank = 0
    device, backend = pick_device(local_rank, local_world_size, backend)
    if device.type == "cuda":
        # Before init: NCCL binds each process to the GPU that is current when it joins.
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores: a full thread pool each would oversubscribe them.
        torch.set_num_threads(max(1, cpu_count() // local_world_size))
    seconds = timeout_s or float(os.environ.get("DDP_TIMEOUT", 600))
    timeout = datetime.timedelta(seconds=seconds)
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # env://: rank 0 hosts a store at MASTER_ADDR:MASTER_PORT, the others connect to it.
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=torchrun_store(world_size, timeout),
        )
    except RuntimeError as e:
        # A taken port: a DistError from torch 2.7 on, a plain RuntimeError before.
        if "EADDRINUSE" in str(e):
            fail(f"{address} is already in use: pick a free port (--master-port, MASTER_PORT=)")
        if not isinstance(e, dist.DistError):
            raise
        fail(
            f"rank {rank} could not join the process group at {address} within {seconds:.0f} s "
            f"({str(e).splitlines()[0]}). Are all {world_size} ranks started, and is the address "
            "reachable?",
            code=1,
        )
    return Dist(
        rank, local_rank, world_size, local_world_size, node_rank, device, backend, launcher
    )


def read_launcher_env():
    """Check what torchrun (or srun) sets; fill in what one node can infer. Returns the launcher."""
    env = os.environ
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        script = os.path.basename(sys.argv[0])
        fail(
            f"{', '.join(missing)} not set (a launcher sets them). Launch with: "
            f"torchrun --standalone --nproc_per_node=2 {script} (or see slurm/)"
        )
    # The local rank picks the GPU. It equals the global rank only when the job is one node.
    one_node = env["WORLD_SIZE"] in ("1", env.get("LOCAL_WORLD_SIZE"))
    if "LOCAL_RANK" not in env:
        if not one_node:
            fail(
                f"LOCAL_RANK is not set (RANK {env['RANK']} of WORLD_SIZE {env['WORLD_SIZE']}): "
                "the global rank is this node's GPU index only on one node. Export LOCAL_RANK"
            )
        env["LOCAL_RANK"] = env["RANK"]
    env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "TORCHELASTIC_RUN_ID" not in env:
        return "slurm"
    return "torchrun"


def pick_device(local_rank, local_world_size, backend="auto"):
    """The local rank's GPU when every process on this node has one, else the CPU and gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpus >= local_world_size:
        # Local rank, never global: on node 1 the global ranks are 8..15 but the GPUs are 0..7.
        device = torch.device("cuda", local_rank)
    elif gpus == 1 and "," not in visible and visible.strip() != "":
        # A site that binds one GPU per task (srun --gpus-per-task, Kubernetes) shows each
        # process one GPU, named in CUDA_VISIBLE_DEVICES: it is cuda:0 in every process.
        device = torch.device("cuda", 0)
    elif backend == "nccl":
        fail(f"--backend nccl needs a GPU per process: {gpus} visible for {local_world_size}")
    else:
        if gpus > 0 and local_rank == 0:
            print(
                f"warning: {local_world_size} processes on this node but {gpus} GPU(s) visible: "
                f"every rank runs on the CPU with gloo (use --nproc_per_node={gpus} for the GPUs)",
                file=sys.stderr,
                flush=True,
            )
        return torch.device("cpu"), "gloo"
    if backend == "auto":
        backend = "nccl"
    return device, backend


def cpu_count():
    """Cores this process may use: its affinity (Slurm, taskset) on Linux; all of them elsewhere."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    # macOS and Windows have no affinity call.
    return os.cpu_count() or 1


def torchrun_store(world_size, timeout):
    """Why: torchrun hands every restart attempt one store (c10d by default; static rendezvous
    always), holding the dead attempt's keys: addresses of peers that are gone. A namespace per
    attempt makes plain torchrun --max-restarts recover on one node (10/10; 3/10 without it,
    docs/multinode.md#restarts-the-rule)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # torchrun gave this attempt a fresh store: the standard env:// path.
        return None
    restarts = int(env["TORCHELASTIC_MAX_RESTARTS"])
    nodes = int(env["GROUP_WORLD_SIZE"])
    if env["RANK"] == "0" and restarts > 0 and nodes > 1:
        # Each node's agent counts its own restarts: two nodes can pick different namespaces.
        print(
            "warning: restarts on several nodes with one store for all attempts can hang: use "
            "--rdzv-backend=c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (static rendezvous "
            "always shares its store; launch_ddp.sh does both)",
            file=sys.stderr,
        )
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, timeout=timeout)
    return dist.PrefixStore(f"attempt{env['TORCHELASTIC_RESTART_COUNT']}", store)


def cleanup():
    """Leave the group. `del` the DDP model first: alive at exit it can abort gloo."""
    # The wrapper sits in reference cycles: collect them while the group still exists.
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def get_rank():
    """The global rank; before the group is joined, what the launcher says (0 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def print0(*args, **kwargs):
    """Print on global rank 0 only, so N ranks do not print N copies."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def set_seed(seed, rank=0):
    """Same seed on every rank -> same init; add the rank for per-rank randomness (augmentation)."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
