"""Lesson 9's measurements (docs/from_scratch.md): how each gradient sync of ddp_from_scratch.py,
and torch's DistributedDataParallel, spends a step; the naive sync's communication predicted from
lesson 6's all-reduce latency and bandwidth; one step of naive and bucket drawn as a timeline.

    torchrun --standalone --nproc_per_node=2 docs/from_scratch_timing.py \\
        --latency-us 160 --algbw-gbps 1.1 --plot docs/img/from_scratch_timeline.png

Every rank takes the same steps, in rounds: in each, every sync takes one step with its
communication and one without it (inside no_sync, the same forward, backward and optimizer
step), so a busy machine slows all of them alike. A step lasts as long as its slowest rank.
The exposed communication is the median step with it minus the median step without it.
"""

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

# The profiler's own log is noise here ("gpuGetDeviceCount failed" on a machine without GPUs).
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

# The lessons live one folder up; this page's tool imports lesson 9's syncs to measure them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddp_common  # noqa: E402
import ddp_from_scratch as lesson  # noqa: E402

COLORS = {
    "forward": "tab:blue",
    "backward": "tab:green",
    "wait": "tab:red",
    "optimizer": "tab:purple",
}
SYNCS = {"naive": lesson.NaiveSync, "overlap": lesson.OverlapSync, "bucket": lesson.BucketSync}


def parse_args():
    parser = ddp_common.Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=ddp_common.positive_int, default=20, help="per sync")
    parser.add_argument("--width", type=ddp_common.positive_int, default=512)
    parser.add_argument("--depth", type=ddp_common.positive_int, default=8)
    parser.add_argument("--batch-size", type=ddp_common.positive_int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=2.5, help="bucket and torch's DDP")
    parser.add_argument("--latency-us", type=float, required=True, help="lesson 6: small message")
    parser.add_argument("--algbw-gbps", type=float, required=True, help="lesson 6: large message")
    parser.add_argument("--plot", metavar="PNG", help="draw one step of naive and bucket")
    return parser.parse_args()


def build(name, args, ddp):
    """Lesson 9's model (its head used on every step) under one sync; torch's DDP as lessons
    1-8 use it."""
    torch.manual_seed(0)
    model = lesson.Net(width=args.width, depth=args.depth).to(ddp.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if name == "torch":
        net = DDP(model, bucket_cap_mb=args.bucket_mb)
        return net, net, optimizer
    return model, SYNCS[name](model, args.bucket_mb), optimizer


def finished(device):
    """Wait for the GPU (timing only): its work runs after the Python that queued it. The current
    stream only: all-reduces still running on NCCL's own stream are left to `wait` (finish()
    makes the current stream wait for them; torch's DDP does so inside backward)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def step(name, net, sync, optimizer, tokens, communicate):
    """One optimizer step; returns its time and the time it waited for the all-reduces after
    backward (ms)."""
    device = tokens.device
    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with contextlib.nullcontext() if communicate else sync.no_sync():
        with record_function("forward"):
            loss = net(tokens, use_aux=True)
        with record_function("backward"):
            loss.backward()
    finished(device)
    backward_end = time.perf_counter()
    with record_function("wait"):
        if communicate and name != "torch":
            sync.finish()
        finished(device)
    wait_end = time.perf_counter()
    with record_function("optimizer"):
        optimizer.step()
        finished(device)
    return 1000 * (time.perf_counter() - start), 1000 * (wait_end - backward_end)


def slowest(values, device):
    """Per step, the slowest rank's value: every rank waits for it."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def measure(args, ddp, runs, tokens):
    """{sync: (p50 step with communication, p50 without, p50 wait)} in ms."""
    times = {name: ([], [], []) for name in runs}
    for round_ in range(args.steps + 2):
        for name, (net, sync, optimizer) in runs.items():
            with_comm, wait = step(name, net, sync, optimizer, tokens, communicate=True)
            without, _ = step(name, net, sync, optimizer, tokens, communicate=False)
            if round_ >= 2:
                for series, value in zip(times[name], (with_comm, without, wait), strict=True):
                    series.append(value)
    return {
        name: [statistics.median(slowest(series, ddp.device)) for series in series_list]
        for name, series_list in times.items()
    }


def naive_comm(args, ddp, run, tokens):
    """The naive sync's all-reduces alone (ms): the ranks meet at a barrier first, so that no
    rank's time includes waiting for another's slower backward."""
    net, sync, optimizer = run
    times = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        net(tokens, use_aux=True).backward()
        dist.barrier()
        finished(ddp.device)
        start = time.perf_counter()
        sync.finish()
        finished(ddp.device)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(slowest(times, ddp.device))


def all_reduces(name, net, sync):
    """All-reduces a step makes: one per gradient or bucket, and the used-parameter count."""
    if name == "torch":
        return net._get_ddp_logging_data().get("num_buckets_reduced", 0) or float("nan")
    return len(getattr(sync, "buckets", sync.params)) + 1


def report(args, ddp, runs, results, measured):
    params = runs["naive"][1].params
    nbytes = sum(p.numel() * p.element_size() for p in params)
    print(
        f"timing | world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} | "
        f"trainable {sum(p.numel() for p in params):,} ({nbytes / 2**20:.1f} MiB) | "
        f"bucket_mb {args.bucket_mb} | steps {args.steps}"
    )
    print("sync     step ms  without comm ms  exposed ms  wait ms  all_reduces")
    for name, (with_comm, without, wait) in results.items():
        count = all_reduces(name, *runs[name][:2])
        print(
            f"{name:8} {with_comm:7.1f} {without:16.1f} {with_comm - without:11.1f} "
            f"{wait:8.1f} {count:12}"
        )
    # One all-reduce after another: each costs the latency, and its bytes at the bandwidth.
    count = len(params) + 1
    predicted = count * args.latency_us / 1000 + nbytes / (args.algbw_gbps * 1e9) * 1000
    print(
        f"cost model: naive | all_reduces {count} | bytes {nbytes:,} | latency_us "
        f"{args.latency_us:g} | algbw_gbps {args.algbw_gbps:g} | predicted_ms {predicted:.1f} | "
        f"measured_ms {measured:.1f}"
    )


def timeline(name, run, tokens, steps=5):
    """Five steps with communication under torch.profiler; of the median one: (phase spans,
    all-reduce spans) in ms from its start, on this rank."""
    activities = [ProfilerActivity.CPU]
    if tokens.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("step"):
                step(name, *run, tokens, communicate=True)
    events = prof.events()
    steps = sorted((e.time_range for e in events if e.name == "step"), key=lambda r: r.elapsed_us())
    middle = steps[len(steps) // 2]
    inside = [e for e in events if middle.start <= e.time_range.start < middle.end]
    span = lambda e: ((e.time_range.start - middle.start) / 1000, e.time_range.elapsed_us() / 1000)  # noqa: E731
    phases = {e.name: span(e) for e in inside if e.name in COLORS}
    on_gpu = [e for e in inside if e.device_type.name == "CUDA"]
    comm = [span(e) for e in on_gpu if "nccl" in e.name.lower()] or [
        span(e) for e in inside if e.name.startswith("gloo:all_reduce")
    ]
    return phases, comm


def plot(path, pictures, ddp):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(pictures), 1, figsize=(9, 1.6 * len(pictures) + 0.6), sharex=True)
    for ax, (name, (phases, comm)) in zip(axes, pictures.items(), strict=True):
        for phase, (left, width) in phases.items():
            ax.broken_barh([(left, width)], (1, 0.8), color=COLORS[phase], label=phase)
        ax.broken_barh(comm, (0, 0.8), color="tab:orange", edgecolor="black", label="all-reduce")
        ax.set_yticks([0.4, 1.4], ["all-reduces", "main thread"])
        ax.set_title(f"--sync {name}", loc="left", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", ncol=5, fontsize=8)
    axes[-1].set_xlabel(
        f"ms from the step's start, rank 0 of {ddp.world_size} ({ddp.device.type}, {ddp.backend})"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    args = parse_args()
    ddp = ddp_common.setup()
    runs = {name: build(name, args, ddp) for name in [*SYNCS, "torch"]}
    generator = torch.Generator().manual_seed(ddp.rank)
    tokens = torch.randint(256, (args.batch_size, 33), generator=generator).to(ddp.device)
    results = measure(args, ddp, runs, tokens)
    measured = naive_comm(args, ddp, runs["naive"], tokens)
    if ddp.rank == 0:
        report(args, ddp, runs, results, measured)
    if args.plot:
        pictures = {name: timeline(name, runs[name], tokens) for name in ("naive", "bucket")}
        if ddp.rank == 0:
            plot(args.plot, pictures, ddp)
    del runs
    ddp_common.cleanup()


if __name__ == "__main__":
    main()
