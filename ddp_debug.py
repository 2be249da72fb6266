"""Lesson 8: when DDP hangs or crashes. Break a small DDP job on purpose, find the rank and the
line, fix it.

    torchrun --standalone --nproc_per_node=2 ddp_debug.py                      # runs clean
    torchrun --standalone --nproc_per_node=2 ddp_debug.py --fault uneven       # hangs, times out
    torchrun --standalone --nproc_per_node=2 ddp_debug.py --fault uneven --fix join

Each fault is a few lines of an otherwise ordinary training loop, marked `# FAULT`; the lines
that fix it are marked `# FIX`. The collective timeout is short (--timeout 10 s), so a job that
hangs ends within seconds instead of after the other lessons' 10 minutes. The tools that point at
the culprit (py-spy, monitored_barrier, TORCH_DISTRIBUTED_DEBUG, @record and torchrun's logs) are
shown in the README, lesson 8, and in docs/debug.md.
"""

import datetime
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import Parser, cleanup, fail, positive_int, print0, setup

FAULTS = ["none", "mismatch", "uneven", "crash", "straggler", "unused"]
# The fixes each fault has (--fix NAME).
FIXES = {
    "mismatch": ["every-rank"],
    "uneven": ["join", "sampler"],
    "unused": ["find-unused", "model"],
}


def parse_args(argv=None):
    parser = Parser(
        description="Lesson 8: break a small DDP job the way real jobs break, diagnose, fix. "
        "Launch with: torchrun --standalone --nproc_per_node=2 ddp_debug.py --fault FAULT"
    )
    parser.add_argument(
        "--fault",
        choices=FAULTS,
        default="none",
        help="mismatch: only rank 0 calls an all-reduce; uneven: one rank has fewer batches; "
        "crash: one rank raises on a bad sample; straggler: one rank stalls loading data; "
        "unused: a parameter gets no gradient on some steps (default: none, runs clean)",
    )
    parser.add_argument(
        "--fix",
        choices=["none", *sorted({name for names in FIXES.values() for name in names})],
        default="none",
        help="run the fixed code: mismatch: every-rank; uneven: join or sampler; "
        "unused: find-unused or model",
    )
    parser.add_argument(
        "--bad-rank",
        type=int,
        default=-1,
        help="the rank that misbehaves in uneven, crash, straggler (default -1: the last rank)",
    )
    parser.add_argument(
        "--fault-step", type=int, default=3, help="the step at which it does (default 3)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10,
        help="seconds a collective waits for the other ranks before it fails (default 10)",
    )
    parser.add_argument(
        "--monitored-barrier",
        action="store_true",
        help="a dist.monitored_barrier before every step: rank 0 names a rank that never arrives",
    )
    parser.add_argument("--max-steps", type=positive_int, default=8, help="steps/rank (default 8)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=4, help="samples per step PER RANK (default 4)"
    )
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and data")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)",
    )
    parser.add_argument(
        "--log-every", type=positive_int, default=2, help="steps between log lines (default 2)"
    )
    args = parser.parse_args(argv)
    # Every rank parses: rank 0 alone says what is wrong.
    if args.fix != "none" and args.fix not in FIXES.get(args.fault, []):
        fail(f"--fix {args.fix} does not fix --fault {args.fault}: fixes: {FIXES}", 2, True)
    if not 0 <= args.fault_step < args.max_steps:
        fail("--fault-step must be in 0 .. --max-steps - 1", 2, True)
    if not 0 < args.timeout < float("inf"):
        fail("--timeout must be a number of seconds > 0", 2, True)
    return args


class Net(nn.Module):
    """A small regression MLP with an auxiliary head (the kind of second loss a real model has)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 1)

    def forward(self, x, use_aux=True):
        hidden = self.body(x)
        if not use_aux:
            return self.head(hidden), None
        return self.head(hidden), self.aux(hidden)


def shard(args, rank, world_size):
    """This rank's samples, as if read from its own shard file. --fault uneven: the bad rank's
    file is short (the last file of a dataset split into files often is)."""
    steps = args.max_steps
    if args.fault == "uneven" and rank == args.bad_rank:
        steps = args.fault_step
    generator = torch.Generator().manual_seed(args.seed + 1000 + rank)
    x = torch.randn(steps * args.batch_size, 8, generator=generator)
    y = x[:, :4].sum(1, keepdim=True)
    return TensorDataset(x, y)


def make_loader(args, ddp):
    if args.fix == "sampler":
        # FIX (uneven): one dataset of all shards, split by DistributedSampler, which pads the
        # ranks' parts to equal length with repeated samples: every rank gets as many batches.
        shards = [shard(args, r, ddp.world_size) for r in range(ddp.world_size)]
        data = TensorDataset(
            *[torch.cat(t) for t in zip(*[s.tensors for s in shards], strict=True)]
        )
        sampler = DistributedSampler(data, ddp.world_size, ddp.rank, shuffle=False)
        return DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    return DataLoader(shard(args, ddp.rank, ddp.world_size), batch_size=args.batch_size)


def load(batch, step, args, ddp):
    """Where a real job reads and decodes its samples."""
    x, y = batch
    if args.fault == "crash" and ddp.rank == args.bad_rank and step == args.fault_step:
        # FAULT: a corrupt sample raises on one rank, mid-epoch.
        raise ValueError(f"bad sample in batch {step}: cannot decode")
    if args.fault == "straggler" and ddp.rank == args.bad_rank and step == args.fault_step:
        # FAULT: one rank's read stalls (a slow disk, a stuck network file system).
        time.sleep(100 * args.timeout)
    return x.to(ddp.device), y.to(ddp.device)


def loss_of(model, x, y, step, args):
    use_aux = True
    if args.fault == "unused" and args.fix != "model":
        # FAULT: the auxiliary loss only on even steps: on odd ones `aux` gets no gradient.
        use_aux = step % 2 == 0
    out, aux_out = model(x, use_aux=use_aux)
    loss = F.mse_loss(out, y)
    if aux_out is not None:
        aux_weight = 0.1
        if args.fix == "model" and step % 2 == 1:
            # FIX (unused): every parameter takes part in every step; weight 0 off its schedule.
            aux_weight = 0.0
        loss = loss + aux_weight * F.mse_loss(aux_out, y)
    return loss


def log(loss, step, args, ddp):
    """The mean loss over all ranks, printed by rank 0."""
    mean = loss.detach().clone()
    if args.fix == "join":
        # Join answers DDP's own all-reduces for a rank that is done, not this one: under Join
        # an all-reduce of our own in the loop would hang. Rank 0 prints its own loss instead.
        print0(f"step {step + 1}/{args.max_steps} | loss {mean.item():.4f}")
        return
    if args.fault == "mismatch" and args.fix == "none":
        # FAULT: "only rank 0 prints, so only rank 0 needs the mean": the all-reduce moves
        # under the `if`. Rank 0's all-reduce then meets the others' next gradient all-reduce:
        # gloo sees the sizes differ and aborts; NCCL may hang, or mix the two.
        if ddp.rank == 0:
            dist.all_reduce(mean)
            print0(f"step {step + 1}/{args.max_steps} | loss {mean.item() / ddp.world_size:.4f}")
        return
    # FIX (mismatch): every rank joins every collective; only the printing is rank 0's.
    # DDP: a collective: every rank must call it, in the same order
    dist.all_reduce(mean)
    print0(f"step {step + 1}/{args.max_steps} | loss {mean.item() / ddp.world_size:.4f}")


def train(args, ddp):
    """The loop every lesson has, with the faults in it. Returns the bare model."""
    torch.manual_seed(args.seed)
    model = Net().to(ddp.device)
    device_ids = [ddp.device.index] if ddp.device.type == "cuda" else None
    # FIX (unused): find_unused_parameters=True: after each forward DDP walks the autograd graph
    # and marks the parameters it will not reach as ready (costs a traversal per step).
    find_unused = args.fix == "find-unused"
    model = DDP(model, device_ids=device_ids, find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    join = nullcontext()
    if args.fix == "join":
        # FIX (uneven): a rank that runs out of batches keeps answering the others' all-reduces
        # with zeros until every rank is done (the mean still divides by the world size).
        join = Join([model])
    if args.monitored_barrier:
        # DIAGNOSIS: monitored_barrier needs a CPU backend: beside NCCL, a gloo group of its own.
        monitor = dist.new_group(backend="gloo")
    with join:
        for step, batch in enumerate(make_loader(args, ddp)):
            x, y = load(batch, step, args, ddp)
            if args.monitored_barrier:
                # DIAGNOSIS: every rank checks in; rank 0 names any that does not within --timeout.
                timeout = datetime.timedelta(seconds=args.timeout)
                dist.monitored_barrier(monitor, timeout=timeout, wait_all_ranks=True)
            loss = loss_of(model, x, y, step, args)
            optimizer.zero_grad()
            # DDP: all-reduces the gradients: every rank must get here
            loss.backward()
            optimizer.step()
            if (step + 1) % args.log_every == 0:
                log(loss, step, args, ddp)
    # DDP: the end of the epoch, where ranks wait for each other (before saving or evaluating).
    dist.barrier()
    return model.module


@record
def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    ddp = setup(args.backend, timeout_s=args.timeout)
    args.bad_rank += ddp.world_size if args.bad_rank < 0 else 0
    if not 0 <= args.bad_rank < ddp.world_size:
        fail(f"--bad-rank must be in 0 .. {ddp.world_size - 1}", rank0_only=True)
    if ddp.world_size == 1 and args.fault in ("mismatch", "uneven", "straggler"):
        # One rank waits for no one: no mismatch, no hang, a straggler that sleeps 100 x --timeout.
        fail(f"--fault {args.fault} needs 2 or more ranks: start it with --nproc_per_node=2")
    print0(
        f"start: fault {args.fault} | fix {args.fix} | world {ddp.world_size} | backend "
        f"{ddp.backend} | device {ddp.device.type} | timeout {args.timeout:g}s"
    )
    model = train(args, ddp)
    checksum = sum(p.double().sum() for p in model.parameters())
    print0(
        f"done: fault {args.fault} | fix {args.fix} | world {ddp.world_size} | backend "
        f"{ddp.backend} | weights {checksum.item():.6f} | time {time.perf_counter() - start:.1f}s"
    )
    cleanup()


if __name__ == "__main__":
    main()
