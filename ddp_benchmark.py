"""Lesson 6: does DDP pay on this machine? Measure it, and see where a step's time goes.

    python ddp_benchmark.py --max-procs 2 --threads 1                # CPU: 1, then 2 processes
    python ddp_benchmark.py --model resnet50 --bucket-cap-mb 25 5 100 --json bench.json  # GPUs

Run it with plain python: it starts one process group per world size 1, 2, 4, ... (mp.spawn). At
each world size it times one training step (forward, backward, AdamW) on a synthetic batch that
stays on the device (the model and DDP, not a data pipeline), three ways:

    unwrapped     the bare model, no DDP: the compute
    ddp_no_sync   DDP under no_sync(): the wrapper's own cost, no all-reduce
    ddp           full DDP, once per --bucket-cap-mb

in 5 interleaved rounds (A B C, C B A, ...): a busy spell of the machine slows every variant
alike, and a difference the rounds disagree on is noise. Then it times dist.all_reduce alone, from
4 KiB up to one step's gradients. benchmark_extras.py: the models and the report.
"""

import contextlib
import copy
import importlib.util
import json
import os
import tempfile
import time
from itertools import pairwise

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmark_extras import ROUNDS, describe_machine, model_and_batch, report
from ddp_common import Parser, cleanup, fail, free_port, pick_device, positive_int, setup


def megabytes(text):
    """argparse type: a size in MiB, 0 or more (0: one bucket per gradient tensor)."""
    if float(text) < 0:
        raise ValueError(text)
    return float(text)


def parse_args():
    parser = Parser(description="Lesson 6: DDP scaling, where a step's time goes, all-reduce.")
    parser.add_argument("--model", default="mnist", choices=["mnist", "resnet18", "resnet50"])
    parser.add_argument("--max-procs", type=positive_int, help="default: the GPUs, else the cores")
    parser.add_argument("--strong", action="store_true", help="split one global batch")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="global if --strong")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed steps per variant")
    parser.add_argument("--steps", type=positive_int, default=30, help="timed steps per variant")
    parser.add_argument("--bucket-cap-mb", type=megabytes, nargs="+", default=[25.0])
    parser.add_argument("--threads", type=positive_int, help="per rank (default: cores / world)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--json", metavar="FILE", help="write every record here")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the scaling (matplotlib)")
    args = parser.parse_args()
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        parser.error("it starts its own workers: run it with python, not torchrun or srun")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib")
    if args.steps < ROUNDS:
        parser.error(f"--steps must be at least {ROUNDS}: they are timed in {ROUNDS} rounds")
    if args.plot and not args.plot.endswith(".png"):
        parser.error(f"--plot {args.plot} must name a .png file")
    return args


def world_sizes(max_procs):
    """1, 2, 4, ... up to max_procs, and max_procs itself: 6 -> [1, 2, 4, 6]."""
    return sorted({2**i for i in range(max_procs.bit_length())} | {max_procs})


def wrap(base, device, cap):
    """A copy of the model in DDP, its gradients all-reduced in buckets of `cap` MiB."""
    device_ids = [device.index] if device.type == "cuda" else None
    # DDP: backward all-reduces the gradients bucket by bucket, while it runs. (Cap 0, a bucket
    # per tensor, is passed as 1e-6 MiB: torch 2.11's DDP asserts on a cap of 0.)
    return DDP(copy.deepcopy(base), device_ids=device_ids, bucket_cap_mb=cap or 1e-6)


def make_step(model, batch, device, sync=True):
    """One training step (forward, backward, AdamW) as a function; sync=False: under no_sync()."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    # bf16 autocast on GPUs that have it natively (fp32 elsewhere: no loss scaling needed).
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    x, y = batch

    def step():
        # DDP: inside no_sync() backward leaves the gradients on this rank: no all-reduce.
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            # DDP: each bucket is all-reduced as soon as backward has filled it.
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def slowest_rank(values, device):
    """Element-wise maximum over the ranks: a data-parallel step is as slow as its slowest rank."""
    slowest = torch.tensor(values, dtype=torch.float64, device=device)
    # DDP: every rank sends its list; every rank gets the maximum of each entry.
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def time_variants(variants, args, device):
    """Seconds per step of each variant (slowest rank), after --warmup untimed steps, timed in
    ROUNDS interleaved rounds so that a slow spell of the machine hits every variant alike."""
    on_gpu = device.type == "cuda"

    def mark():
        # GPU: a CUDA event, read after one sync per round (none per step). CPU: the clock.
        if on_gpu:
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
        return time.perf_counter()

    # Untimed: DDP's bucket rebuild after the first step, cuDNN's autotuning, warm caches.
    for step in variants.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in variants}
    names = list(variants)
    for i, chunk in enumerate(np.array_split(range(args.steps), ROUNDS)):
        # Every other round backwards (A B C, C B A, ...): no variant is always the first.
        for name in names if i % 2 == 0 else names[::-1]:
            # DDP: start together; the unwrapped variant never waits for the other ranks itself.
            dist.barrier()
            marks = [mark()]
            for _ in chunk:
                variants[name]()
                marks.append(mark())
            if on_gpu:
                torch.cuda.synchronize()
                times[name] += [a.elapsed_time(b) / 1000 for a, b in pairwise(marks)]
            else:
                times[name] += [b - a for a, b in pairwise(marks)]
    return {name: slowest_rank(t, device) for name, t in times.items()}


def time_allreduce(grad_bytes, args, device):
    """(bytes, seconds) of one float32 sum all-reduce (slowest rank): 4 KiB, 16 KiB, ... and one
    step's gradients in a single message."""
    sizes = [4096 * 4**i for i in range(16) if 4096 * 4**i < grad_bytes] + [grad_bytes]
    seconds = []
    for nbytes in sizes:
        # Zeros: the sums never overflow.
        buffer = torch.zeros(nbytes // 4, device=device)
        for timed in (args.warmup, args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(timed):
                # DDP: what DDP does to every bucket: each rank's tensor becomes the sum over ranks.
                dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append((time.perf_counter() - start) / args.steps)
    return list(zip(sizes, slowest_rank(seconds, device), strict=True))


def worker(rank, world_size, args, threads, out_path):
    """One rank at one world size: time every variant and the all-reduce; rank 0 writes them."""
    # DDP: join this world size's process group (a new one for each point of the sweep).
    device = setup(args.backend, rank=rank, world_size=world_size).device
    torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = True
    per_rank = args.batch_size // world_size if args.strong else args.batch_size
    base, batch = model_and_batch(args.model, per_rank, device, rank)
    caps = args.bucket_cap_mb
    models = {"unwrapped": copy.deepcopy(base), "ddp_no_sync": wrap(base, device, caps[0])}
    models.update({f"ddp {cap:g}": wrap(base, device, cap) for cap in caps})
    variants = {
        name: make_step(model, batch, device, sync=name != "ddp_no_sync")
        for name, model in models.items()
    }
    grad_bytes = 4 * sum(p.numel() for p in base.parameters())
    raw = {
        "times": time_variants(variants, args, device),
        "allreduce": time_allreduce(grad_bytes, args, device) if world_size > 1 else [],
        "batch_per_rank": per_rank,
        "threads": torch.get_num_threads(),
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(raw, f)
    # DDP: drop the wrappers, then leave the process group.
    del models, variants
    cleanup()


def run_point(args, world_size, threads):
    """world_size workers under mp.spawn, meeting on a free port; rank 0's raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "point.json")
        try:
            mp.spawn(worker, args=(world_size, args, threads, out_path), nprocs=world_size)
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            last_line = str(e).strip().splitlines()[-1]
            fail(f"a worker at world size {world_size} failed: {last_line}", code=1)
        with open(out_path) as f:
            return json.load(f)


def main():
    args = parse_args()
    started = time.perf_counter()
    # GPUs where there are any (one process per GPU), else CPU processes on gloo.
    device, args.backend = pick_device(0, 1, args.backend)
    machine = describe_machine(device, args.backend)
    slots = torch.cuda.device_count() if device.type == "cuda" else machine["cores"]
    if device.type == "cuda" and (args.max_procs or 0) > slots:
        fail(f"--max-procs {args.max_procs} but {slots} GPU(s): one process per GPU")
    sizes = world_sizes(args.max_procs or slots)
    if args.strong and any(args.batch_size % n for n in sizes):
        fail(f"--strong: give a --batch-size that world sizes {sizes} all divide")
    mode = "strong: global batch" if args.strong else "weak: batch/rank"
    print(
        f"start: model {args.model} | world sizes {sizes} | {mode} {args.batch_size} | "
        f"{machine['name']}",
        flush=True,
    )
    points = {}
    for n in sizes:
        # CPU: by default each rank gets cores / world size threads.
        threads = args.threads or max(1, machine["cores"] // n)
        points[n] = run_point(args, n, threads)
    last = report(args, machine, points)[-1]
    print(
        f"done: model {args.model} | world sizes {sizes} | backend {args.backend} | device "
        f"{device.type} | samples_per_s {last['samples_per_s']:.0f} at world size {sizes[-1]} | "
        f"efficiency {last['efficiency']:.1%} | time {time.perf_counter() - started:.1f}s"
    )


if __name__ == "__main__":
    main()
