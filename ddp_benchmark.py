"""Lesson 6: does data parallelism pay on YOUR machine? Measure it.

    python ddp_benchmark.py --max-procs 2 --threads 1 --plot scaling.png   # CPU: 1 -> 2 processes
    python ddp_benchmark.py --model resnet50 --bucket-cap-mb 25 1 5 100 --json bench.json
    python ddp_benchmark.py --model resnet18 --comm-hook none fp16 bf16 powersgd --bucket-cap-mb 25 5

Run it with plain python: it starts one process group per world size 1, 2, 4, ... (mp.spawn) and
times forward + backward + AdamW on one synthetic batch kept on the device: the model and DDP,
not a data pipeline. How to read what it prints: docs/benchmark.md.
"""

import argparse
import copy
import importlib.util
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
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import cleanup, fail, free_port, pick_device, setup

HOOKS = ("none", "fp16", "bf16", "powersgd")
DEFAULT_BATCH = {"mnist": 64, "resnet18": 32, "resnet50": 32}  # per rank
QUICK = dict(
    warmup=1, steps=4, allreduce_iters=3, allreduce_max_mb=1 / 16, image_size=32, batch_size=8
)
TARGET_OVERHEAD_PCT = 3.0  # DDP at world size 1 against the unwrapped model, p50 step time
TARGET_EFFICIENCY = 0.90  # MNIST CNN, 1 -> 2 CPU processes with 1 thread each


def efficiency(tput_n, tput_1, n):
    """Scaling efficiency, 1.0 = linear: throughput(N) / (N x throughput(1)), weak or strong."""
    return tput_n / (n * tput_1)


def busbw(alg_bw, n):
    """nccl-tests' all-reduce bus bandwidth: a ring all-reduce moves 2(n-1)/n x the message over
    every link, so busbw is what one link carried per second, comparable with its rated speed."""
    return alg_bw * 2 * (n - 1) / n


def world_sizes(max_procs):
    """1, 2, 4, ... up to max_procs, and max_procs itself: 6 -> [1, 2, 4, 6]."""
    sizes = [2**i for i in range(max_procs.bit_length())]
    return sizes if sizes[-1] == max_procs else sizes + [max_procs]


def step_stats(step_seconds, global_batch):
    """Per-step times (slowest rank) -> p50/p90 in ms and samples/s over the whole run."""
    p50, p90 = np.percentile(step_seconds, [50, 90])  # linear interpolation
    return {
        "step_ms_p50": 1000 * float(p50),
        "step_ms_p90": 1000 * float(p90),
        "samples_per_s": global_batch * len(step_seconds) / sum(step_seconds),
    }


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line, exit 2, no usage dump
        fail(f"{message} (see python ddp_benchmark.py --help)")


def parse_args(argv=None):
    p = Parser(
        description="Lesson 6: DDP scaling, where the step time goes, all-reduce bandwidth.",
        allow_abbrev=False,
    )  # --quick is spotted by its full name
    add = p.add_argument
    add(
        "--model",
        default="mnist",
        choices=list(DEFAULT_BATCH),
        help="mnist: a 0.2 M-parameter CNN; resnet18/50: torchvision, random init (default mnist)",
    )
    add(
        "--max-procs",
        type=int,
        default=0,
        help="largest world size (default: GPUs, else CPU cores)",
    )
    add(
        "--strong",
        action="store_true",
        help="keep the GLOBAL batch at --batch-size (default: weak)",
    )
    add(
        "--batch-size",
        type=int,
        default=0,
        help="PER RANK, global with --strong (default: by model)",
    )
    add("--image-size", type=int, default=224, help="resnet input side (default 224)")
    add("--warmup", type=int, default=5, help="untimed steps per variant (default 5)")
    add("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    add(
        "--bucket-cap-mb",
        type=float,
        nargs="+",
        default=[25.0],
        help="DDP bucket size(s), MB: 25 1 5 100",
    )
    add(
        "--comm-hook", nargs="+", default=["none"], choices=HOOKS, help="DDP hook(s) (default none)"
    )
    add("--powersgd-rank", type=int, default=2, help="PowerSGD approximation rank (default 2)")
    add(
        "--powersgd-warmup", type=int, default=2, help="PowerSGD plain steps first, untimed (min 2)"
    )
    add("--grad-as-bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    add("--threads", type=int, default=0, help="CPU threads per rank (default cores / world size)")
    add(
        "--amp",
        default="auto",
        choices=["auto", "bf16", "fp16", "off"],
        help="autocast; auto: bf16 on GPUs with real bf16, else fp16 on CUDA, off on CPU",
    )
    add("--allreduce-max-mb", type=float, default=64.0, help="largest all-reduce, MiB (default 64)")
    add("--allreduce-iters", type=int, default=20, help="timed all-reduces per size (default 20)")
    add(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on CUDA, else gloo",
    )
    add("--seed", type=int, default=0, help="seed for the weights and synthetic batches")
    add("--json", default="", metavar="FILE", help="also write every record to this JSON file")
    add(
        "--plot", default="", metavar="FILE.png", help="throughput and efficiency plot (matplotlib)"
    )
    add("--quick", action="store_true", help=f"a tiny run that checks the tool works: {QUICK}")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**QUICK)  # flags given explicitly still win
    args = p.parse_args(argv)
    args.batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    args.comm_hook = list(dict.fromkeys(args.comm_hook))  # each variant once
    args.bucket_cap_mb = list(dict.fromkeys(args.bucket_cap_mb))
    for name, least in dict(
        batch_size=1,
        image_size=1,
        warmup=1,
        steps=1,
        allreduce_iters=1,
        powersgd_rank=1,
        powersgd_warmup=2,
        max_procs=0,
        threads=0,
        allreduce_max_mb=0,
    ).items():
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.plot and not (args.plot.endswith(".png") and importlib.util.find_spec("matplotlib")):
        p.error(
            f"--plot {args.plot}: needs a .png file name and matplotlib (pip install matplotlib)"
        )
    return args


def model_and_batch(args, batch, device, rank):
    """The model (same weights on every rank) and this rank's own fixed batch, kept on the device."""
    torch.manual_seed(args.seed)
    if args.model == "mnist":  # lesson 1's CNN: 28x28 digit -> 10 class scores, 215,370 parameters
        model = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )
        shape = (1, 28, 28)
    else:  # torchvision, random init: nothing to download
        import torchvision

        model = getattr(torchvision.models, args.model)(weights=None)
        shape = (3, args.image_size, args.image_size)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return model.to(device), (x.to(device), y.to(device))


def wrap(base, args, device, cap, hook="none", counting=False):
    """DDP: wrap a copy of the model with bucket size `cap` and communication hook `hook`. counting:
    hook "none" gets allreduce_hook, the Python twin of DDP's built-in C++ all-reduce (same buckets,
    same fp32 sum), whose dist.all_reduce calls can be counted."""
    model = DDP(
        copy.deepcopy(base),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cap,
        gradient_as_bucket_view=args.grad_as_bucket_view,
    )
    if hook in ("fp16", "bf16"):  # DDP: cast each bucket to 16 bits, all-reduce, cast back
        model.register_comm_hook(
            None,
            {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[
                hook
            ],
        )
    elif hook == "powersgd":  # DDP: send low-rank factors, keep what they miss (error feedback)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_warmup,
        )
        model.register_comm_hook(
            state,
            gloo_powersgd_hook if dist.get_backend() == "gloo" else powerSGD_hook.powerSGD_hook,
        )
    elif counting:
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model


def gloo_powersgd_hook(state, bucket):
    """PowerSGD chains three all-reduces per bucket through future callbacks, which gloo runs on
    its own threads: with 2+ buckets two ranks can issue them in different orders and gloo aborts
    or hangs. Finishing each bucket before the next is correct, with less overlap."""
    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def make_step(model, batch, args, device, sync=True):
    """One training step as a closure; sync=False runs it under DDP's no_sync() (no all-reduce)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp = (
        args.amp
        if args.amp != "auto"
        else "off"
        if device.type != "cuda"
        else "bf16"
        if torch.cuda.is_bf16_supported(including_emulation=False)
        else "fp16"
    )
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")  # fp16 needs loss scaling
    # DDP: with gradient_as_bucket_view each .grad IS a view into DDP's bucket. Zero it in place:
    # set_to_none drops the view, so every backward would allocate a fresh gradient and copy it
    # into the bucket, the very copy (and memory) the option exists to save.
    set_to_none = not getattr(model, "gradient_as_bucket_view", False)

    def step():
        with model.no_sync() if not sync else nullcontext():  # DDP: skip the all-reduce
            with torch.autocast(
                device.type,
                torch.float16 if amp == "fp16" else torch.bfloat16,
                enabled=amp != "off",
            ):
                loss = F.cross_entropy(model(batch[0]), batch[1])
            scaler.scale(loss).backward()  # DDP: buckets are all-reduced while backward runs
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=set_to_none)

    return step


def slowest_rank(values, device):
    """Element-wise maximum over ranks: a data-parallel step is as slow as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_variants(variants, args, device):
    """Seconds per step of each variant (slowest rank), after a warm-up, in interleaved rounds
    (A B C A B C ...) so that a slow spell of the machine hits all alike. GPU: CUDA events, read
    after one sync, none per step; CPU: perf_counter."""

    def mark():  # GPU: a recorded CUDA event, read after one sync (none per step); CPU: the clock
        return (
            torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
            if device.type == "cuda"
            else time.perf_counter()
        )

    for step in variants.values():
        for _ in range(
            max(args.warmup, args.powersgd_warmup)
        ):  # PowerSGD: time compressed steps only
            step()
    times = {name: [] for name in variants}
    for chunk in np.array_split(np.arange(args.steps), min(5, args.steps)):
        for name, step in variants.items():
            dist.barrier()  # start together: the unwrapped variant never synchronises by itself
            marks = [mark()]
            for _ in chunk:
                step()
                marks.append(mark())
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name] += [
                b - a if device.type != "cuda" else a.elapsed_time(b) / 1000
                for a, b in zip(marks, marks[1:])
            ]
    return {name: slowest_rank(t, device) for name, t in times.items()}


def time_allreduce(args, device):
    """(bytes, seconds) per float32 sum all-reduce, slowest rank, for 4 KiB, 16 KiB, ... up to max."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    top, rows = int(args.allreduce_max_mb * 2**20), []
    for nbytes in [4096 * 4**i for i in range(16) if 4096 * 4**i <= top] or [max(4, top // 4 * 4)]:
        buf = torch.zeros(nbytes // 4, device=device)  # zeros: the sums never overflow
        for i in range(3 + args.allreduce_iters):  # 3 untimed, then the timed ones
            if i == 3:
                sync()
                dist.barrier()
                t0 = time.perf_counter()
            dist.all_reduce(buf)
        sync()
        rows.append(
            (nbytes, slowest_rank([(time.perf_counter() - t0) / args.allreduce_iters], device)[0])
        )
    return rows


def worker(rank, world_size, args, threads, out_path):
    """One rank of one world size: count and time every variant; rank 0 writes the raw results."""
    ddp = setup(args.backend, rank=rank, world_size=world_size)  # DDP: join this point's group
    try:
        dev = ddp.device
        torch.set_num_threads(threads)  # CPU ops, and the whole step on CPU
        torch.backends.cudnn.benchmark = True
        per_rank = args.batch_size // world_size if args.strong else args.batch_size
        base, batch = model_and_batch(args, per_rank, dev, rank)
        variants = {
            "unwrapped": make_step(copy.deepcopy(base), batch, args, dev),
            "no_sync": make_step(
                wrap(base, args, dev, args.bucket_cap_mb[0]), batch, args, dev, sync=False
            ),
        }
        comm = {}  # bytes this rank hands to dist.all_reduce in one step, counted in an untimed pass
        for hook in args.comm_hook:
            for cap in args.bucket_cap_mb:
                name = f"ddp {cap:g} {hook}"
                count = make_step(wrap(base, args, dev, cap, hook, counting=True), batch, args, dev)
                variants[name] = make_step(wrap(base, args, dev, cap, hook), batch, args, dev)
                for _ in range(args.powersgd_warmup if hook == "powersgd" else 1):
                    count()  # past DDP's bucket rebuild (after step 1) and PowerSGD's plain steps
                with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
                    count()
                comm[name] = sum(call.args[0].nbytes for call in spy.call_args_list)
        raw = {
            "times": time_variants(variants, args, dev),
            "comm": comm,
            "allreduce": time_allreduce(args, dev) if world_size > 1 else [],
            "batch_per_rank": per_rank,
            "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in base.parameters()),
        }
        if ddp.is_main:
            with open(out_path, "w") as f:
                json.dump(raw, f)
    finally:
        cleanup()  # frees the DDP wrappers (gc) before the process group


def run_point(args, world_size, threads):
    """world_size workers under mp.spawn on a fresh free port; returns rank 0's raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(
                worker, args=(world_size, args, threads, f"{tmp}/point.json"), nprocs=world_size
            )
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            fail(
                f"a worker at world size {world_size} failed: {str(e).strip().splitlines()[-1]}",
                code=1,
            )
        with open(f"{tmp}/point.json") as f:
            return json.load(f)


def build_records(args, machine, points):
    """Raw per-point results -> breakdown, scaling and all-reduce records, each naming the machine."""
    breakdown, allreduce = [], []
    for n, raw in points.items():
        batch, threads = raw["batch_per_rank"], raw["threads"]
        tag = {
            "machine": machine["name"],
            "torch": machine["torch"],
            "backend": machine["backend"],
            "world_size": n,
            "threads_per_rank": threads,
            "model": args.model,
            "params": raw["params"],
            "oversubscribed": machine["device"] == "cpu" and n * threads > machine["cores"],
            "batch_per_rank": batch,
            "global_batch": batch * n,
        }
        stats = {name: step_stats(t, batch * n) for name, t in raw["times"].items()}
        compute, wrapper = stats["unwrapped"]["step_ms_p50"], stats["no_sync"]["step_ms_p50"]
        breakdown += [
            {**tag, "variant": "unwrapped", **stats["unwrapped"]},
            {**tag, "variant": "ddp_no_sync", **stats["no_sync"], "wrapper_ms": wrapper - compute},
        ]
        for hook in args.comm_hook:
            for cap in args.bucket_cap_mb:
                d = stats[f"ddp {cap:g} {hook}"]
                breakdown.append(
                    {
                        **tag,
                        "variant": "ddp",
                        "bucket_cap_mb": cap,
                        "comm_hook": hook,
                        **d,
                        "exposed_comm_ms": d["step_ms_p50"] - wrapper,
                        "overhead_pct": 100 * (d["step_ms_p50"] - compute) / compute,
                        "comm_bytes_per_step": raw["comm"][f"ddp {cap:g} {hook}"],
                    }
                )
        allreduce += [
            {
                **tag,
                "bytes": b,
                "time_us": 1e6 * s,
                "algbw_gbps": b / s / 1e9,
                "busbw_gbps": busbw(b / s, n) / 1e9,
            }
            for b, s in raw["allreduce"]
        ]
    # scaling: the first DDP variant (first hook, first bucket size) at each world size
    scaling = [
        r
        for r in breakdown
        if r["variant"] == "ddp"
        and r["bucket_cap_mb"] == args.bucket_cap_mb[0]
        and r["comm_hook"] == args.comm_hook[0]
    ]
    for r in scaling:
        r["speedup"] = r["samples_per_s"] / scaling[0]["samples_per_s"]
        r["efficiency"] = efficiency(
            r["samples_per_s"], scaling[0]["samples_per_s"], r["world_size"]
        )
    return scaling, breakdown, allreduce


def report(args, machine, scaling, breakdown, allreduce):
    """Every record as a `key value | ...` line (the JSON's keys), then PASS/MISS for the targets."""

    def fmt(key, v):  # 4 significant digits without exponents; efficiency in percent
        if not isinstance(v, float):
            return v
        return f"{v:.1%}" if key == "efficiency" else f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"

    def show(records, keys):
        for r in records:
            print(
                " | ".join(
                    f"{k} {fmt(k, r[k])}" for k in keys.split() if r.get(k) not in (None, False)
                )
            )

    print(f"\nscaling | {machine['name']} | torch {machine['torch']} | {machine['backend']}")
    show(
        scaling,
        "world_size threads_per_rank oversubscribed global_batch samples_per_s step_ms_p50 "
        "step_ms_p90 speedup efficiency",
    )
    print(
        "\nbreakdown | unwrapped = compute | wrapper_ms = ddp_no_sync - unwrapped | "
        "exposed_comm_ms = ddp - ddp_no_sync | overhead_pct = ddp vs unwrapped"
    )
    show(
        breakdown,
        "world_size variant bucket_cap_mb comm_hook step_ms_p50 step_ms_p90 wrapper_ms "
        "exposed_comm_ms overhead_pct comm_bytes_per_step",
    )
    print(
        "\nall-reduce | float32 sum | busbw = algbw x 2(n-1)/n"
        + ("" if allreduce else " | 2+ ranks")
    )
    show(allreduce, "world_size bytes time_us algbw_gbps busbw_gbps")
    d, two = (
        breakdown[2],
        next((r for r in scaling if r["world_size"] == 2), None),
    )  # d: world 1, 1st DDP
    weak_cpu = (
        two
        and args.model == "mnist"
        and not args.strong
        and machine["device"] == "cpu"
        and scaling[0]["threads_per_rank"] == two["threads_per_rank"] == 1
    )
    targets = [
        (
            f"DDP at world size 1 costs <= {TARGET_OVERHEAD_PCT:g}% over the unwrapped step (p50)",
            d["overhead_pct"] <= TARGET_OVERHEAD_PCT,
            f"{d['overhead_pct']:+.1f}%",
        ),
        (
            f"weak-scaling efficiency 1 -> 2 CPU processes (1 thread each), MNIST CNN >= "
            f"{TARGET_EFFICIENCY:.0%}",
            two["efficiency"] >= TARGET_EFFICIENCY if weak_cpu else None,
            f"{two['efficiency']:.1%}" if weak_cpu else "run: --max-procs 2 --threads 1",
        ),
    ]
    targets = [
        {
            "target": t,
            "status": {True: "PASS", False: "MISS", None: "NOT MEASURED"}[ok],
            "measured": m,
        }
        for t, ok, m in targets
    ]
    print(
        "\n"
        + "\n".join(
            f"target {t['status']}: {t['target']} | measured {t['measured']}" for t in targets
        )
    )
    if max(r["step_ms_p90"] / r["step_ms_p50"] for r in breakdown) > 1.25:
        print(
            "warning: noisy step times (p90 > 1.25 x p50): a busy machine or a short run; re-run on a "
            "quiet machine with more --steps before trusting the targets"
        )
    return targets


def write_plot(path, args, machine, scaling):
    """Throughput against linear by world size, each point labelled with its efficiency."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    ns, tput = [r["world_size"] for r in scaling], [r["samples_per_s"] for r in scaling]
    fig = Figure(figsize=(7.5, 4.8), layout="tight")
    ax = fig.subplots()
    ax.plot(ns, [n * tput[0] for n in ns], "k--", label="linear (N x 1 process)")
    ax.plot(ns, tput, "o-", label="measured, DDP")
    for n, t, r in zip(ns, tput, scaling):  # a point past the core count measures contention
        ax.annotate(
            f"{r['efficiency']:.0%}" + " (oversubscribed)" * r["oversubscribed"],
            (n, t),
            textcoords="offset points",
            xytext=(6, -14),
        )
    ax.set(
        xlabel="world size (processes)", ylabel="samples/s, all ranks", xticks=ns, ylim=(0, None)
    )
    gb, th = (
        ",".join(str(r[key]) for r in scaling) for key in ("global_batch", "threads_per_rank")
    )
    ax.set_title(
        f"ddp_benchmark.py --model {args.model}: {'strong' if args.strong else 'weak'} scaling, "
        f"global batch {gb}, threads/rank {th}\n{machine['name']} | torch {machine['torch']} | "
        f"{machine['backend']} | labels: efficiency",
        fontsize=9,
    )
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None):
    args, t_start = parse_args(argv), time.perf_counter()
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        fail("ddp_benchmark.py starts its own workers: run it with python, not torchrun or srun")
    device, args.backend = pick_device(0, args.backend)
    cores = len(os.sched_getaffinity(0))
    slots = torch.cuda.device_count() if device.type == "cuda" else cores
    if device.type == "cuda" and args.max_procs > slots:
        fail(
            f"--max-procs {args.max_procs} but only {slots} GPU(s) are visible: one process per GPU"
        )
    sizes = world_sizes(args.max_procs or slots)
    if args.strong and any(args.batch_size % n for n in sizes):
        fail(
            f"--strong splits the global batch {args.batch_size} across world sizes {sizes}: "
            "give a --batch-size divisible by each of them"
        )
    with (
        open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else nullcontext([]) as f
    ):  # Linux
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            "unknown CPU",
        )
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    machine = {
        "name": f"{gpu} x{slots}" if gpu else f"{cpu} ({cores} cores)",
        "cpu": cpu,
        "cores": cores,
        "gpu": gpu,
        "torch": torch.__version__,
        "backend": args.backend,
        "device": device.type,
    }
    mode = "strong: global batch" if args.strong else "weak: batch/rank"
    print(
        f"start: model {args.model} | world sizes {sizes} | {mode} {args.batch_size} | {machine['name']}",
        flush=True,
    )
    # CPU: each rank gets cores / world size threads unless --threads says otherwise
    points = {n: run_point(args, n, args.threads or max(1, cores // n)) for n in sizes}
    scaling, breakdown, allreduce = build_records(args, machine, points)
    targets = report(args, machine, scaling, breakdown, allreduce)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "config": vars(args),
                    "scaling": scaling,
                    "breakdown": breakdown,
                    "allreduce": allreduce,
                    "targets": targets,
                },
                f,
                indent=1,
            )
    if args.plot:
        write_plot(args.plot, args, machine, scaling)
    print(
        f"done: model {args.model} | world sizes {sizes} | backend {args.backend} | device {device.type} | "
        f"efficiency {scaling[-1]['efficiency']:.1%} at world size {sizes[-1]} | "
        f"time {time.perf_counter() - t_start:.1f}s"
    )


if __name__ == "__main__":
    main()
