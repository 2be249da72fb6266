"""Lesson 6's companion: the models ddp_benchmark.py times, and its report of the step timings
(printed, written as JSON with the machine, torch and the backend that measured them, plotted)."""

import json
import os

import numpy as np
import torch
import torch.nn as nn

# Steps are timed in this many interleaved rounds; a difference is real when all of them agree
# on its sign (by chance alone: 2 in 2**5, about 1 in 16).
ROUNDS = 5


def model_and_batch(name, batch, device, rank):
    """The model (the same weights on every rank) and this rank's batch, kept on the device."""
    torch.manual_seed(0)
    if name == "mnist":
        # Lesson 1's CNN: a 28x28 digit -> 10 class scores, 215,370 parameters.
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
    else:
        import torchvision

        # Random initial weights: nothing to download. ImageNet-sized images.
        model = getattr(torchvision.models, name)(weights=None)
        shape = (3, 224, 224)
    generator = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(batch, *shape, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    return model.to(device), (x.to(device), y.to(device))


def efficiency(tput_n, tput_1, n):
    """Scaling efficiency, 1.0 = linear: throughput(N) / (N x throughput(1)), weak or strong."""
    return tput_n / (n * tput_1)


def busbw(alg_bw, n):
    """nccl-tests' all-reduce bus bandwidth: a ring all-reduce moves 2(n-1)/n x the message over
    every link, so busbw is what one link carried per second, comparable with its rated speed."""
    return alg_bw * 2 * (n - 1) / n


def step_stats(step_seconds, global_batch):
    """Per-step times -> p50/p90 in ms, samples/s over the whole run, the median of each round."""
    # numpy's default: linear interpolation between the two nearest steps.
    p50, p90 = np.percentile(step_seconds, [50, 90])
    return {
        "step_ms_p50": 1000 * float(p50),
        "step_ms_p90": 1000 * float(p90),
        "samples_per_s": global_batch * len(step_seconds) / sum(step_seconds),
        "rounds_ms": [1000 * float(np.median(r)) for r in np.array_split(step_seconds, ROUNDS)],
    }


def difference(slower, faster, key):
    """p50 of `slower` minus p50 of `faster`, in ms; `key` goes into slower's noise list when the
    rounds disagree on the sign: the difference is not larger than the machine's wobble."""
    per_round = np.subtract(slower["rounds_ms"], faster["rounds_ms"])
    if min(per_round) <= 0 <= max(per_round):
        slower["noise"].append(key)
    return slower["step_ms_p50"] - faster["step_ms_p50"]


def describe_machine(device, backend):
    """What the report names: the CPU (or GPUs), the cores this process may use, torch."""
    # Linux: this process's affinity (Slurm, taskset); macOS has no such call.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = "CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":")[1].strip() for line in f if "model name" in line), cpu)
    name = f"{cpu} ({cores} cores)"
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return dict(name=name, cores=cores, torch=torch.__version__, backend=backend)


def point_records(args, point, raw):
    """One world size's breakdown: unwrapped, ddp_no_sync, and ddp once per bucket size."""
    rows = {}
    for name, seconds in raw["times"].items():
        stats = step_stats(seconds, point["global_batch"])
        rows[name] = {**point, "variant": name.split()[0], **stats, "noise": []}
    compute, no_sync = rows["unwrapped"], rows["ddp_no_sync"]
    no_sync["wrapper_ms"] = difference(no_sync, compute, "wrapper_ms")
    for cap in args.bucket_cap_mb:
        ddp = rows[f"ddp {cap:g}"]
        ddp["bucket_cap_mb"] = cap
        ddp["exposed_comm_ms"] = difference(ddp, no_sync, "exposed_comm_ms")
        overhead_ms = difference(ddp, compute, "overhead_pct")
        ddp["overhead_pct"] = 100 * overhead_ms / compute["step_ms_p50"]
    return list(rows.values())


def build_records(args, machine, points):
    """Raw results by world size -> the records: scaling, breakdown, allreduce."""
    breakdown, allreduce = [], []
    for n, raw in points.items():
        threads, batch = raw["threads"], raw["batch_per_rank"]
        point = dict(world_size=n, threads_per_rank=threads, batch_per_rank=batch)
        point["global_batch"] = batch * n
        # More threads than cores: such a point measures processes sharing cores, not DDP.
        point["oversubscribed"] = n * threads > machine["cores"]
        breakdown += point_records(args, point, raw)
        for nbytes, seconds in raw["allreduce"]:
            algbw = nbytes / seconds / 1e9
            row = dict(world_size=n, bytes=nbytes, time_us=1e6 * seconds, algbw_gbps=algbw)
            allreduce.append({**row, "busbw_gbps": busbw(algbw, n)})
    # Scaling: DDP with the first bucket size, at each world size.
    scaling = [r for r in breakdown if r.get("bucket_cap_mb") == args.bucket_cap_mb[0]]
    one = scaling[0]["samples_per_s"]
    for r in scaling:
        r["speedup"] = r["samples_per_s"] / one
        r["efficiency"] = efficiency(r["samples_per_s"], one, r["world_size"])
    return {"scaling": scaling, "breakdown": breakdown, "allreduce": allreduce}


def print_records(records, keys):
    """One `key value | ...` line per record, 4 significant digits, differences marked (noise)."""
    for r in records:
        fields = []
        for k in keys.split():
            value = r.get(k)
            if value is None or value is False:
                continue
            if k == "efficiency":
                value = f"{value:.1%}"
            elif isinstance(value, float):
                value = f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
            fields.append(f"{k} {value}" + (" (noise)" if k in r.get("noise", []) else ""))
        print(" | ".join(fields))


def report(args, machine, points):
    """Print the records, write them as JSON and plot them when asked; returns the scaling."""
    records = build_records(args, machine, points)
    scaling, breakdown, allreduce = records.values()
    print(f"\nscaling | {machine['name']} | torch {machine['torch']} | {machine['backend']}")
    print_records(
        scaling,
        "world_size threads_per_rank oversubscribed global_batch samples_per_s "
        "step_ms_p50 step_ms_p90 speedup efficiency",
    )
    print(
        "\nbreakdown | unwrapped = compute | wrapper_ms = ddp_no_sync - unwrapped | exposed_comm_ms"
        f" = ddp - ddp_no_sync | overhead_pct = ddp vs unwrapped | noise: {ROUNDS} rounds disagree"
    )
    print_records(
        breakdown,
        "world_size variant bucket_cap_mb step_ms_p50 step_ms_p90 wrapper_ms exposed_comm_ms "
        "overhead_pct",
    )
    if allreduce:
        print("\nall-reduce | float32 sum | busbw = algbw x 2(n-1)/n")
        print_records(allreduce, "world_size bytes time_us algbw_gbps busbw_gbps")
    superlinear = [r["world_size"] for r in scaling if r["efficiency"] > 1.05]
    if superlinear:
        print(
            f"warning: efficiency above 100% at world size {superlinear}: the world sizes run one "
            "after another, and the machine was busier while world size 1 ran; re-run"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "config": vars(args), **records}, f, indent=1)
    if args.plot:
        write_plot(args, machine, scaling)
    return scaling


def write_plot(args, machine, scaling):
    """Samples/s against linear by world size, each point labelled with its efficiency."""
    # No pyplot: no display, no global state.
    from matplotlib.figure import Figure

    sizes = [r["world_size"] for r in scaling]
    samples = [r["samples_per_s"] for r in scaling]
    ax = Figure(figsize=(7.5, 4.8), layout="tight").subplots()
    ax.plot(sizes, [n * samples[0] for n in sizes], "k--", label="linear (N x 1 process)")
    ax.plot(sizes, samples, "o-", label="measured, DDP")
    for r in scaling:
        label = f"  {r['efficiency']:.0%}" + (" (oversubscribed)" if r["oversubscribed"] else "")
        ax.text(r["world_size"], r["samples_per_s"], label, va="top")
    kind = "strong" if args.strong else "weak"
    threads = ",".join(str(r["threads_per_rank"]) for r in scaling)
    title = f"ddp_benchmark.py --model {args.model}: {kind} scaling, threads/rank {threads}\n"
    title += f"{machine['name']} | torch {machine['torch']} | {machine['backend']}"
    ax.set(xlabel="world size (processes)", ylabel="samples/s, all ranks", xticks=sizes)
    ax.set(title=title, ylim=(0, None), xmargin=0.15)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    ax.figure.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")
