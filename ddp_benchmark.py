"""Lesson 6: does data parallelism pay on YOUR machine? Measure it.

    python ddp_benchmark.py --max-procs 2 --threads 1 --plot scaling.png   # CPU: 1 -> 2 processes
    python ddp_benchmark.py --model resnet50 --bucket-cap-mb 25 1 5 100 --json bench.json
    python ddp_benchmark.py --model resnet18 --comm-hook none bf16 powersgd --bucket-cap-mb 25 5

Run it with plain python: it starts one process group per world size 1, 2, 4, ... (mp.spawn). At
each world size it times the same training step (forward, backward, AdamW) on one synthetic batch
kept on the device, so it measures the model and DDP, not a data pipeline. Three variants:

    unwrapped     the bare model, no DDP: the compute
    ddp_no_sync   DDP under no_sync(): the wrapper's own cost, no all-reduce
    ddp           full DDP, once per --comm-hook x --bucket-cap-mb

Then it times dist.all_reduce alone over message sizes. The differences between the variants say
where a step's time goes. benchmark_extras.py holds the models and turns the timings into the
records it prints and plots; how to read them: docs/benchmark.md.
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmark_extras import (
    build_records,
    describe_machine,
    model_and_batch,
    print_report,
    write_plot,
)
from ddp_common import cleanup, cpu_count, fail, pick_device, setup
from ddp_extras import free_port, pick_amp, powersgd_hook

HOOKS = ("none", "fp16", "bf16", "powersgd")
# Samples per rank when --batch-size is not given.
DEFAULT_BATCH = {"mnist": 64, "resnet18": 32, "resnet50": 32}
# --quick: a tiny run that checks the tool works (flags given explicitly still win).
QUICK = dict(
    warmup=1, steps=4, allreduce_iters=3, allreduce_max_mb=1 / 16, image_size=32, batch_size=8
)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # A mistyped flag: one `error:` line and exit 2, no usage dump.
        fail(f"{message} (see python ddp_benchmark.py --help)")


def parse_args(argv=None):
    # allow_abbrev=False: --quick is spotted in argv by its full name below.
    parser = Parser(
        description="Lesson 6: DDP scaling, step time breakdown, all-reduce bandwidth.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--model", default="mnist", choices=list(DEFAULT_BATCH), help="default mnist"
    )
    parser.add_argument(
        "--max-procs", type=int, default=0, help="largest world size (GPUs, else cores)"
    )
    parser.add_argument("--strong", action="store_true", help="fixed GLOBAL batch (default: weak)")
    parser.add_argument("--batch-size", type=int, help="per rank; global with --strong (by model)")
    parser.add_argument(
        "--image-size", type=int, default=224, help="resnet input side (default 224)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps per variant (default 5)"
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="timed steps per variant (default 30)"
    )
    parser.add_argument(
        "--bucket-cap-mb", type=float, nargs="+", default=[25.0], help="e.g. 25 1 100"
    )
    parser.add_argument(
        "--comm-hook", nargs="+", default=["none"], choices=HOOKS, help="DDP hook(s)"
    )
    parser.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD rank (default 2)")
    parser.add_argument("--powersgd-warmup", type=int, default=2, help="plain steps first (min 2)")
    parser.add_argument(
        "--grad-as-bucket-view", action="store_true", help="gradients in the buckets"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads per rank (cores / world)"
    )
    parser.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"])
    parser.add_argument(
        "--allreduce-max-mb", type=float, default=64.0, help="largest all-reduce, MiB"
    )
    parser.add_argument(
        "--allreduce-iters", type=int, default=20, help="timed all-reduces per size"
    )
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the batches")
    parser.add_argument("--json", default="", metavar="FILE", help="also write every record here")
    parser.add_argument("--plot", default="", metavar="FILE.png", help="scaling plot (matplotlib)")
    parser.add_argument("--quick", action="store_true", help=f"a tiny run: {QUICK}")
    if argv is None:
        argv = sys.argv[1:]
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH[args.model]
    # Each variant once, in the order given.
    args.comm_hook = list(dict.fromkeys(args.comm_hook))
    args.bucket_cap_mb = list(dict.fromkeys(args.bucket_cap_mb))
    if args.batch_size < 1 or args.image_size < 1:
        fail("--batch-size and --image-size must be at least 1")
    if args.warmup < 1 or args.steps < 1 or args.allreduce_iters < 1:
        fail("--warmup, --steps and --allreduce-iters must be at least 1")
    if args.max_procs < 0 or args.threads < 0:
        fail("--max-procs and --threads must be at least 0 (0: the default)")
    if min(args.bucket_cap_mb) <= 0 or args.allreduce_max_mb <= 0:
        fail("--bucket-cap-mb and --allreduce-max-mb must be > 0")
    if args.powersgd_rank < 1:
        fail("--powersgd-rank must be at least 1")
    # DDP rebuilds its buckets after step 1; PowerSGD's per-bucket state must start after that.
    if args.powersgd_warmup < 2:
        fail("--powersgd-warmup must be at least 2")
    if args.plot and not args.plot.endswith(".png"):
        fail(f"--plot {args.plot} must name a .png file")
    return args


def world_sizes(max_procs):
    """1, 2, 4, ... up to max_procs, and max_procs itself: 6 -> [1, 2, 4, 6]."""
    sizes = [2**i for i in range(max_procs.bit_length())]
    if sizes[-1] != max_procs:
        sizes.append(max_procs)
    return sizes


def wrap(base, args, device, cap, hook="none", counting=False):
    """A copy of the model in DDP with bucket size `cap` MiB and communication hook `hook`.
    counting: hook "none" gets allreduce_hook, the Python twin of DDP's built-in C++ all-reduce
    (same buckets, same fp32 sum), whose dist.all_reduce calls can be counted."""
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index]
    # DDP: all-reduce the gradients in buckets of `cap` MiB while backward runs.
    model = DDP(
        copy.deepcopy(base),
        device_ids=device_ids,
        bucket_cap_mb=cap,
        gradient_as_bucket_view=args.grad_as_bucket_view,
    )
    if hook == "fp16":
        # DDP: cast each bucket to 16 bits, all-reduce, cast back: half the bytes.
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        # DDP: send low-rank factors of each gradient matrix; what they miss stays on the rank.
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_warmup,
        )
        model.register_comm_hook(state, powersgd_hook)
    elif counting:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model


def make_step(model, batch, args, device, sync=True):
    """One training step as a closure; sync=False runs it under DDP's no_sync() (no all-reduce)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = pick_amp(args.amp, device)
    dtype = torch.bfloat16
    if amp == "fp16":
        dtype = torch.float16
    # fp16 needs loss scaling; with bf16 or off the scaler does nothing.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
    # DDP: with gradient_as_bucket_view each .grad IS a view into DDP's bucket. Zero it in place:
    # set_to_none drops the view, so every backward would allocate a fresh gradient and copy it
    # into the bucket, the very copy (and memory) the option exists to save.
    set_to_none = not getattr(model, "gradient_as_bucket_view", False)

    def communication():
        if sync:
            return nullcontext()
        # DDP: inside no_sync() backward leaves the gradients on this rank.
        return model.no_sync()

    def step():
        with communication():
            with torch.autocast(device.type, dtype, enabled=amp != "off"):
                loss = F.cross_entropy(model(batch[0]), batch[1])
            # DDP: each bucket is all-reduced as soon as backward has filled it.
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def slowest_rank(values, device):
    """Element-wise maximum over ranks: a data-parallel step is as slow as its slowest rank."""
    slowest = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def time_variants(variants, args, device):
    """Seconds per step of each variant (slowest rank), after a warm-up, in interleaved rounds
    (A B C A B C ...) so that a slow spell of the machine hits all alike."""
    on_gpu = device.type == "cuda"

    def mark():
        # GPU: a CUDA event, read after one sync per round (none per step). CPU: the clock.
        if on_gpu:
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
        return time.perf_counter()

    # Untimed: DDP's bucket rebuild, cuDNN's autotuning, PowerSGD's plain steps.
    for step in variants.values():
        for _ in range(max(args.warmup, args.powersgd_warmup)):
            step()
    times = {name: [] for name in variants}
    for chunk in np.array_split(np.arange(args.steps), min(5, args.steps)):
        for name, step in variants.items():
            # Start together: the unwrapped variant never synchronises the ranks by itself.
            dist.barrier()
            marks = [mark()]
            for _ in chunk:
                step()
                marks.append(mark())
            if on_gpu:
                torch.cuda.synchronize()
            for start, end in zip(marks[:-1], marks[1:], strict=True):
                if on_gpu:
                    times[name].append(start.elapsed_time(end) / 1000)
                else:
                    times[name].append(end - start)
    return {name: slowest_rank(t, device) for name, t in times.items()}


def time_allreduce(args, device):
    """(bytes, seconds) per float32 sum all-reduce, slowest rank: 4 KiB, 16 KiB, ... up to max."""
    top = int(args.allreduce_max_mb * 2**20)
    sizes = [4096 * 4**i for i in range(16) if 4096 * 4**i <= top]
    if not sizes:
        sizes = [max(4, top // 4 * 4)]
    rows = []
    for nbytes in sizes:
        # Zeros: the sums never overflow.
        buffer = torch.zeros(nbytes // 4, device=device)
        for _ in range(3):
            dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.allreduce_iters):
            dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.allreduce_iters
        rows.append((nbytes, slowest_rank([seconds], device)[0]))
    return rows


def count_comm_bytes(step):
    """Bytes this rank hands to dist.all_reduce in one step (the hooks call it from Python)."""
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
        step()
    return sum(call.args[0].nbytes for call in spy.call_args_list)


def worker(rank, world_size, args, threads, out_path):
    """One rank of one world size: count and time every variant; rank 0 writes the raw results."""
    # DDP: join this world size's process group (a fresh one per point of the sweep).
    ddp = setup(args.backend, rank=rank, world_size=world_size)
    try:
        device = ddp.device
        # CPU: the whole step runs on this many threads.
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = True
        per_rank = args.batch_size
        if args.strong:
            per_rank = args.batch_size // world_size
        base, batch = model_and_batch(args, per_rank, device, rank)
        unwrapped = copy.deepcopy(base)
        no_sync = wrap(base, args, device, args.bucket_cap_mb[0])
        variants = {
            "unwrapped": make_step(unwrapped, batch, args, device),
            "no_sync": make_step(no_sync, batch, args, device, sync=False),
        }
        comm = {}
        for hook in args.comm_hook:
            for cap in args.bucket_cap_mb:
                name = f"ddp {cap:g} {hook}"
                variants[name] = make_step(wrap(base, args, device, cap, hook), batch, args, device)
                # An untimed twin, stepped past DDP's bucket rebuild and PowerSGD's plain steps.
                twin = wrap(base, args, device, cap, hook, counting=True)
                count = make_step(twin, batch, args, device)
                for _ in range(args.powersgd_warmup):
                    count()
                comm[name] = count_comm_bytes(count)
        raw = {
            "times": time_variants(variants, args, device),
            "comm": comm,
            "allreduce": [],
            "batch_per_rank": per_rank,
            "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in base.parameters()),
        }
        if world_size > 1:
            raw["allreduce"] = time_allreduce(args, device)
        if ddp.is_main:
            with open(out_path, "w") as f:
                json.dump(raw, f)
    finally:
        cleanup()


def run_point(args, world_size, threads):
    """world_size workers under mp.spawn on a fresh free port; returns rank 0's raw results."""
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


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        fail("ddp_benchmark.py starts its own workers: run it with python, not torchrun or srun")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib: pip install matplotlib")
    # GPUs if there is one (one process per GPU), else CPU processes on gloo.
    device, args.backend = pick_device(0, 1, args.backend)
    cores = cpu_count()
    slots = cores
    if device.type == "cuda":
        slots = torch.cuda.device_count()
    if device.type == "cuda" and args.max_procs > slots:
        fail(f"--max-procs {args.max_procs} but {slots} GPU(s) are visible: one process per GPU")
    largest = args.max_procs
    if largest == 0:
        largest = slots
    sizes = world_sizes(largest)
    if args.strong and any(args.batch_size % n for n in sizes):
        fail(
            f"--strong splits the global batch {args.batch_size} over world sizes {sizes}: "
            "give a --batch-size divisible by each of them"
        )
    machine = describe_machine(device, args.backend, cores, slots)
    mode = "weak: batch/rank"
    if args.strong:
        mode = "strong: global batch"
    print(
        f"start: model {args.model} | world sizes {sizes} | {mode} {args.batch_size} | "
        f"{machine['name']}",
        flush=True,
    )
    points = {}
    for n in sizes:
        threads = args.threads
        if threads == 0:
            # CPU: by default each rank gets cores / world size threads.
            threads = max(1, cores // n)
        points[n] = run_point(args, n, threads)
    scaling, breakdown, allreduce = build_records(args, machine, points)
    print_report(machine, scaling, breakdown, allreduce)
    if args.json:
        records = {
            "machine": machine,
            "config": vars(args),
            "scaling": scaling,
            "breakdown": breakdown,
            "allreduce": allreduce,
        }
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot:
        write_plot(args.plot, args, machine, scaling)
    last = scaling[-1]
    print(
        f"done: model {args.model} | world sizes {sizes} | backend {args.backend} | "
        f"device {device.type} | samples_per_s {last['samples_per_s']:.0f} at world size "
        f"{sizes[-1]} | efficiency {last['efficiency']:.1%} | "
        f"time {time.perf_counter() - t_start:.1f}s"
    )


if __name__ == "__main__":
    main()
