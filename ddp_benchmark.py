"""Lesson 6: does data parallelism pay on YOUR machine? Measure it.

    python ddp_benchmark.py                                   # MNIST CNN, world sizes 1, 2, 4 ... all GPUs/cores
    python ddp_benchmark.py --model resnet50 --bucket-cap-mb 25,1,5,100 --json bench.json
    python ddp_benchmark.py --model mnist --max-procs 2 --threads 1       # CPU: the 1 -> 2 process target
    python ddp_benchmark.py --model resnet18 --comm-hook none,fp16,bf16,powersgd --bucket-cap-mb 25,5

Run it with plain `python`: it starts its own workers (mp.spawn), one group per world size
1, 2, 4, ... up to --max-procs. Every number it prints is measured here and now; nothing is
assumed. For each world size it reports:

- scaling: samples/s (global and per rank), step time p50/p90, speed-up and scaling efficiency
  against 1 process. Weak scaling (default) keeps the batch per rank fixed, so the global batch
  grows with the world size; --strong keeps the global batch fixed and splits it. Efficiency =
  throughput(N) / (N x throughput(1)) in both cases.
- where the time goes: the same model unwrapped (no DDP, no communication), DDP under
  `no_sync()` (the wrapper without the gradient all-reduce) and full DDP, timed in interleaved
  rounds. unwrapped = compute; no_sync - unwrapped = the wrapper's own cost; DDP - no_sync = the
  communication that backward could not hide (exposed communication). --bucket-cap-mb sweeps the
  size of DDP's gradient buckets, and --comm-hook sweeps DDP communication hooks (fp16/bf16
  compression, PowerSGD, from lesson 2's --comm-hook): every hook x bucket size is a variant.
- for each DDP variant, the bytes each rank hands to all-reduce in one step (counted in a
  separate pass, not in the timed steps) and the peak memory per rank.
- all-reduce bandwidth over message sizes, as nccl-tests reports it: algbw = bytes / time and
  busbw = algbw x 2(n-1)/n (the traffic each link carries in a ring all-reduce, comparable
  across world sizes and against the hardware's link speed).

A step is forward + backward + optimizer step on one synthetic batch that stays on the device:
the benchmark measures the model and DDP, not the data pipeline. A step's time is that of the
slowest rank (every rank waits for it at the all-reduce). On CPU each rank gets
cores / world size threads (--threads to fix it); a sweep past the core count oversubscribes the
CPU and is flagged. Output: tables on stdout, --json FILE, and a PNG plot when matplotlib is
installed (optional). The DDP-specific lines are marked `# DDP:`.
"""
import argparse
import copy
import gc
import json
import math
import os
import platform
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import cleanup, fail, free_port, pick_device, set_seed, setup
from ddp_mnist import Net  # lesson 1's CNN, unchanged

MODELS = ("mnist", "resnet18", "resnet50", "gpt2")
DEFAULT_BATCH = {"mnist": 64, "resnet18": 32, "resnet50": 32, "gpt2": 8}  # per rank
TARGET_DDP_OVERHEAD_PCT = 3.0    # DDP at world size 1 vs the unwrapped model, step time p50
TARGET_WEAK_EFFICIENCY = 0.90    # MNIST CNN, 1 -> 2 CPU processes with 1 thread each
NOISY_SPREAD = 1.25              # p90/p50 above this: the machine was busy, say so


# ---------------------------------------------------------------- pure formulas (unit-tested)

def percentile(values, q):
    """q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default): percentile([1, 2, 3, 4], 50) = 2.5, percentile([1, 2, 3, 4], 90) = 3.7."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def speedup(throughput_n, throughput_1):
    """How many times more samples/s N processes deliver than 1."""
    return throughput_n / throughput_1


def efficiency(throughput_n, throughput_1, n):
    """Scaling efficiency: throughput(N) / (N x throughput(1)); 1.0 = perfectly linear. The same
    formula serves weak scaling (global batch grows) and strong scaling (global batch fixed)."""
    return throughput_n / (n * throughput_1)


def algbw(nbytes, seconds):
    """Algorithm bandwidth of one all-reduce, bytes/s: the message size over the time."""
    return nbytes / seconds


def busbw(alg_bw, n):
    """Bus bandwidth as nccl-tests defines it for all-reduce: algbw x 2(n-1)/n. A ring all-reduce
    sends and receives 2(n-1)/n x the message over each link, so busbw is what each link carried
    per second; it does not depend on n for an ideal ring, and compares with the link's speed."""
    return alg_bw * 2 * (n - 1) / n


def world_sizes(max_procs):
    """1, 2, 4, ... up to max_procs, plus max_procs itself: 6 -> [1, 2, 4, 6]."""
    sizes, n = [], 1
    while n <= max_procs:
        sizes.append(n)
        n *= 2
    return sizes if sizes[-1] == max_procs else sizes + [max_procs]


def message_sizes(max_bytes, smallest=4096, factor=4):
    """All-reduce message sizes in bytes: 4 KiB, 16 KiB, ... up to max_bytes (multiples of 4:
    the buffers are float32)."""
    sizes, b = [], smallest
    while b <= max_bytes:
        sizes.append(b)
        b *= factor
    return sizes or [max(4, max_bytes // 4 * 4)]


def split_steps(steps, rounds):
    """Split `steps` timed steps into `rounds` chunks as evenly as possible: (10, 3) -> [4, 3, 3]."""
    rounds = max(1, min(rounds, steps))
    return [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]


def threads_per_rank(cores, world_size, requested=0):
    """CPU threads for each rank: --threads if given, else the cores shared out (at least 1)."""
    return requested or max(1, cores // world_size)


def oversubscribed(world_size, threads, cores):
    """True when the ranks' threads outnumber the cores: they then time-share cores."""
    return world_size * threads > cores


def step_stats(step_seconds, global_batch):
    """Step times (s, slowest rank per step) -> p50/p90 in ms and samples/s over the whole run."""
    return {"step_ms_p50": 1000 * percentile(step_seconds, 50),
            "step_ms_p90": 1000 * percentile(step_seconds, 90),
            "samples_per_s": global_batch * len(step_seconds) / sum(step_seconds)}


# ---------------------------------------------------------------- command line

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line, exit 2, no usage dump
        fail(f"{message} (see python ddp_benchmark.py --help)")


HOOKS = ("none", "fp16", "bf16", "powersgd")


def hook_list(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in HOOKS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {','.join(HOOKS)}")
    return list(dict.fromkeys(names))


def float_list(text):
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more sizes > 0, e.g. 25 or 25,1,5,100")
    return values


def parse_args(argv=None):
    p = Parser(description="Lesson 6: measure DDP scaling efficiency, where the step time goes, and "
                           "all-reduce bandwidth. Run with plain python; it starts its own workers.")
    p.add_argument("--model", default="mnist", choices=MODELS,
                   help="mnist: lesson 1's CNN (~0.2 M params); resnet18/resnet50: torchvision, "
                        "random init; gpt2: a stack of 6 GPT-2-small blocks (~81 M params) (default mnist)")
    p.add_argument("--max-procs", type=int, default=0,
                   help="largest world size; the sweep is 1, 2, 4, ... up to it (default: the "
                        "number of GPUs, or of CPU cores without GPUs)")
    p.add_argument("--strong", action="store_true",
                   help="strong scaling: keep the GLOBAL batch at --batch-size and split it across "
                        "ranks (default: weak scaling, --batch-size per rank)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="samples per step PER RANK (weak scaling), or the global batch with "
                        "--strong (default: mnist 64, resnet 32, gpt2 8)")
    p.add_argument("--image-size", type=int, default=224, help="ResNet input side in pixels (default 224)")
    p.add_argument("--seq-len", type=int, default=256, help="GPT-2 tokens per sample (default 256)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps per variant first (cuDNN autotune, DDP bucket rebuild) (default 5)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (default 30)")
    p.add_argument("--bucket-cap-mb", type=float_list, default=[25.0],
                   help="DDP gradient bucket size(s) in MB, comma-separated, e.g. 25,1,5,100: each is "
                        "timed at every world size; the scaling table uses the first (default 25)")
    p.add_argument("--comm-hook", type=hook_list, default=["none"],
                   help="DDP communication hook(s), comma-separated, from none,fp16,bf16,powersgd: each "
                        "is timed with every bucket size; the scaling table uses the first (default none)")
    p.add_argument("--powersgd-rank", type=int, default=2,
                   help="PowerSGD matrix approximation rank (default 2)")
    p.add_argument("--powersgd-warmup", type=int, default=2,
                   help="PowerSGD steps of plain all-reduce before compressing (default 2, the least "
                        "allowed); the benchmark runs them before timing, so it times compressed steps")
    p.add_argument("--grad-as-bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True): gradients live inside the all-reduce "
                        "buckets, saving the copies into and out of them (and their memory)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads per rank (default: cores / world size); ignored on GPU")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="bf16 = bf16 autocast; auto = bf16 on CUDA, fp32 on CPU (default auto)")
    p.add_argument("--allreduce-max-mb", type=float, default=64.0,
                   help="largest all-reduce message in the bandwidth sweep, MiB (default 64)")
    p.add_argument("--allreduce-iters", type=int, default=20,
                   help="timed all-reduces per message size (default 20)")
    p.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and synthetic batches")
    p.add_argument("--json", default="", metavar="FILE", help="also write every record to this JSON file")
    p.add_argument("--plot", default="", metavar="FILE",
                   help="PNG plot (needs matplotlib; default: the --json name with .png, if --json)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny, fast run to check the tool works: 1 warm-up, 4 steps, batch 8, "
                        "32-pixel images, 32 tokens, all-reduce up to 64 KiB, unless those flags are "
                        "given; its figures mean little")
    args = p.parse_args(argv)
    if args.quick:  # small settings, for every flag the user left at its default
        quick = dict(warmup=1, steps=4, allreduce_iters=3, allreduce_max_mb=1 / 16, image_size=32,
                     seq_len=32, batch_size=8)
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    args.batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    for name in ("batch_size", "image_size", "seq_len", "warmup", "steps", "allreduce_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.powersgd_rank < 1 or args.powersgd_warmup < 2:
        p.error("--powersgd-rank must be >= 1 and --powersgd-warmup >= 2")
    if args.max_procs < 0 or args.threads < 0:
        p.error("--max-procs and --threads must be >= 0 (0 = automatic)")
    if args.allreduce_max_mb <= 0:
        p.error("--allreduce-max-mb must be > 0")
    if args.plot and not args.plot.endswith(".png"):
        p.error(f"--plot {args.plot}: give a .png file name")
    args.plot = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else "")
    return args


# ---------------------------------------------------------------- models and data

class GPT2Block(nn.Module):
    """One GPT-2 transformer block: pre-LayerNorm causal self-attention, then an MLP."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.fc_out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2Stack(nn.Module):
    """Token + position embeddings, `n_layer` GPT-2 blocks, a tied LM head: GPT-2 small's widths
    (768, 12 heads, vocab 50257) with 6 of its 12 layers, ~81 M parameters."""

    def __init__(self, seq_len, vocab=50257, d_model=768, n_head=12, n_layer=6):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(GPT2Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # logits (B, T, vocab)


def build_model(args):
    if args.model == "mnist":
        return Net()
    if args.model == "gpt2":
        return GPT2Stack(args.seq_len)
    import torchvision
    return getattr(torchvision.models, args.model)(weights=None)  # random init: no download


def synthetic_batch(args, batch, device, seed):
    """One fixed random batch (inputs, targets), made once on the device."""
    g = torch.Generator().manual_seed(seed)
    if args.model == "mnist":
        x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    elif args.model == "gpt2":
        tokens = torch.randint(0, 50257, (batch, args.seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    else:
        x = torch.randn(batch, 3, args.image_size, args.image_size, generator=g)
        y = torch.randint(0, 1000, (batch,), generator=g)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


# ---------------------------------------------------------------- one world size (in each worker)

def wrap_ddp(model, ddp, bucket_cap_mb, args, hook="none", counting=False):
    """DDP: wrap a copy of the model. The one place DDP options are set. `hook` registers a
    communication hook (lesson 2's register_comm_hook). counting=True is for CommCounter: DDP's
    built-in all-reduce runs in C++, out of its sight, so hook "none" then registers
    allreduce_hook, the Python twin of the built-in (same buckets, same fp32 all-reduce)."""
    from ddp_training import register_comm_hook  # lesson 2's --comm-hook
    on_gpu = ddp.device.type == "cuda"
    wrapped = DDP(copy.deepcopy(model), device_ids=[ddp.device.index] if on_gpu else None,
                  bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=args.grad_as_bucket_view)
    if hook == "none" and counting:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        register_comm_hook(wrapped, hook, args.powersgd_rank, args.powersgd_warmup)
    return wrapped


class CommCounter:
    """Counts what this rank hands to torch.distributed.all_reduce while active: calls and bytes
    (tensor.nbytes: a bf16 bucket counts 2 bytes per gradient, a PowerSGD factor only its own
    size). It replaces dist.all_reduce for the duration, which the communication hooks call;
    a hook's later all-reduces (PowerSGD's, chained in futures) are counted too, as long as the
    step finishes inside the `with`."""

    def __init__(self):
        self.bytes, self.calls = 0, 0

    def __enter__(self):
        self._all_reduce = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.nbytes
            self.calls += 1
            return self._all_reduce(tensor, *args, **kwargs)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._all_reduce


def variant_name(cap, hook):
    return f"ddp {cap:g}" + ("" if hook == "none" else f" {hook}")


def measure_variant(base, batch, args, ddp, cap, hook):
    """A separate, untimed pass over one DDP variant (its own copy): the bytes all-reduced in one
    step (after warm-up: DDP rebuilds its buckets after step 1, PowerSGD compresses only after
    its warm-up) and, on GPU, the variant's own peak memory (everything it allocates, from the
    model copy to activations, gradients, buckets, optimizer and hook state)."""
    on_gpu = ddp.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(ddp.device)
        torch.cuda.reset_peak_memory_stats(ddp.device)
    model = wrap_ddp(base, ddp, cap, args, hook, counting=True)
    step = make_step(model, batch, args, ddp)
    for _ in range(args.powersgd_warmup if hook == "powersgd" else 1):
        step()
    with CommCounter() as counter:
        step()
    peak = None
    if on_gpu:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(ddp.device) - before
    del model, step
    return counter.bytes, peak


def peak_rss():
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_step(model, batch, args, ddp, sync=True):
    """A closure running one training step. sync=False runs it under DDP's no_sync(): the same
    wrapper, hooks and bookkeeping, minus the gradient all-reduce."""
    on_gpu = ddp.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)
    amp = args.precision == "bf16" or (args.precision == "auto" and on_gpu)
    x, y = batch

    def step():
        with model.no_sync() if not sync else nullcontext():  # DDP: skip the all-reduce
            with torch.autocast(ddp.device.type, dtype=torch.bfloat16, enabled=amp):
                out = model(x)
                loss = F.cross_entropy(out.flatten(0, -2), y.flatten())  # (B*T, vocab) for gpt2
            loss.backward()  # DDP: gradients are all-reduced in buckets while backward runs
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def time_steps(step, n, device):
    """Seconds per step for n back-to-back steps: CUDA events on GPU (no host sync per step),
    perf_counter on CPU."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in events]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def slowest_rank(values, ddp):
    """Per-step maximum over ranks: a data-parallel step is as slow as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64, device=ddp.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_variants(variants, args, ddp):
    """Warm every variant up, then time them in interleaved rounds (A B C A B C ...), so a slow
    spell of the machine hits them all alike instead of one whole variant."""
    for step in variants.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in variants}
    for chunk in split_steps(args.steps, rounds=5):
        for name, step in variants.items():
            dist.barrier()  # start together; the unwrapped variant never synchronises by itself
            times[name] += time_steps(step, chunk, ddp.device)
    return {name: slowest_rank(t, ddp) for name, t in times.items()}


def time_allreduce(args, ddp):
    """Seconds per all-reduce (sum, float32) at each message size; slowest rank."""
    sync = torch.cuda.synchronize if ddp.device.type == "cuda" else (lambda: None)
    rows = []
    for nbytes in message_sizes(int(args.allreduce_max_mb * 2**20)):
        buf = torch.zeros(nbytes // 4, device=ddp.device)  # zeros: the sum never overflows
        for _ in range(3):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.allreduce_iters):
            dist.all_reduce(buf)
        sync()
        rows.append((nbytes, slowest_rank([(time.perf_counter() - t0) / args.allreduce_iters], ddp)[0]))
    return rows


def worker(rank, world_size, args, threads, out_path):
    """One rank of one world size: time every variant, rank 0 writes the raw times to out_path."""
    ddp = setup(args.backend, rank=rank, world_size=world_size)  # DDP: join this point's group
    try:
        measure_point(ddp, world_size, args, threads, out_path)
    finally:
        # DDP: free the DDP wrappers (they sit in reference cycles, hence gc) before the process
        # group; one destroyed after it was seen to abort the process at exit ("terminate called
        # without an active exception") with a communication hook registered.
        gc.collect()
        cleanup()


def measure_point(ddp, world_size, args, threads, out_path):
    """Time every variant of one world size on this rank; rank 0 writes the raw results."""
    if ddp.device.type == "cpu":
        torch.set_num_threads(threads)
    else:
        torch.backends.cudnn.benchmark = True
    set_seed(args.seed)  # same weights on every rank (DDP also broadcasts rank 0's)
    per_rank = args.batch_size // world_size if args.strong else args.batch_size
    batch = synthetic_batch(args, per_rank, ddp.device, args.seed + ddp.rank)  # own data per rank
    base = build_model(args).to(ddp.device)
    comm = {}  # variant -> (bytes all-reduced per step, GPU peak memory of the variant)
    for hook in args.comm_hook:
        for cap in args.bucket_cap_mb:
            nbytes, peak = measure_variant(base, batch, args, ddp, cap, hook)
            peak = max(slowest_rank([peak], ddp)) if peak is not None else None  # worst rank
            comm[variant_name(cap, hook)] = (nbytes, peak)
    variants = {"unwrapped": make_step(copy.deepcopy(base), batch, args, ddp),
                "no_sync": make_step(wrap_ddp(base, ddp, args.bucket_cap_mb[0], args), batch,
                                     args, ddp, sync=False)}
    for hook in args.comm_hook:
        for cap in args.bucket_cap_mb:
            step = make_step(wrap_ddp(base, ddp, cap, args, hook), batch, args, ddp)
            for _ in range(args.powersgd_warmup if hook == "powersgd" else 0):
                step()  # PowerSGD's plain all-reduce warm-up: time the compressed steps
            variants[variant_name(cap, hook)] = step
    times = time_variants(variants, args, ddp)
    allreduce = time_allreduce(args, ddp) if world_size > 1 else []
    rss = max(slowest_rank([peak_rss()], ddp))  # CPU: the largest rank's peak RSS, whole point
    if ddp.is_main:
        with open(out_path, "w") as f:
            json.dump({"times": times, "allreduce": allreduce, "batch_per_rank": per_rank,
                       "comm": comm, "peak_rss": rss,
                       "threads": torch.get_num_threads(),
                       "params": sum(p.numel() for p in base.parameters())}, f)


def run_point(args, world_size, threads):
    """Start world_size workers with mp.spawn on a fresh port; return rank 0's raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "point.json")
        try:
            mp.spawn(worker, args=(world_size, args, threads, out_path), nprocs=world_size, join=True)
        except mp.ProcessExitedException as e:
            fail(f"a worker at world size {world_size} exited with code {e.exit_code} "
                 "(its own message is above)", code=1)
        except mp.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1]
            fail(f"a worker at world size {world_size} failed: {last}", code=1)
        with open(out_path) as f:
            return json.load(f)


# ---------------------------------------------------------------- records, tables, targets

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_machine(device, backend, cores):
    info = {"cpu": cpu_model(), "cores": cores, "gpu": None, "gpus": 0,
            "torch": torch.__version__, "backend": backend, "device": device.type}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
        info["name"] = f"{info['gpu']} x{info['gpus']}"
    else:
        info["name"] = f"{info['cpu']} ({cores} cores)"
    return info


def build_records(args, machine, points):
    """Raw per-point times -> the scaling, breakdown and all-reduce records (plain dicts)."""
    first = variant_name(args.bucket_cap_mb[0], args.comm_hook[0])
    scaling, breakdown, allreduce = [], [], []
    for n, raw in points.items():
        tag = {"machine": machine["name"], "torch": machine["torch"], "backend": machine["backend"],
               "world_size": n, "threads_per_rank": raw["threads"],
               "oversubscribed": machine["device"] == "cpu" and oversubscribed(n, raw["threads"],
                                                                              machine["cores"])}
        global_batch = raw["batch_per_rank"] * n
        stats = {name: step_stats(t, global_batch) for name, t in raw["times"].items()}
        s = stats[first]
        scaling.append({**tag, "model": args.model, "params": raw["params"],
                        "batch_per_rank": raw["batch_per_rank"], "global_batch": global_batch,
                        "bucket_cap_mb": args.bucket_cap_mb[0], "comm_hook": args.comm_hook[0], **s,
                        "samples_per_s_per_rank": s["samples_per_s"] / n})
        compute, wrapper = stats["unwrapped"]["step_ms_p50"], stats["no_sync"]["step_ms_p50"]
        breakdown.append({**tag, "variant": "unwrapped", **stats["unwrapped"]})
        breakdown.append({**tag, "variant": "ddp_no_sync", **stats["no_sync"],
                          "wrapper_ms": wrapper - compute})
        for hook in args.comm_hook:
            for cap in args.bucket_cap_mb:
                name = variant_name(cap, hook)
                d = stats[name]
                nbytes, gpu_peak = raw["comm"][name]
                # Memory: on GPU this variant's own peak (measured alone); on CPU the rank's
                # peak RSS over the whole point (all variants at once: no per-variant figure).
                mem = ({"peak_mem_mib": gpu_peak / 2**20, "peak_mem_kind": "cuda max allocated, this variant"}
                       if gpu_peak is not None else
                       {"peak_mem_mib": raw["peak_rss"] / 2**20, "peak_mem_kind": "process peak RSS, all variants"})
                breakdown.append({**tag, "variant": "ddp", "bucket_cap_mb": cap, "comm_hook": hook, **d,
                                  "exposed_comm_ms": d["step_ms_p50"] - wrapper,
                                  "overhead_pct": 100 * (d["step_ms_p50"] - compute) / compute,
                                  "comm_bytes_per_step": nbytes, **mem})
        for nbytes, seconds in raw["allreduce"]:
            alg = algbw(nbytes, seconds)
            allreduce.append({**tag, "bytes": nbytes, "time_us": 1e6 * seconds,
                              "algbw_gbps": alg / 1e9, "busbw_gbps": busbw(alg, n) / 1e9})
    one = scaling[0]["samples_per_s"]
    for r in scaling:
        r["speedup"] = speedup(r["samples_per_s"], one)
        r["efficiency"] = efficiency(r["samples_per_s"], one, r["world_size"])
    return scaling, breakdown, allreduce


def table(headers, rows):
    """Text table, numbers right-aligned; a column headed "" (notes) is left-aligned."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) if not h else c.rjust(w) for c, w, h in zip(r, widths, headers))
                     .rstrip() for r in cells)


def print_tables(args, machine, scaling, breakdown, allreduce):
    mode = "strong (global batch fixed)" if args.strong else "weak (batch per rank fixed)"
    print(f"\nscaling: model {args.model} | {mode} | bucket {args.bucket_cap_mb[0]:g} MB | "
          f"{machine['name']} | torch {machine['torch']} | {machine['backend']}")
    print(table(["world", "threads/rank", "batch/rank", "global batch", "samples/s", "per rank",
                 "p50 ms", "p90 ms", "speedup", "efficiency"],
                [[r["world_size"], f"{r['threads_per_rank']}{' OVERSUBSCRIBED' if r['oversubscribed'] else ''}",
                  r["batch_per_rank"], r["global_batch"],
                  f"{r['samples_per_s']:.1f}", f"{r['samples_per_s_per_rank']:.1f}",
                  f"{r['step_ms_p50']:.2f}", f"{r['step_ms_p90']:.2f}", f"{r['speedup']:.2f}x",
                  f"{100 * r['efficiency']:.1f}%"] for r in scaling]))
    print("\nwhere the time goes (step time p50): unwrapped = compute; no_sync - unwrapped = DDP "
          "wrapper; ddp - no_sync = exposed communication")
    rows = []
    for r in breakdown:
        extra = {"ddp_no_sync": f"wrapper {r.get('wrapper_ms', 0):+.2f} ms",
                 "ddp": f"exposed comm {r.get('exposed_comm_ms', 0):+.2f} ms | "
                        f"vs unwrapped {r.get('overhead_pct', 0):+.1f}%"}.get(r["variant"], "")
        rows.append([r["world_size"], r["variant"], f"{r['bucket_cap_mb']:g}" if "bucket_cap_mb" in r else "-",
                     r.get("comm_hook", "-"), f"{r['step_ms_p50']:.2f}", f"{r['step_ms_p90']:.2f}",
                     f"{r['samples_per_s']:.1f}",
                     human_bytes(r["comm_bytes_per_step"]) if "comm_bytes_per_step" in r else "-",
                     f"{r['peak_mem_mib']:.0f}" if "peak_mem_mib" in r else "-", extra])
    print(table(["world", "variant", "bucket MB", "hook", "p50 ms", "p90 ms", "samples/s",
                 "comm/step", "peak MiB", ""], rows))
    kinds = sorted({r["peak_mem_kind"] for r in breakdown if "peak_mem_kind" in r})
    print(f"comm/step: bytes each rank hands to all-reduce in one step | peak MiB: {'; '.join(kinds)}")
    if allreduce:
        print(f"\nall-reduce bandwidth ({machine['backend']}, float32 sum; busbw = algbw x 2(n-1)/n)")
        print(table(["world", "bytes", "time us", "algbw GB/s", "busbw GB/s"],
                    [[r["world_size"], human_bytes(r["bytes"]), f"{r['time_us']:.1f}",
                      f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}"] for r in allreduce]))
    else:
        print("\nall-reduce bandwidth: not measured (needs world size >= 2)")


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024


def check_targets(args, machine, scaling, breakdown):
    """PASS/MISS lines for the lesson's two targets, with the measured numbers."""
    results = []
    w1 = [r for r in breakdown if r["world_size"] == 1]
    ddp1 = next(r for r in w1 if r["variant"] == "ddp")
    unwrapped1 = next(r for r in w1 if r["variant"] == "unwrapped")
    ok = ddp1["overhead_pct"] <= TARGET_DDP_OVERHEAD_PCT
    results.append({"target": f"DDP at world size 1 costs <= {TARGET_DDP_OVERHEAD_PCT:g}% over the "
                              "unwrapped step time (p50)",
                    "measured": f"{ddp1['overhead_pct']:+.1f}% ({unwrapped1['step_ms_p50']:.2f} -> "
                                f"{ddp1['step_ms_p50']:.2f} ms, bucket {ddp1['bucket_cap_mb']:g} MB)",
                    "status": "PASS" if ok else "MISS"})
    name = (f"weak-scaling efficiency 1 -> 2 CPU processes (1 thread each), MNIST CNN "
            f">= {100 * TARGET_WEAK_EFFICIENCY:.0f}%")
    two = [r for r in scaling if r["world_size"] == 2]
    applies = (args.model == "mnist" and not args.strong and machine["device"] == "cpu" and two
               and scaling[0]["threads_per_rank"] == 1 and two[0]["threads_per_rank"] == 1)
    if applies:
        eff = two[0]["efficiency"]
        results.append({"target": name, "measured": f"{100 * eff:.1f}% ({scaling[0]['samples_per_s']:.0f} "
                                                    f"-> {two[0]['samples_per_s']:.0f} samples/s)",
                        "status": "PASS" if eff >= TARGET_WEAK_EFFICIENCY else "MISS"})
    else:
        results.append({"target": name, "status": "NOT MEASURED",
                        "measured": "run on CPU: --model mnist --max-procs 2 --threads 1 (weak scaling)"})
    spread = max(r["step_ms_p90"] / r["step_ms_p50"] for r in breakdown)
    print()
    for r in results:
        print(f"target {r['status']}: {r['target']} | measured {r['measured']}")
    if spread > NOISY_SPREAD:
        print(f"warning: step times are noisy (p90 up to {spread:.2f}x p50): another job shares this "
              "machine, or too few steps; re-run on a quiet machine with more --steps before trusting "
              "the targets")
    return results


def write_plot(path, scaling, breakdown, allreduce):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed, so no plot ({path}); pip install matplotlib for one")
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ns = [r["world_size"] for r in scaling]
    axes[0].plot(ns, [r["samples_per_s"] for r in scaling], "o-", label="measured")
    axes[0].plot(ns, [n * scaling[0]["samples_per_s"] for n in ns], "k--", label="linear")
    axes[0].set(xlabel="world size", ylabel="samples/s (global)", title="throughput", xticks=ns)
    axes[0].legend()
    first = [r for r in breakdown if r["variant"] == "ddp" and r["bucket_cap_mb"] == scaling[0]["bucket_cap_mb"]
             and r["comm_hook"] == scaling[0]["comm_hook"]]
    compute = [r["step_ms_p50"] for r in breakdown if r["variant"] == "unwrapped"]
    wrapper = [max(0, r["wrapper_ms"]) for r in breakdown if r["variant"] == "ddp_no_sync"]
    comm = [max(0, r["exposed_comm_ms"]) for r in first]
    x = [str(n) for n in ns]
    axes[1].bar(x, compute, label="compute (unwrapped)")
    axes[1].bar(x, wrapper, bottom=compute, label="DDP wrapper")
    axes[1].bar(x, comm, bottom=[c + w for c, w in zip(compute, wrapper)], label="exposed comm")
    # noise can make a difference negative (drawn as 0): the marker is the measured DDP step time
    axes[1].plot(x, [r["step_ms_p50"] for r in first], "kx", markersize=10, label="DDP step (measured)")
    axes[1].set(xlabel="world size", ylabel="step time p50, ms", title="where the time goes")
    axes[1].legend(loc="lower right")
    for n in sorted({r["world_size"] for r in allreduce}):
        rows = [r for r in allreduce if r["world_size"] == n]
        axes[2].plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], "o-", label=f"{n} ranks")
    axes[2].set(xscale="log", xlabel="message bytes", ylabel="busbw GB/s", title="all-reduce")
    if allreduce:
        axes[2].legend()
    else:
        axes[2].text(0.5, 0.5, "not measured: needs world size >= 2", ha="center",
                     transform=axes[2].transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return True


# ---------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        fail("ddp_benchmark.py starts its own workers: run it with python, not torchrun or srun")
    t_start = time.perf_counter()
    device, args.backend = pick_device(0, args.backend)
    cores = len(os.sched_getaffinity(0))
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if args.max_procs > gpus:
            fail(f"--max-procs {args.max_procs} but only {gpus} GPU(s) are visible: one process per GPU")
        max_procs = args.max_procs or gpus
    else:
        max_procs = args.max_procs or cores
    sizes = world_sizes(max_procs)
    if args.strong and any(args.batch_size % n for n in sizes):
        fail(f"--strong splits the global batch {args.batch_size} across world sizes {sizes}: "
             "give a --batch-size divisible by each of them")
    machine = describe_machine(device, args.backend, cores)
    print(f"start: model {args.model} | world sizes {','.join(map(str, sizes))} | "
          f"{'strong' if args.strong else 'weak'} scaling | batch {args.batch_size}"
          f"{' global' if args.strong else '/rank'} | warmup {args.warmup} | steps {args.steps} | "
          f"bucket MB {','.join(f'{c:g}' for c in args.bucket_cap_mb)} | "
          f"hooks {','.join(args.comm_hook)} | backend {args.backend} | "
          f"{machine['name']} | torch {machine['torch']}", flush=True)

    points = {}
    for n in sizes:
        threads = threads_per_rank(cores, n, args.threads)
        if device.type == "cpu":
            print(f"point: world {n} | threads/rank {threads} ({cores} cores / {n} ranks"
                  f"{', set by --threads' if args.threads else ''})", flush=True)
            if oversubscribed(n, threads, cores):
                print(f"warning: world size {n} x {threads} thread(s) = {n * threads} threads on "
                      f"{cores} cores: this point OVERSUBSCRIBES the CPU, ranks time-share cores and "
                      "its numbers measure that contention, not DDP", flush=True)
        else:
            print(f"point: world {n} | {n} GPU(s)", flush=True)
        points[n] = run_point(args, n, threads)

    scaling, breakdown, allreduce = build_records(args, machine, points)
    print_tables(args, machine, scaling, breakdown, allreduce)
    targets = check_targets(args, machine, scaling, breakdown)
    if args.json:
        report = {"machine": machine, "config": vars(args), "scaling": scaling,
                  "breakdown": breakdown, "allreduce": allreduce, "targets": targets}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"json: {args.json}")
    if args.plot:
        write_plot(args.plot, scaling, breakdown, allreduce)
    last = scaling[-1]
    print(f"done: model {args.model} | world sizes {','.join(map(str, sizes))} | backend {args.backend} | "
          f"device {device.type} | efficiency {100 * last['efficiency']:.1f}% at world {last['world_size']} | "
          f"time {time.perf_counter() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
