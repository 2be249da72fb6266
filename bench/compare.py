"""Are the lessons as fast as what users would run instead? Both, side by side, on THIS machine.

    python bench/compare.py     # fetches nanoGPT (git), installs Lightning (pip), prints the table

- lesson 5 (gpt2_ddp.py) against karpathy/nanoGPT's train.py on the same work: GPT-2 with biases,
  4 layers x 128 wide, 4 heads, context 128, batch 8 per rank, the GPT-2 vocabulary padded to
  50,304, AdamW (nanoGPT also clips at 1.0); fp32 on a CPU, bf16 on a GPU; 1 and 2 processes
  (--gpt-preset 124m: GPT-2 124M).
- lesson 2 (ddp_training.py) against the same job written with Lightning
  (bench/lightning_cifar.py): ResNet-18 with the CIFAR stem, crop + flip, SGD, warm-up + cosine,
  2 ranks x 32 (synthetic images).
- the DDP wrapper at world size 1 against the bare model, on lesson 2's step (in this process).
Runs alternate (ours, theirs, theirs, ours, ...) so a machine that gets busier slows both alike;
each program's own steady-state rate (steps after the first --warmup) is kept, the table shows
medians.
"""

import os
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ddp_common import Parser, fail, free_port, positive_int  # noqa: E402

NANOGPT_URL, NANOGPT_COMMIT = (
    "https://github.com/karpathy/nanoGPT",
    "3adf61e154c3fe3fca428ad6bc3818b27a3b8291",
)
LIGHTNING = "lightning==2.6.6"
GPT_PRESETS = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
}
PEAK_BF16_TFLOPS = {
    "H100": 989,
    "H200": 989,
    "B200": 2250,
    "A100": 312,
    "L40S": 362,
    "L4": 121,
}  # dense, data sheets
# nanoGPT's train.py assumes CUDA under DDP; on a CPU these three lines must allow gloo and the CPU.
NANOGPT_CPU_PATCH = [
    (
        "    device = f'cuda:{ddp_local_rank}'\n",
        "    device = f'cuda:{ddp_local_rank}' if device.startswith('cuda') else device\n",
    ),
    (
        "    torch.cuda.set_device(device)\n",
        "    if device.startswith('cuda'): torch.cuda.set_device(device)\n",
    ),
    (
        "DDP(model, device_ids=[ddp_local_rank])",
        "DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)",
    ),
]


def parse_args():
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=positive_int, default=3, help="A/B pairs per comparison")
    parser.add_argument(
        "--procs", type=positive_int, nargs="+", default=[1, 2], help="world sizes, GPT pair"
    )
    parser.add_argument("--gpt-preset", default="tiny", choices=list(GPT_PRESETS))
    parser.add_argument("--gpt-steps", type=positive_int, default=40, help="steps per GPT run")
    parser.add_argument("--cifar-procs", type=positive_int, default=2, help="world size, CIFAR")
    parser.add_argument("--cifar-steps", type=positive_int, default=40, help="steps per CIFAR run")
    parser.add_argument(
        "--ddp1-steps", type=positive_int, default=30, help="timed steps, the world-size-1 check"
    )
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of a rate")
    parser.add_argument("--only", choices=["gpt", "cifar", "ddp1"], help="run one comparison")
    parser.add_argument("--nanogpt", metavar="DIR", help="a nanoGPT checkout (default: clone it)")
    parser.add_argument(
        "--work", default=os.path.join(ROOT, "bench", ".work"), help="scratch: clone, data, runs"
    )
    args = parser.parse_args()
    # Each run needs at least one timed step after its warm-up steps.
    if not 0 <= args.warmup < min(args.gpt_steps, args.cifar_steps):
        parser.error("--warmup must be 0 or more, and less than --gpt-steps and --cifar-steps")
    return args


def cpu_count():
    """Cores this process may use: its affinity (Slurm, taskset) on Linux; all of them elsewhere."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine():
    """One line naming what ran: CPU model and cores, or the GPU; torch."""
    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in open("/proc/cpuinfo")
                if line.startswith("model name")
            ),
            cpu,
        )
    what = f"{cpu} ({cpu_count()} cores)"
    if torch.cuda.is_available():
        what = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, {what}"
    return f"{what} | torch {torch.__version__} | {platform.system()} {platform.release()}"


def run(cmd, cwd=ROOT, env=None, timeout=1800):
    """Run a benchmark program; its output, or one error line with its last lines."""
    t = time.perf_counter()
    r = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode:
        tail = " / ".join((r.stdout + r.stderr).strip().splitlines()[-3:])
        fail(f"{' '.join(map(str, cmd[:4]))}... exited {r.returncode}: {tail[-500:]}", 1)
    # The program: the first .py on the command line (after python, torchrun's flags).
    program = next(os.path.basename(str(c)) for c in cmd if str(c).endswith(".py"))
    print(f"  ran {program} in {time.perf_counter() - t:.0f}s", flush=True)
    return r.stdout + r.stderr


def flops_per_token(preset):
    """nanoGPT's count, for MFU: 6 per non-embedding parameter (the tied wte counts, wpe does
    not), plus attention."""
    from gpt2_model import GPT, GPTConfig

    cfg = GPTConfig(**GPT_PRESETS[preset], vocab_size=50257)
    n = sum(p.numel() for p in GPT(cfg).parameters()) - cfg.block_size * cfg.n_embd
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def mfu(tokens_per_s, procs, preset):
    """Model FLOPs utilisation against one GPU's dense bf16 peak; None off the table or on a CPU."""
    if not torch.cuda.is_available():
        return None
    peak = next(
        (t for gpu, t in PEAK_BF16_TFLOPS.items() if gpu in torch.cuda.get_device_name(0)), None
    )
    return peak and flops_per_token(preset) * tokens_per_s / procs / (peak * 1e12)


def interval_rate(out, unit, warmup):
    """Ours: log lines `step S/T | ... | R unit` after step `warmup`; equal intervals: harmonic
    mean."""
    rates = [
        float(m[2])
        for m in re.finditer(rf"step (\d+)/\d+ \|.*? (\d+(?:\.\d+)?) {unit}", out)
        if int(m[1]) > warmup
    ]
    if not rates:
        fail(f"no `{unit}` log lines after step {warmup}: raise --*-steps", 1)
    return len(rates) / sum(1 / r for r in rates)


def get_nanogpt(args):
    """A nanoGPT checkout at the pinned commit (cloned once), plus train_cpu.py: its train.py,
    patched for CPUs."""
    path = args.nanogpt or os.path.join(args.work, "nanoGPT")
    if not os.path.isfile(os.path.join(path, "train.py")):
        if args.nanogpt:
            fail(f"--nanogpt {path}: no train.py there")
        print(f"fetching {NANOGPT_URL} at {NANOGPT_COMMIT[:8]} into {path}", flush=True)
        try:
            subprocess.run(["git", "clone", "-q", NANOGPT_URL, path], check=True, timeout=300)
            subprocess.run(["git", "-C", path, "checkout", "-q", NANOGPT_COMMIT], check=True)
        except (OSError, subprocess.SubprocessError) as e:
            fail(
                f"cannot fetch nanoGPT ({type(e).__name__}): clone {NANOGPT_URL} yourself and "
                "pass --nanogpt DIR",
                1,
            )
    src = open(os.path.join(path, "train.py")).read()
    for old, new in NANOGPT_CPU_PATCH:
        if src.count(old) != 1:
            fail(
                f"{path}/train.py is not the nanoGPT this expects (commit {NANOGPT_COMMIT[:8]}): "
                f"`{old.strip()}`",
                1,
            )
        src = src.replace(old, new)
    open(os.path.join(path, "train_cpu.py"), "w").write(src)
    return path


def gpt_text(args, nanogpt):
    """The course's own text, tokenized with GPT-2's BPE: a text file for ours, .bin files for
    nanoGPT."""
    from gpt2_model import load_tokenizer

    text = "\n".join(
        open(os.path.join(d, f), encoding="utf-8").read()
        for d in (ROOT, os.path.join(ROOT, "docs"))
        for f in sorted(os.listdir(d))
        if f.endswith((".md", ".py"))
    )
    path = os.path.join(args.work, "course.txt")
    os.makedirs(args.work, exist_ok=True)
    open(path, "w", encoding="utf-8").write(text)
    tokens = np.array(load_tokenizer("gpt2").encode_ordinary(text), dtype=np.uint16)
    data = os.path.join(nanogpt, "data", "ddpcourse")
    os.makedirs(data, exist_ok=True)
    tokens[: len(tokens) * 9 // 10].tofile(os.path.join(data, "train.bin"))
    tokens[len(tokens) * 9 // 10 :].tofile(os.path.join(data, "val.bin"))
    return path


def gpt2_ddp_command(args, n, text, cuda):
    """Lesson 5 on the GPT-2 preset, 8 windows per rank, --gpt-steps steps, n processes."""
    cfg = GPT_PRESETS[args.gpt_preset]
    flags = {
        "--nproc": n,
        "--text": text,
        "--preset": args.gpt_preset,
        "--max-length": cfg["block_size"],
        "--batch-size": 8,
        "--max-steps": args.gpt_steps,
        "--log-every": 5,
        "--epochs": 1000,
        "--checkpoint-dir": os.path.join(args.work, "ck5"),
    }
    compile_ = ["--compile"] if cuda else []
    return [sys.executable, "gpt2_ddp.py", *(x for f in flags.items() for x in f), *compile_]


def nanogpt_command(args, n, cuda):
    """nanoGPT's train.py (CPU-patched) on the same work; DDP under torchrun only."""
    launch = [sys.executable]
    if n > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    steps = args.gpt_steps
    return launch + [
        "train_cpu.py",
        "--dataset=ddpcourse",
        f"--out_dir={os.path.join(args.work, 'nanogpt-out')}",
        *(f"--{k}={v}" for k, v in GPT_PRESETS[args.gpt_preset].items()),
        "--batch_size=8",
        # nanoGPT divides its accumulation steps by the world size: 8 windows per rank.
        f"--gradient_accumulation_steps={n}",
        "--bias=True",
        "--dropout=0.0",
        "--learning_rate=6e-4",
        "--min_lr=6e-5",
        "--weight_decay=0.1",
        "--beta2=0.95",
        "--grad_clip=1.0",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--warmup_iters=10",
        "--eval_interval=1000000",
        "--eval_iters=1",
        "--log_interval=1",
        "--always_save_checkpoint=False",
        f"--device={'cuda' if cuda else 'cpu'}",
        f"--dtype={'bfloat16' if cuda else 'float32'}",
        f"--compile={cuda}",
        f"--backend={'nccl' if cuda else 'gloo'}",
    ]


def nanogpt_rate(out, warmup):
    """nanoGPT's tokens/s: tokens per iteration over its per-iteration times after `warmup`."""
    per_iter = int(re.search(r"tokens per iteration will be: ([\d,]+)", out)[1].replace(",", ""))
    dts = [
        float(m[2])
        for m in re.finditer(r"iter (\d+): loss \S+, time ([\d.]+)ms", out)
        if int(m[1]) > warmup
    ]
    return per_iter * len(dts) / (sum(dts) / 1000)


def gpt_pair(args, n, text, nanogpt, cuda):
    """One run of each: lesson 5 and nanoGPT on the same model, batch, steps and world size."""
    env = {"OMP_NUM_THREADS": str(max(1, cpu_count() // n)), "MASTER_PORT": str(free_port())}
    ours = gpt2_ddp_command(args, n, text, cuda)
    theirs = nanogpt_command(args, n, cuda)
    return (
        lambda: interval_rate(run(ours, env=env), "tokens/s", args.warmup),
        lambda: nanogpt_rate(run(theirs, cwd=nanogpt, env=env), args.warmup),
    )


def cifar_pair(args, cuda):
    """One run of each: lesson 2's default job and the same job in Lightning (2 ranks x 32)."""
    common = ["--batch-size", 32, "--max-steps", args.cifar_steps]
    ours = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.cifar_procs}",
        "ddp_training.py",
        "--data",
        "synthetic",
        "--subset",
        2000,
        "--log-every",
        5,
        "--checkpoint-dir",
        os.path.join(args.work, "ck2"),
        *common,
    ]
    theirs = [
        sys.executable,
        os.path.join("bench", "lightning_cifar.py"),
        "--devices",
        args.cifar_procs,
        "--subset",
        2000,
        "--warmup-steps",
        args.warmup,
        *common,
    ]

    def lightning_rate(out):
        return float(re.search(r"\| ([\d.]+) samples/s", out)[1])

    return (
        lambda: interval_rate(run(ours), "samples/s", args.warmup),
        lambda: lightning_rate(run(theirs)),
    )


def ddp1(args):
    """Lesson 2's ResNet-18 step (batch 32), bare and in DDP at world size 1, alternating: p50 ms
    of each."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from training_data import build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    torch.manual_seed(0)
    bare = build_model("resnet18").to(device, memory_format=torch.channels_last)
    wrapped = DDP(
        build_model("resnet18").to(device, memory_format=torch.channels_last),
        device_ids=[0] if device.type == "cuda" else None,
    )
    x = torch.randn(32, 3, 32, 32, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (32,), device=device)
    steps_of = {}
    for model in (bare, wrapped):
        opt = torch.optim.SGD(
            model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, fused=True
        )

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        steps_of[model] = step
    times = {bare: [], wrapped: []}
    for i in range(args.warmup + args.ddp1_steps):
        for model in (bare, wrapped) if i % 2 else (wrapped, bare):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            steps_of[model]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times[model].append(time.perf_counter() - t)
    dist.destroy_process_group()
    return 1000 * statistics.median(times[bare]), 1000 * statistics.median(times[wrapped])


def alternate(pair, pairs):
    """Run ours and theirs `pairs` times each, alternating which goes first; lists of rates."""
    ours, theirs = [], []
    for i in range(pairs):
        for who in ("ours", "theirs") if i % 2 == 0 else ("theirs", "ours"):
            (ours if who == "ours" else theirs).append(pair[who == "theirs"]())
    return ours, theirs


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    print(f"machine: {machine()}", flush=True)
    rows = []
    if args.only in (None, "gpt"):
        nanogpt = get_nanogpt(args)
        text = gpt_text(args, nanogpt)
        for n in args.procs:
            print(f"gpt2_ddp.py vs nanoGPT, {n} process(es):", flush=True)
            ours, theirs = alternate(gpt_pair(args, n, text, nanogpt, cuda), args.pairs)
            rows.append((f"GPT-2 {args.gpt_preset}, {n} proc", "nanoGPT", "tokens/s", ours, theirs))
            ours_mfu = mfu(statistics.median(ours), n, args.gpt_preset)
            if ours_mfu is not None:
                theirs_mfu = mfu(statistics.median(theirs), n, args.gpt_preset)
                print(f"mfu: ours {ours_mfu:.1%} | nanoGPT {theirs_mfu:.1%}")
    if args.only in (None, "cifar"):
        try:
            import lightning  # noqa: F401
        except ImportError:
            print(f"installing {LIGHTNING} into this Python ({sys.executable})", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", LIGHTNING], check=True)
        print(f"ddp_training.py vs Lightning, {args.cifar_procs} processes:", flush=True)
        ours, theirs = alternate(cifar_pair(args, cuda), args.pairs)
        rows.append(
            (f"ResNet-18 CIFAR, {args.cifar_procs} x 32", "Lightning", "samples/s", ours, theirs)
        )
    print(f"\nmachine: {machine()}")
    print(
        f"{'job':<24}{'ours':>10}{'theirs':>10}  {'unit':<10}{'ours/theirs':>12}  "
        f"{'per pair':<20}  vs"
    )
    for job, other, unit, ours, theirs in rows:
        ratios = " ".join(f"{o / t:.2f}" for o, t in zip(ours, theirs, strict=True))
        print(
            f"{job:<24}{statistics.median(ours):>10.0f}{statistics.median(theirs):>10.0f}  "
            f"{unit:<10}"
            f"{statistics.median(ours) / statistics.median(theirs):>11.2f}x  {ratios:<20}  {other}"
        )
    if args.only in (None, "ddp1"):
        bare_ms, ddp_ms = ddp1(args)
        print(
            f"DDP at world size 1, lesson 2's ResNet-18 step: bare {bare_ms:.1f} ms | "
            f"DDP {ddp_ms:.1f} ms | "
            f"overhead {100 * (ddp_ms / bare_ms - 1):+.1f}%"
        )


if __name__ == "__main__":
    main()
