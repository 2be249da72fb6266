"""Lesson 6's companion: the models ddp_benchmark.py times, and the records it makes of the raw
step timings (printed, written as JSON, plotted). Every record names the machine, torch, the
backend and the threads per rank."""

import os

import numpy as np
import torch
import torch.nn as nn


def model_and_batch(args, batch, device, rank):
    """The model (same weights on every rank) and this rank's fixed batch, kept on the device."""
    torch.manual_seed(args.seed)
    if args.model == "mnist":
        # Lesson 1's CNN: 28x28 digit -> 10 class scores, 215,370 parameters.
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

        # Random initial weights: nothing to download.
        model = getattr(torchvision.models, args.model)(weights=None)
        shape = (3, args.image_size, args.image_size)
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
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
    """Per-step times (slowest rank) -> p50/p90 in ms and samples/s over the whole run."""
    # numpy's default: linear interpolation between the two nearest steps.
    p50, p90 = np.percentile(step_seconds, [50, 90])
    return {
        "step_ms_p50": 1000 * float(p50),
        "step_ms_p90": 1000 * float(p90),
        "samples_per_s": global_batch * len(step_seconds) / sum(step_seconds),
    }


def describe_machine(device, backend, cores, slots):
    """What every record names: the CPU (or GPU) model, the cores, torch and the backend."""
    cpu = "unknown CPU"
    # Linux; elsewhere the CPU stays unnamed.
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    gpu = None
    name = f"{cpu} ({cores} cores)"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(0)
        name = f"{gpu} x{slots}"
    return {
        "name": name,
        "cpu": cpu,
        "cores": cores,
        "gpu": gpu,
        "torch": torch.__version__,
        "backend": backend,
        "device": device.type,
    }


def build_records(args, machine, points):
    """Raw results per world size -> (scaling, breakdown, allreduce) lists of records."""
    breakdown = []
    allreduce = []
    for n, raw in points.items():
        batch = raw["batch_per_rank"]
        threads = raw["threads"]
        tag = {
            "machine": machine["name"],
            "torch": machine["torch"],
            "backend": machine["backend"],
            "world_size": n,
            "threads_per_rank": threads,
            "model": args.model,
            "params": raw["params"],
            # More threads than cores: such a point measures processes sharing cores, not DDP.
            "oversubscribed": machine["device"] == "cpu" and n * threads > machine["cores"],
            "batch_per_rank": batch,
            "global_batch": batch * n,
        }
        stats = {name: step_stats(t, batch * n) for name, t in raw["times"].items()}
        compute = stats["unwrapped"]["step_ms_p50"]
        wrapper = stats["no_sync"]["step_ms_p50"]
        breakdown.append({**tag, "variant": "unwrapped", **stats["unwrapped"]})
        breakdown.append(
            {**tag, "variant": "ddp_no_sync", **stats["no_sync"], "wrapper_ms": wrapper - compute}
        )
        for hook in args.comm_hook:
            for cap in args.bucket_cap_mb:
                name = f"ddp {cap:g} {hook}"
                ddp = stats[name]
                record = {**tag, "variant": "ddp", "bucket_cap_mb": cap, "comm_hook": hook, **ddp}
                record["exposed_comm_ms"] = ddp["step_ms_p50"] - wrapper
                record["overhead_pct"] = 100 * (ddp["step_ms_p50"] - compute) / compute
                record["comm_bytes_per_step"] = raw["comm"][name]
                breakdown.append(record)
        for nbytes, seconds in raw["allreduce"]:
            algbw = nbytes / seconds
            allreduce.append(
                {
                    **tag,
                    "bytes": nbytes,
                    "time_us": 1e6 * seconds,
                    "algbw_gbps": algbw / 1e9,
                    "busbw_gbps": busbw(algbw, n) / 1e9,
                }
            )
    # Scaling: the first DDP variant (first hook, first bucket size) at each world size.
    scaling = [
        r
        for r in breakdown
        if r["variant"] == "ddp"
        and r["bucket_cap_mb"] == args.bucket_cap_mb[0]
        and r["comm_hook"] == args.comm_hook[0]
    ]
    one = scaling[0]["samples_per_s"]
    for r in scaling:
        r["speedup"] = r["samples_per_s"] / one
        r["efficiency"] = efficiency(r["samples_per_s"], one, r["world_size"])
    return scaling, breakdown, allreduce


def format_value(key, value):
    """4 significant digits without exponents; efficiency in percent."""
    if not isinstance(value, float):
        return value
    if key == "efficiency":
        return f"{value:.1%}"
    if abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.0f}"


def print_records(records, keys):
    """One `key value | ...` line per record, the JSON's own keys; absent or False keys left out."""
    for r in records:
        fields = [
            f"{k} {format_value(k, r[k])}" for k in keys.split() if r.get(k) not in (None, False)
        ]
        print(" | ".join(fields))


def print_report(machine, scaling, breakdown, allreduce):
    """Scaling, the step time breakdown, the all-reduce bandwidth: each section says what it is."""
    print(f"\nscaling | {machine['name']} | torch {machine['torch']} | {machine['backend']}")
    print_records(
        scaling,
        "world_size threads_per_rank oversubscribed global_batch samples_per_s step_ms_p50 "
        "step_ms_p90 speedup efficiency",
    )
    print(
        "\nbreakdown | unwrapped = compute | wrapper_ms = ddp_no_sync - unwrapped | "
        "exposed_comm_ms = ddp - ddp_no_sync | overhead_pct = ddp vs unwrapped"
    )
    print_records(
        breakdown,
        "world_size variant bucket_cap_mb comm_hook step_ms_p50 step_ms_p90 wrapper_ms "
        "exposed_comm_ms overhead_pct comm_bytes_per_step",
    )
    if allreduce:
        print("\nall-reduce | float32 sum | busbw = algbw x 2(n-1)/n")
        print_records(allreduce, "world_size bytes time_us algbw_gbps busbw_gbps")
    superlinear = [r["world_size"] for r in scaling if r["efficiency"] > 1.05]
    if superlinear:
        print(
            f"warning: efficiency above 100% at world size {superlinear}: the world sizes run "
            "one after another, and the machine was busier while world size 1 ran; re-run"
        )
    if max(r["step_ms_p90"] / r["step_ms_p50"] for r in breakdown) > 1.25:
        print(
            "warning: noisy step times (p90 > 1.25 x p50): a busy machine or a short run; "
            "differences of a few percent mean nothing (re-run with more --steps)"
        )


def write_plot(path, args, machine, scaling):
    """Throughput against linear by world size, each point labelled with its efficiency."""
    # No pyplot: no display, no global state.
    from matplotlib.figure import Figure

    sizes = [r["world_size"] for r in scaling]
    throughput = [r["samples_per_s"] for r in scaling]
    fig = Figure(figsize=(7.5, 4.8), layout="tight")
    ax = fig.subplots()
    ax.plot(sizes, [n * throughput[0] for n in sizes], "k--", label="linear (N x 1 process)")
    ax.plot(sizes, throughput, "o-", label="measured, DDP")
    for n, samples, r in zip(sizes, throughput, scaling, strict=True):
        label = f"{r['efficiency']:.0%}"
        if r["oversubscribed"]:
            label += " (oversubscribed)"
        ax.annotate(label, (n, samples), textcoords="offset points", xytext=(6, -14))
    ax.set(xlabel="world size (processes)", ylabel="samples/s, all ranks", xticks=sizes)
    ax.set_ylim(bottom=0)
    batches = ",".join(str(r["global_batch"]) for r in scaling)
    threads = ",".join(str(r["threads_per_rank"]) for r in scaling)
    kind = "weak"
    if args.strong:
        kind = "strong"
    ax.set_title(
        f"ddp_benchmark.py --model {args.model}: {kind} scaling, global batch {batches}, "
        f"threads/rank {threads}\n{machine['name']} | torch {machine['torch']} | "
        f"{machine['backend']} | labels: efficiency",
        fontsize=9,
    )
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
