"""Lesson 4: DDP across several machines (nodes).

Across nodes every process has a GLOBAL rank (0 .. world_size-1, unique in the whole job) and a
LOCAL rank (0 .. processes-per-node-1, unique on its node). The local rank picks the GPU; the
global rank picks the data shard and decides who prints and saves. This script prints a table of
every rank (host, node rank, global rank, local rank, device) gathered on rank 0, then trains a
small classifier on generated data with snapshots, resuming from the last one like lesson 3.

Three ways to start it on 2 nodes with 4 GPUs each (world size 8):

  # 1. torchrun on each node, c10d rendezvous: the same command everywhere, node ranks handed
  #    out; with restarts, give torchrun a fresh store per attempt (see docs/multinode.md)
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d \
      --rdzv-endpoint=HOST0:29400 --rdzv-id=run1 --max-restarts=1 multinode.py --resume auto
  # 2. torchrun on each node, static rendezvous: you number the nodes yourself
  torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 --master_addr=HOST0 --master_port=29500 multinode.py
  torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=HOST0 --master_port=29500 multinode.py
  # 3. Slurm: sbatch slurm/train.sbatch multinode.py (one torchrun per node), or
  #    sbatch slurm/train_srun.sbatch multinode.py (one srun task per GPU, no torchrun)
  # launch_ddp.sh wraps all of these: ./launch_ddp.sh --help

Shared-filesystem assumption: by default global rank 0 alone writes the snapshot to
--checkpoint-dir, and on resume EVERY rank reads it from there, so that directory must be on a
filesystem all nodes see (NFS, Lustre, GPFS...). If each node only has its own local disk, pass
--snapshot-per-node: local rank 0 of every node writes its own copy. Either way every rank checks
that all ranks resume from the same epoch, and stops with an error if not.
The DDP-specific lines are marked `# DDP:`.
"""

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cleanup, fail, load_checkpoint, print0, save_checkpoint, set_seed, setup

SNAPSHOT = "multinode.pt"
FEATURES, CLASSES = 32, 8


def parse_args():
    p = argparse.ArgumentParser(
        description="Lesson 4: DDP across nodes; rank table, training with "
        "snapshots. Launch with torchrun --nnodes=N, srun, or launch_ddp.sh"
    )
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set (default 5)")
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many optimizer steps in this run (0 = no cap); quick checks",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="samples per step PER RANK; the global batch is this x world size (default 64)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed for init, data order and generated data"
    )
    p.add_argument(
        "--samples",
        type=int,
        default=32768,
        help="size of the generated training set (default 32768; test set is 1/4 of it)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default="./checkpoints",
        help=f"where {SNAPSHOT} is saved after every epoch. Must be on a filesystem shared "
        "by all nodes, unless --snapshot-per-node (default ./checkpoints)",
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="PATH|auto",
        help=f"auto: continue from CHECKPOINT_DIR/{SNAPSHOT} if it exists (what a "
        "restarted torchrun worker needs); or a snapshot PATH (default: start fresh)",
    )
    p.add_argument(
        "--snapshot-per-node",
        action="store_true",
        help="local rank 0 of EVERY node writes the snapshot (for node-local disks, "
        "e.g. --checkpoint-dir /tmp/ckpt); default: global rank 0 only",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)",
    )
    p.add_argument("--log-every", type=int, default=50, help="steps between log lines (default 50)")
    p.add_argument(
        "--report",
        default=None,
        metavar="PATH",
        help="rank 0 writes a JSON file with the rank table and every rank's parameter "
        "checksum at the end (used by the tests; handy to compare runs)",
    )
    p.add_argument(
        "--crash-rank",
        type=int,
        default=None,
        metavar="R",
        help="testing failure handling: global rank R dies (SIGKILL) like a crashed "
        "process; the launcher must then stop or restart the whole job",
    )
    p.add_argument(
        "--crash-at",
        default="1",
        metavar="start|STEP",
        help="with --crash-rank: die at start-up, before joining the process group (the "
        "others then wait for it until the timeout unless the launcher kills them), "
        "or after optimizer step STEP (default 1) of a run that did not resume, so "
        "a restarted run that resumes goes on",
    )
    args = p.parse_args()
    for name in ("epochs", "batch_size", "log_every", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_steps < 0 or args.lr <= 0:
        p.error("--max-steps must be >= 0 and --lr > 0")
    if args.crash_rank is not None and args.crash_rank < 0:
        p.error("--crash-rank must be a rank >= 0")
    if args.crash_at != "start" and not (args.crash_at.isdigit() and int(args.crash_at) > 0):
        p.error("--crash-at must be start or a step number >= 1")
    return args


def make_data(seed, n_train):
    """A learnable task made from the seed alone, identical on every rank and node (no files to
    share): 8 classes, the label is the argmax of a fixed random linear map of 32 features."""
    g = torch.Generator().manual_seed(seed + 4321)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)

    def make(n):
        x = torch.randn(n, FEATURES, generator=g)
        return TensorDataset(x, (x @ teacher).argmax(1))

    return make(n_train), make(max(1, n_train // 4))


def make_model():
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
    )


def params_sha256(state_dict):
    """Checksum of a model's weights: equal on two ranks <=> bit-identical replicas."""
    h = hashlib.sha256()
    for t in state_dict.values():
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_table(ddp):
    """Every rank reports where it runs; rank 0 gets the list of all of them."""
    me = {
        "rank": ddp.rank,
        "node": ddp.node_rank,
        "local_rank": ddp.local_rank,
        "host": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME", "-"),
        "device": str(ddp.device),
        "pid": os.getpid(),
    }
    table = [None] * ddp.world_size
    dist.all_gather_object(table, me)  # DDP: any picklable object, gathered from every rank
    return table


def print_table(table, ddp):
    cols = list(table[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in table)) for c in cols}
    print0(
        f"ranks: world {ddp.world_size} | nodes {len({r['node'] for r in table})} | "
        f"launcher {ddp.launcher}"
    )
    print0("  " + "  ".join(c.ljust(width[c]) for c in cols).rstrip())
    for r in table:
        print0("  " + "  ".join(str(r[c]).ljust(width[c]) for c in cols).rstrip())
    seen = {}
    for (
        r
    ) in table:  # two ranks on one GPU: usually a wrong --nproc_per_node or CUDA_VISIBLE_DEVICES
        key = (r["host"], r["slurm_node"], r["device"])
        if r["device"].startswith("cuda") and key in seen:
            print0(f"warning: ranks {seen[key]} and {r['rank']} share {r['device']} on {r['host']}")
        seen.setdefault(key, r["rank"])


def snapshot_path(args):
    return (
        os.path.join(args.checkpoint_dir, SNAPSHOT)
        if args.resume in (None, "auto")
        else args.resume
    )


def resume(args, ddp, model, optimizer):
    """Load the snapshot if there is one, and make sure every rank resumes from the same epoch.
    Without a shared filesystem (and without --snapshot-per-node) rank 0's node finds the file and
    the others do not: training would silently restart from epoch 0 on some ranks."""
    path, epoch = snapshot_path(args), 0
    if args.resume and (os.path.isfile(path) or args.resume != "auto"):
        # To the CPU; load_state_dict copies each tensor to its parameter's device.
        epoch = load_checkpoint(path, model=model, optimizer=optimizer)["epoch"]
    found = [None] * ddp.world_size
    dist.all_gather_object(found, (epoch, socket.gethostname(), ddp.node_rank))  # DDP: compare
    if len({e for e, _, _ in found}) > 1:
        cleanup()
        detail = "; ".join(
            f"rank {r} (node {n}, {h}): epoch {e}" for r, (e, h, n) in enumerate(found)
        )
        if ddp.is_main:
            fail(
                f"ranks would resume from different epochs ({detail}) from {path}. Without "
                "--snapshot-per-node the checkpoint dir must be on a filesystem shared by all nodes; "
                "with it, every node needs its own copy. Copy one snapshot to every node, or delete "
                "them to start fresh",
                code=1,
            )
        sys.exit(1)
    return epoch


@torch.no_grad()
def evaluate(model, test_set, ddp, batch_size):
    """Exact accuracy over the test set: rank r takes samples r, r+W, ...; counts are summed.
    `model` is the bare model.module: a forward through the DDP wrapper would join DDP's
    collectives, and ranks whose shards differ by a batch would then wait for each other."""
    model.eval()
    shard = Subset(test_set, range(ddp.rank, len(test_set), ddp.world_size))
    sums = torch.zeros(2, device=ddp.device)  # loss sum, correct: summed on the device, no sync
    for x, y in DataLoader(shard, batch_size=4 * batch_size):
        x, y = x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True)
        logits = model(x)
        sums += torch.stack(
            [F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum()]
        )
    totals = torch.cat([sums, torch.tensor([float(len(shard))], device=ddp.device)])
    dist.all_reduce(totals)  # DDP: sum the shards' counts
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


def write_report(args, ddp, table, model, start_epoch, epoch, val_acc):
    shas = [None] * ddp.world_size
    dist.all_gather_object(shas, params_sha256(model.module.state_dict()))  # DDP: every replica
    if ddp.is_main and args.report:
        report = {
            "world_size": ddp.world_size,
            "nodes": len({r["node"] for r in table}),
            "launcher": ddp.launcher,
            "backend": ddp.backend,
            "ranks": table,
            "params_sha256": shas,
            "start_epoch": start_epoch,
            "epoch": epoch,
            "val_acc": val_acc,
        }
        tmp = f"{args.report}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.report)
    return len(set(shas)) == 1


def crash(rank):
    """--crash-rank: die with no cleanup at all, like a segfault or an OOM kill."""
    print(f"error: rank {rank} crashed on purpose (--crash-rank)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def train_epoch(args, ddp, model, optimizer, loader, epoch, step, resumed):
    """One pass over this rank's shard; returns the step count. Logs every --log-every steps."""
    loss_sum, n, t_log = torch.zeros((), device=ddp.device), 0, time.perf_counter()
    for x, y in loader:
        x, y = x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP: gradients all-reduced across ALL nodes' ranks here
        optimizer.step()
        loss_sum, n, step = loss_sum + loss.detach(), n + 1, step + 1
        if args.crash_rank == ddp.rank and args.crash_at == str(step) and not resumed:
            crash(ddp.rank)
        if step % args.log_every == 0:
            now = time.perf_counter()  # .item() waits for the GPU: once per log line only
            print0(
                f"epoch {epoch + 1}/{args.epochs} | step {step} | loss {loss_sum.item() / n:.4f} | "
                f"{n * args.batch_size * ddp.world_size / (now - t_log):.0f} samples/s"
            )
            loss_sum, n, t_log = torch.zeros((), device=ddp.device), 0, now
        if step == args.max_steps:
            break
    return step


def main():
    args = parse_args()
    if args.crash_at == "start" and args.crash_rank == int(os.environ.get("RANK", -1)):
        crash(args.crash_rank)  # the rank as the launcher set it
    ddp = setup(args.backend)  # DDP: join the group (torchrun, or srun tasks: RANK... from env)
    if args.crash_rank is not None and args.crash_rank >= ddp.world_size:
        cleanup()
        fail(f"--crash-rank {args.crash_rank} is not a rank: the world size is {ddp.world_size}")
    table = rank_table(ddp)
    print_table(table, ddp)

    set_seed(args.seed)  # same seed everywhere -> same initial weights (DDP also broadcasts them)
    train_set, test_set = make_data(args.seed, args.samples)
    on_gpu = ddp.device.type == "cuda"
    # DDP: the GLOBAL rank picks the shard: ranks on different nodes must not share data.
    sampler = DistributedSampler(
        train_set, num_replicas=ddp.world_size, rank=ddp.rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=on_gpu)
    model = make_model().to(ddp.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=on_gpu)
    start_epoch = resume(args, ddp, model, optimizer)  # before the DDP wrap: bare model keys
    # DDP: the LOCAL rank picks the GPU (device_ids); global rank 5 on node 1 is cuda:1, not cuda:5.
    model = DDP(model, device_ids=[ddp.device.index] if on_gpu else None)

    # DDP: who writes the snapshot: one rank per node (node-local disks), or rank 0 (shared disk).
    writer = (ddp.local_rank == 0) if args.snapshot_per_node else ddp.is_main
    saver = "local rank 0 of each node" if args.snapshot_per_node else "rank 0"
    print0(
        f"start: data generated | train {len(train_set)} | world {ddp.world_size} | backend "
        f"{ddp.backend} | device {ddp.device.type} | batch {args.batch_size}/rank, "
        f"{args.batch_size * ddp.world_size} global | epoch {start_epoch}/{args.epochs} | "
        f"snapshot {snapshot_path(args)} by {saver}"
    )
    step, t_start, done_epoch = 0, time.perf_counter(), start_epoch
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        step = train_epoch(args, ddp, model, optimizer, loader, epoch, step, start_epoch > 0)
        val_loss, val_acc = evaluate(model.module, test_set, ddp, args.batch_size)
        print0(
            f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | val_acc {100 * val_acc:.2f}%"
        )
        # DDP: every rank calls it (barrier inside); rank 0, or local rank 0 per node, writes.
        save_checkpoint(
            {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
            },
            snapshot_path(args),
            writer=writer,
        )
        done_epoch = epoch + 1
        if step == args.max_steps:
            break
    if done_epoch == start_epoch:  # nothing left to train: report the snapshot's accuracy
        val_loss, val_acc = evaluate(model.module, test_set, ddp, args.batch_size)

    same = write_report(args, ddp, table, model, start_epoch, done_epoch, val_acc)
    print0(
        f"done: data generated | world {ddp.world_size} | nodes {len({r['node'] for r in table})} | "
        f"backend {ddp.backend} | device {ddp.device.type} | epochs {start_epoch}->{done_epoch} | "
        f"val_acc {100 * val_acc:.2f}% | replicas {'identical' if same else 'DIFFER'} | "
        f"time {time.perf_counter() - t_start:.1f}s"
    )
    del model, optimizer  # free the DDP wrapper before leaving the group (see ddp_common.cleanup)
    cleanup()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
