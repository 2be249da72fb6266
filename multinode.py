"""Lesson 4: DDP across several machines (nodes).

Across nodes every process has a GLOBAL rank (0 .. world_size-1, unique in the whole job) and a
LOCAL rank (0 .. processes-per-node-1, unique on its node). The local rank picks the GPU; the
global rank picks the data shard and decides who prints and saves. This script prints a table of
every rank (host, node rank, global rank, local rank, device) gathered on rank 0, then trains a
small classifier on generated data, with a snapshot after every epoch to resume from.

Three ways to start it on 2 nodes with 4 GPUs each (world size 8):

  # 1. torchrun on each node, c10d rendezvous: the same command everywhere, node ranks handed
  #    out as nodes join (restarts: see the rule in docs/multinode.md)
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc_per_node=4 \
      --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 --rdzv-id=run1 --max-restarts=1 \
      multinode.py --resume auto
  # 2. torchrun on each node, static rendezvous: you number the nodes yourself
  torchrun --nnodes=2 --nproc_per_node=4 --node_rank=0 --master_addr=HOST0 multinode.py
  torchrun --nnodes=2 --nproc_per_node=4 --node_rank=1 --master_addr=HOST0 multinode.py
  # 3. Slurm: sbatch slurm/train.sbatch multinode.py (one torchrun per node), or
  #    sbatch slurm/train_srun.sbatch multinode.py (one srun task per GPU, no torchrun)
  # launch_ddp.sh wraps all of these: ./launch_ddp.sh --help

Node-local disks: by default global rank 0 alone writes the snapshot to --checkpoint-dir, and on
resume EVERY rank reads it from there, so that directory must be on a filesystem all nodes see
(NFS, Lustre, GPFS...). If each node has only its own disk, pass --snapshot-per-node: local rank
0 of every node writes its own copy. Either way the ranks check that they all resume from the
same position, and stop with one error line if not.
The DDP-specific lines are marked `# DDP:`.
"""

import argparse
import hashlib
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_checkpoint import load_checkpoint, save_checkpoint
from ddp_common import cleanup, fail, print0, set_seed, setup

SNAPSHOT = "multinode.pt"
FEATURES = 32
CLASSES = 8


def parse_args():
    parser = argparse.ArgumentParser(
        description="Lesson 4: DDP across nodes; rank table, training with snapshots. "
        "Launch with torchrun --nnodes=N, srun, or launch_ddp.sh"
    )
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data (default 5)")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many optimizer steps in this run, saving the exact position "
        "(0 = no cap); quick checks",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="samples per step PER RANK; the global batch is this x world size (default 64)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init, data order and data")
    parser.add_argument(
        "--samples",
        type=int,
        default=32768,
        help="size of the generated training set (default 32768; test set is 1/4 of it)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="./checkpoints",
        help=f"where {SNAPSHOT} is saved after every epoch. Must be on a filesystem shared "
        "by all nodes, unless --snapshot-per-node (default ./checkpoints)",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="PATH|auto",
        help=f"auto: continue from CHECKPOINT_DIR/{SNAPSHOT} if it exists (what a restarted "
        "torchrun worker needs); PATH: continue from that snapshot, saving to CHECKPOINT_DIR",
    )
    parser.add_argument(
        "--snapshot-per-node",
        action="store_true",
        help="local rank 0 of EVERY node writes the snapshot (node-local disks, "
        "e.g. --checkpoint-dir /tmp/ckpt); default: global rank 0 only",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)",
    )
    parser.add_argument("--log-every", type=int, default=50, help="steps between log lines")
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "samples", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_steps < 0:
        fail("--max-steps must be 0 (no cap) or more")
    if args.lr <= 0:
        fail("--lr must be above 0")
    return args


def make_data(seed, n_train):
    """A learnable task made from the seed alone, identical on every rank and node (no files to
    share): 8 classes, the label is the argmax of a fixed random linear map of 32 features."""
    generator = torch.Generator().manual_seed(seed + 4321)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    x_train = torch.randn(n_train, FEATURES, generator=generator)
    x_test = torch.randn(max(1, n_train // 4), FEATURES, generator=generator)
    train_set = TensorDataset(x_train, (x_train @ teacher).argmax(1))
    test_set = TensorDataset(x_test, (x_test @ teacher).argmax(1))
    return train_set, test_set


def make_model():
    return nn.Sequential(
        nn.Linear(FEATURES, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, CLASSES),
    )


def rank_table(ddp):
    """Every rank says where it runs; every rank gets the list of all of them."""
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
    # DDP: a collective: every rank sends one picklable object, every rank receives them all.
    dist.all_gather_object(table, me)
    return table


def print_table(table, ddp):
    nodes = len({row["node"] for row in table})
    print0(f"ranks: world {ddp.world_size} | nodes {nodes} | launcher {ddp.launcher}")
    columns = list(table[0])
    width = {c: max(len(c), *(len(str(row[c])) for row in table)) for c in columns}
    print0("  " + "  ".join(c.ljust(width[c]) for c in columns).rstrip())
    for row in table:
        print0("  " + "  ".join(str(row[c]).ljust(width[c]) for c in columns).rstrip())
    # Two ranks on one GPU: usually a wrong --nproc_per_node or CUDA_VISIBLE_DEVICES.
    first_on = {}
    for row in table:
        key = (row["host"], row["slurm_node"], row["device"])
        if row["device"].startswith("cuda") and key in first_on:
            print0(f"warning: ranks {first_on[key]} and {row['rank']} share {key[2]} on {key[0]}")
        first_on.setdefault(key, row["rank"])


def load_snapshot(args, ddp, model, optimizer):
    """Returns where to start: (epoch, batch), the first batch not yet trained. Every rank must
    start from the same place: on node-local disks without --snapshot-per-node, only rank 0's
    node finds the file, and the other nodes would silently start again from epoch 0."""
    path = args.resume
    if args.resume == "auto":
        path = os.path.join(args.checkpoint_dir, SNAPSHOT)
    snapshot = {"epoch": 0, "batch": 0}
    if path and (args.resume != "auto" or os.path.isfile(path)):
        snapshot = load_checkpoint(path, model=model, optimizer=optimizer)
    epoch = snapshot["epoch"]
    batch = snapshot["batch"]
    found = [None] * ddp.world_size
    # DDP: compare what every rank found, on every node.
    dist.all_gather_object(found, (epoch, batch, socket.gethostname(), ddp.node_rank))
    if len({(e, b) for e, b, _, _ in found}) > 1:
        detail = "; ".join(
            f"rank {r} (node {n}, {h}): epoch {e} batch {b}" for r, (e, b, h, n) in enumerate(found)
        )
        fail(
            f"ranks found different snapshots ({detail}). Without --snapshot-per-node the "
            "checkpoint dir must be on a filesystem shared by all nodes; with it, every node "
            "needs its own copy. Copy one snapshot to every node, or delete them to start fresh",
            code=1,
            rank0_only=True,
        )
    # Inside an epoch, the batches left are this rank's part of the epoch's shuffle: only the
    # same world size and batch size cut it into the same shards and batches.
    saved_with = (snapshot.get("world_size"), snapshot.get("batch_size"))
    if batch > 0 and saved_with != (ddp.world_size, args.batch_size):
        fail(
            f"{path} stopped inside epoch {epoch + 1} with world size {snapshot['world_size']} "
            f"x batch {snapshot['batch_size']}; this run has {ddp.world_size} x "
            f"{args.batch_size}. Resume with the same world size and --batch-size",
            rank0_only=True,
        )
    return epoch, batch


def save_snapshot(args, ddp, model, optimizer, epoch, batch):
    """The weights, AdamW's state and the position: `batch` batches of epoch `epoch` are done."""
    snapshot = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "batch": batch,
        "world_size": ddp.world_size,
        "batch_size": args.batch_size,
    }
    # DDP: who writes: one rank per node (node-local disks), or global rank 0 (a shared disk).
    if args.snapshot_per_node:
        writer = ddp.local_rank == 0
    else:
        writer = ddp.is_main
    path = os.path.join(args.checkpoint_dir, SNAPSHOT)
    # Every rank calls it: the writer writes, then all wait at a barrier inside.
    save_checkpoint(snapshot, path, writer=writer)


def epoch_batches(args, train_set, sampler, epoch, skip, pin_memory):
    """This rank's batches of `epoch`, from batch `skip` on (a run resumed inside an epoch)."""
    # DDP: the same shuffle on every rank, new each epoch; each rank keeps its own shard of it.
    sampler.set_epoch(epoch)
    order = list(sampler)[skip * args.batch_size :]
    return DataLoader(train_set, batch_size=args.batch_size, sampler=order, pin_memory=pin_memory)


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    # DDP: the gradients are all-reduced across ALL nodes' ranks during backward.
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_epoch(args, ddp, model, optimizer, batches, epoch, batch, steps):
    """Trains on `batches`, the rest of epoch `epoch` from batch `batch` on; `steps` counts this
    run's steps. Returns both counts, stopping early at --max-steps."""
    loss_sum = torch.zeros((), device=ddp.device)
    logged = 0
    t_log = time.perf_counter()
    for x, y in batches:
        x = x.to(ddp.device, non_blocking=True)
        y = y.to(ddp.device, non_blocking=True)
        loss_sum += train_step(model, optimizer, x, y)
        batch += 1
        steps += 1
        logged += 1
        if steps % args.log_every == 0:
            # .item() waits for the GPU: once per log line only.
            now = time.perf_counter()
            samples = logged * args.batch_size * ddp.world_size
            print0(
                f"epoch {epoch + 1}/{args.epochs} | step {steps} | "
                f"loss {loss_sum.item() / logged:.4f} | {samples / (now - t_log):.0f} samples/s"
            )
            loss_sum = torch.zeros((), device=ddp.device)
            logged = 0
            t_log = now
        if steps == args.max_steps:
            break
    return batch, steps


@torch.no_grad()
def evaluate(model, test_set, ddp, batch_size):
    """Exact accuracy over the test set: rank r takes samples r, r+W, ...; counts are summed.
    `model` is the bare model.module: a forward through the DDP wrapper would join DDP's
    collectives, and ranks whose shards differ by a batch would then wait for each other."""
    model.eval()
    shard = Subset(test_set, range(ddp.rank, len(test_set), ddp.world_size))
    # Loss sum and correct count: summed on the device, no host sync per batch.
    sums = torch.zeros(2, device=ddp.device)
    for x, y in DataLoader(shard, batch_size=4 * batch_size):
        x = x.to(ddp.device, non_blocking=True)
        y = y.to(ddp.device, non_blocking=True)
        logits = model(x)
        loss_sum = F.cross_entropy(logits, y, reduction="sum")
        correct = (logits.argmax(1) == y).sum()
        sums += torch.stack([loss_sum, correct])
    totals = torch.cat([sums, torch.tensor([float(len(shard))], device=ddp.device)])
    # DDP: add up every rank's sums and counts.
    dist.all_reduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


def params_sha256(state_dict):
    """Checksum of a model's weights: equal on two ranks <=> bit-identical replicas."""
    digest = hashlib.sha256()
    for tensor in state_dict.values():
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def replica_checksums(model, ddp):
    """Every rank's checksum of its replica: DDP keeps them identical, on every node."""
    checksums = [None] * ddp.world_size
    # DDP: gather every rank's checksum.
    dist.all_gather_object(checksums, params_sha256(model.state_dict()))
    return checksums


@record
def main():
    args = parse_args()
    # DDP: join the group: torchrun (or srun tasks) set RANK, LOCAL_RANK, WORLD_SIZE...
    ddp = setup(args.backend)
    table = rank_table(ddp)
    print_table(table, ddp)

    # The same seed everywhere: the same initial weights (DDP also broadcasts rank 0's).
    set_seed(args.seed)
    train_set, test_set = make_data(args.seed, args.samples)
    on_gpu = ddp.device.type == "cuda"
    # DDP: the GLOBAL rank picks the shard: ranks on different nodes must not share data.
    sampler = DistributedSampler(
        train_set, num_replicas=ddp.world_size, rank=ddp.rank, shuffle=True, seed=args.seed
    )
    batches_per_epoch = math.ceil(len(sampler) / args.batch_size)
    model = make_model().to(ddp.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=on_gpu)
    # Before the DDP wrap, so the snapshot's keys are the bare model's.
    start_epoch, start_batch = load_snapshot(args, ddp, model, optimizer)
    # DDP: the LOCAL rank picks the GPU: global rank 5 on node 1 of 4-GPU nodes is cuda:1.
    if on_gpu:
        model = DDP(model, device_ids=[ddp.device.index])
    else:
        model = DDP(model)

    if args.snapshot_per_node:
        saver = "local rank 0 of each node"
    else:
        saver = "rank 0"
    print0(
        f"start: data generated | train {len(train_set)} | world {ddp.world_size} | "
        f"backend {ddp.backend} | device {ddp.device.type} | batch {args.batch_size}/rank, "
        f"{args.batch_size * ddp.world_size} global | epochs {args.epochs} | "
        f"snapshot {os.path.join(args.checkpoint_dir, SNAPSHOT)} by {saver}"
    )
    if (start_epoch, start_batch) != (0, 0):
        print0(
            f"resumed: epoch {start_epoch + 1}/{args.epochs} | "
            f"batch {start_batch}/{batches_per_epoch}"
        )
    steps = 0
    val_acc = None
    t_start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        skip = 0
        if epoch == start_epoch:
            skip = start_batch
        batches = epoch_batches(args, train_set, sampler, epoch, skip, on_gpu)
        batch, steps = train_epoch(args, ddp, model, optimizer, batches, epoch, skip, steps)
        if batch < batches_per_epoch:
            # --max-steps stopped the run inside the epoch: save exactly where.
            save_snapshot(args, ddp, model, optimizer, epoch, batch)
            print0(f"saved: epoch {epoch + 1}/{args.epochs} | batch {batch}/{batches_per_epoch}")
            # The weights moved since the last evaluation, if any: evaluate them below.
            val_acc = None
            break
        val_loss, val_acc = evaluate(model.module, test_set, ddp, args.batch_size)
        print0(
            f"epoch {epoch + 1}/{args.epochs} | val_loss {val_loss:.4f} | "
            f"val_acc {100 * val_acc:.2f}%"
        )
        save_snapshot(args, ddp, model, optimizer, epoch + 1, 0)
        if steps == args.max_steps:
            break
    if val_acc is None:
        # Stopped inside an epoch, or nothing left to train: the accuracy of the final weights.
        val_loss, val_acc = evaluate(model.module, test_set, ddp, args.batch_size)

    checksums = replica_checksums(model.module, ddp)
    same = len(set(checksums)) == 1
    if same:
        replicas = "identical"
    else:
        replicas = "DIFFER"
    nodes = len({row["node"] for row in table})
    print0(
        f"done: data generated | world {ddp.world_size} | nodes {nodes} | "
        f"backend {ddp.backend} | device {ddp.device.type} | steps {steps} | "
        f"val_acc {100 * val_acc:.2f}% | replicas {replicas} | "
        f"time {time.perf_counter() - t_start:.1f}s"
    )
    # Free the DDP wrapper before leaving the group (see ddp_common.cleanup).
    del model, optimizer
    cleanup()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
