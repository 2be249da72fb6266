"""ddp_common.py: the one helper every lesson shares.

What every DDP script must get right, written once: joining the process group under any
launcher (torchrun, mp.spawn, srun), choosing device and backend, cleaning up, printing on rank
0, seeding, and saving/loading checkpoints safely. Models, data and training loops stay in the
lessons.
"""
import datetime
import gc
import os
import random
import re
import socket
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

LAUNCH_HINT = "torchrun --standalone --nproc_per_node=2 {script}"


@dataclass
class Dist:
    """Where this process sits in the job."""
    rank: int              # global rank: 0 .. world_size-1, across all nodes
    local_rank: int        # rank on this node: picks the GPU
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    launcher: str          # "torchrun", "spawn" or "slurm"

    @property
    def is_main(self):
        return self.rank == 0


def fail(message, code=2, rank0_only=False):
    """One line on stderr, no traceback. code 2: a mistake the user can fix; 1: run-time failure.
    rank0_only: every rank fails the same way (a decision they share); print it once."""
    if not rank0_only or get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _env_int(name):
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        fail(f"environment variable {name}={value!r} is not an integer")
    return int(value)


def first_host(nodelist):
    """First host of a Slurm node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        fail(f"cannot read a host name from the Slurm node list {nodelist!r}; set MASTER_ADDR")
    return m.group(1) + (re.split(r"[,-]", m.group(2))[0] if m.group(2) else "")


def _slurm_tasks_on_node(spec, node_id):
    """SLURM_STEP_TASKS_PER_NODE looks like '2(x3),1': expand it and pick this node's count."""
    counts = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        counts += [int(m.group(1))] * int(m.group(2) or 1) if m else []
    return counts[node_id] if node_id < len(counts) else 1


def _launch_env(rank, world_size):
    """Read rank, sizes and the rendezvous address from whichever launcher started us."""
    env = os.environ
    if rank is not None:  # mp.spawn: the parent passes rank/world size, one node
        launcher, local_rank, local_world, node_rank = "spawn", rank, world_size, 0
    elif "RANK" in env or "WORLD_SIZE" in env or "LOCAL_RANK" in env:  # torchrun (or by hand)
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if missing:
            fail(f"incomplete launcher environment: {', '.join(missing)} not set. "
                 f"Launch with: {LAUNCH_HINT.format(script=os.path.basename(sys.argv[0]))}")
        launcher, rank, world_size = "torchrun", _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
        node_rank = _env_int("GROUP_RANK") if "GROUP_RANK" in env else 0
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # srun, one task per GPU, no torchrun
        launcher, rank = "slurm", _env_int("SLURM_PROCID")
        world_size = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
        local_rank, node_rank = _env_int("SLURM_LOCALID"), int(env.get("SLURM_NODEID", 0))
        local_world = _slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"), node_rank)
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost")
        env.setdefault("MASTER_ADDR", first_host(nodes))
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
    else:
        fail("no launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are unset). "
             f"Launch with: {LAUNCH_HINT.format(script=os.path.basename(sys.argv[0]))}")
    if not 0 <= rank < world_size or not 0 <= local_rank < local_world:
        fail(f"inconsistent launcher environment: rank {rank} of {world_size}, "
             f"local rank {local_rank} of {local_world}")
    for v in ("MASTER_ADDR", "MASTER_PORT"):
        if v not in env:
            fail(f"{v} is not set: the address of rank 0 that every rank connects to")
    return launcher, rank, world_size, local_rank, local_world, node_rank


def pick_device(local_rank, backend="auto"):
    """The local rank's GPU when there is one, else the CPU; NCCL on CUDA, gloo otherwise."""
    if backend not in ("auto", "nccl", "gloo"):
        fail(f"unknown backend {backend!r}: use auto, nccl or gloo")
    if not torch.cuda.is_available():
        if backend == "nccl":
            fail("--backend nccl needs CUDA GPUs, and none is visible: use --backend gloo")
        return torch.device("cpu"), "gloo"
    if local_rank >= torch.cuda.device_count():
        fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible. "
             "Start at most one process per GPU (--nproc_per_node)")
    # Local rank, never global rank: on node 2 the global ranks are 8..15 but the GPUs are 0..7.
    return torch.device("cuda", local_rank), ("nccl" if backend == "auto" else backend)


def setup(backend="auto", rank=None, world_size=None, timeout_s=None):
    """Join the process group. Pass rank and world_size under mp.spawn; torchrun and srun set env."""
    launcher, rank, world_size, local_rank, local_world, node_rank = _launch_env(rank, world_size)
    device, backend = pick_device(local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds each process to its own GPU
    else:  # CPU ranks share the cores: one thread pool each would oversubscribe them
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("DDP_TIMEOUT", 600)))
    addr, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT")
    # Under torchrun the agent already serves the store; elsewhere global rank 0 hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0 and not agent_store),
                              timeout=timeout, wait_for_workers=False)
    except dist.DistNetworkError as e:
        if "EADDRINUSE" in str(e) or "in use" in str(e):
            fail(f"port {port} is already in use on {addr}: pick a free one "
                 "(torchrun --master-port, or MASTER_PORT=...)")
        fail(f"cannot reach rank 0 at {addr}:{port} ({str(e).splitlines()[0]}). Check MASTER_ADDR, "
             "MASTER_PORT and the firewall", code=1)
    # torchrun keeps one store across restarts; keys from a killed attempt must not be read by the
    # next one, so each attempt gets its own namespace (see lesson 3).
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if device.type == "cuda" else None)
    except dist.DistError as e:
        fail(f"rank {rank} could not join the process group within {timeout.total_seconds():.0f} s "
             f"({str(e).splitlines()[0]}). Are all {world_size} ranks started?", code=1)
    return Dist(rank, local_rank, world_size, local_world, node_rank, device, backend, launcher)


def cleanup():
    """Leave the process group. Drop your DDP model first (`del model`): a DDP wrapper that is
    still alive when Python exits keeps gloo work objects that can abort the process at exit
    ("terminate called without an active exception"). gc.collect() frees the cycles DDP builds."""
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
    """Seed Python, NumPy and torch. Same seed on every rank -> same init; add the rank for
    per-rank randomness (augmentation, dropout)."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def free_port(host="127.0.0.1"):
    """A port the OS says is free now (for mp.spawn launchers that must pick MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def save_checkpoint(state, path, writer=None):
    """Atomic save: write a temp file, fsync, rename over the old one. A crash mid-save leaves the
    previous checkpoint intact. Call on every rank: global rank 0 writes (or `writer` is True on the
    ranks that should, e.g. local rank 0 with node-local disks), then all wait at a barrier."""
    if writer if writer is not None else get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody reads or resumes from a file still being written


def load_checkpoint(path, device, **targets):
    """Load a checkpoint onto `device` (map_location: rank 3 must not load onto GPU 0), with
    weights_only=True (no arbitrary pickles). Each keyword names a key of the checkpoint and an
    object to restore from it: load_checkpoint(p, dev, model=model.module, optimizer=opt).
    Returns the whole checkpoint dict. Any problem is one error line."""
    if not os.path.isfile(path):
        fail(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupt, or not a torch file
        fail(f"checkpoint {path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:160]}). "
             "Delete it or resume from another file", code=1)
    if not isinstance(ckpt, dict):
        fail(f"checkpoint {path} is not a dict of states", code=1)
    for key, obj in targets.items():
        if key not in ckpt:
            fail(f"checkpoint {path} has no '{key}' entry (has: {', '.join(ckpt)})", code=1)
        try:
            obj.load_state_dict(ckpt[key])
        except (RuntimeError, ValueError, KeyError) as e:
            detail = " ".join(str(e).split())[:200]
            fail(f"checkpoint {path} does not match this run's {key}: {detail}", code=1)
    return ckpt
