"""Lesson 4: DDP across several machines (nodes), each with its own disk.

    # on every node: the same command (c10d rendezvous at HOST0, one of the nodes)
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 \
        --rdzv-id=job1 multinode.py --data-dir /scratch/data --checkpoint-dir /scratch/ckpt

Across nodes every process has a GLOBAL rank (0 .. world size - 1, unique in the job) and a LOCAL
rank (0 .. processes per node - 1, unique on its node). The local rank picks the GPU; the global
rank picks the data shard and who prints. Each node has its own disk: its local rank 0 stages the
data there (copies it from shared storage, or writes the generated set) and writes its own copy
of the checkpoint, and the ranks check that every node holds the same data and resumes from the
same step. Lesson 1 (`ddp_mnist.py`) is the template; its DDP lines are marked `# DDP:` here too.
Start it with torchrun, slurm/train.sbatch, slurm/train_srun.sbatch or ./launch_ddp.sh.
"""

import contextlib
import hashlib
import os
import shutil
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

from ddp_common import (
    Parser,
    cleanup,
    fail,
    load_checkpoint,
    positive_int,
    print0,
    save_checkpoint,
    setup,
)

DATA_FILE = "points.pt"


def parse_args():
    parser = Parser(description="Lesson 4: DDP across nodes, each with its own disk.")
    parser.add_argument(
        "--data-source", help="dataset file on shared storage to stage (default: generate one)"
    )
    parser.add_argument("--data-dir", default="./data", help=f"node-local: {DATA_FILE} staged here")
    parser.add_argument("--samples", type=positive_int, default=32768, help="generated set size")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--max-steps", type=positive_int, help="stop at step N (of --epochs)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the generated data, init, shuffles")
    parser.add_argument("--checkpoint-dir", default="./checkpoints/lesson4", help="node-local")
    parser.add_argument("--resume", metavar="PATH|auto", help="auto: CHECKPOINT_DIR/last.pt if any")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--log-every", type=positive_int, default=50, help="steps per log line")
    return parser.parse_args()


def make_model(features, classes):
    return nn.Sequential(
        nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes)
    )


def make_data(seed, n_train):
    """A learnable set made from the seed alone: the label of 32 random features is the argmax
    of a fixed random linear map to 8 classes. The stand-in for a dataset you would download."""
    generator = torch.Generator().manual_seed(seed + 4321)
    teacher = torch.randn(32, 8, generator=generator)
    x_train = torch.randn(n_train, 32, generator=generator)
    x_test = torch.randn(max(1, n_train // 4), 32, generator=generator)
    return {
        "x_train": x_train,
        "y_train": (x_train @ teacher).argmax(1),
        "x_test": x_test,
        "y_test": (x_test @ teacher).argmax(1),
    }


def stage_data(args, ddp):
    """Puts DATA_FILE into this node's --data-dir, unless it is there already."""
    path = os.path.join(args.data_dir, DATA_FILE)
    # DDP: every node reads its own copy, from its own disk (node-local scratch: fast, and not
    # a thousand ranks reading one shared file). Two rounds, a barrier after each. First global
    # rank 0 stages: on a shared --data-dir it is the only writer, and the second round finds
    # the file there.
    if ddp.rank == 0:
        write_data(args, path)
    dist.barrier()
    # Then local rank 0 of every node stages what its own disk still lacks.
    if ddp.local_rank == 0:
        write_data(args, path)
    dist.barrier()
    return path


def write_data(args, path):
    """Copies --data-source to path, or writes the generated set there, unless path exists."""
    if os.path.exists(path):
        return
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(args.data_dir, exist_ok=True)
        if args.data_source:
            shutil.copyfile(args.data_source, partial)
        else:
            torch.save(make_data(args.seed, args.samples), partial)
        # Renamed when complete: a copy cut short is never taken for the data.
        os.replace(partial, path)
    except (OSError, RuntimeError) as e:
        # A full disk (torch.save: RuntimeError), a missing source: say why here; get_data then
        # stops the job, and the copy cut short is not left to fill the disk at every requeue.
        with contextlib.suppress(OSError):
            os.remove(partial)
        print(f"warning: staging {path} failed: {str(e).splitlines()[0][:200]}", file=sys.stderr)


def digest(tensors):
    """The first 12 hex digits of the SHA-256 of the tensors' bytes, in order."""
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.contiguous().numpy())  # the buffer itself: no copy to bytes
    return sha.hexdigest()[:12]


def show_ranks(ddp, data):
    """Every rank says where it runs and which data it read; rank 0 prints them all."""
    # torchrun numbers the nodes GROUP_RANK; srun (slurm/train_srun.sbatch) SLURM_NODEID.
    node = int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", 0)))
    me = (ddp.rank, node, ddp.local_rank, socket.gethostname(), ddp.device, data)
    table = [None] * ddp.world_size
    # DDP: a collective: every rank sends one object and receives everyone's.
    dist.all_gather_object(table, me)
    for rank, node, local_rank, host, device, data in table:
        print0(
            f"rank {rank} | node {node} | local_rank {local_rank} | host {host} | device {device}"
            f" | data {data}"
        )
    return table


def get_data(args, ddp):
    """Stages the data, reads this node's copy and checks that every node read the same."""
    path = stage_data(args, ddp)
    try:
        sets = torch.load(path, map_location="cpu", weights_only=True)
        # A file made elsewhere may hold float64 features (numpy's default) or int32 labels.
        x_train, x_test = sets["x_train"].float(), sets["x_test"].float()
        y_train, y_test = sets["y_train"].long(), sets["y_test"].long()
        data = digest((x_train, y_train, x_test, y_test))
    except Exception:
        data = "none"
    table = show_ranks(ddp, data)
    # DDP: replicas trained on different data (a stale copy, a failed one) would still average
    # their gradients and finish: compare, and stop every rank at once.
    digests = {row[-1] for row in table}
    if len(digests) > 1 or "none" in digests:
        copies = sorted({f"node {node} ({host}): {data}" for _, node, _, host, _, data in table})
        fail(
            f"not every node holds the same readable {DATA_FILE} in --data-dir"
            f" ({'; '.join(copies)}): check --data-source on every node, or empty --data-dir to"
            " stage it again",
            code=1,
            rank0_only=True,
        )
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), table


class Trainer:
    def __init__(self, args, ddp, train_set, test_set, data_name):
        self.args = args
        self.ddp = ddp
        self.device = ddp.device
        self.train_set = train_set
        self.test_set = test_set
        # What the checkpoint trained on: the data's digest (lessons 2 and 3 name theirs alike).
        self.data_name = data_name
        torch.manual_seed(args.seed)
        x, y = train_set.tensors
        model = make_model(x.shape[1], int(y.max()) + 1).to(self.device)
        self.on_gpu = self.device.type == "cuda"
        # fused on CPUs too: a checkpoint keeps the flag, so a CPU one resumes fused on a GPU.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
        # DDP: the global batch G = B x W. Step s trains positions s*G .. (s+1)*G - 1 of the
        # epoch's shuffle; rank r holds positions r, r+W, r+2W, ..., so its part is just its own
        # samples s*B .. (s+1)*B - 1. With the same G, any world size trains the same samples at
        # every step (lesson 2's my_share does this for any G; here W divides G).
        self.global_batch = args.batch_size * ddp.world_size
        self.steps_per_epoch = len(train_set) // self.global_batch
        if self.steps_per_epoch == 0:
            fail(f"{len(train_set)} samples: not one global batch of {self.global_batch}", 2, True)
        total_steps = args.epochs * self.steps_per_epoch
        self.last_step = min(total_steps, args.max_steps or total_steps)
        # Before the DDP wrap: the checkpoint holds the bare model's weights.
        self.step = self._resume(model)
        # DDP: ddp.device is cuda:LOCAL_RANK: global rank 5 on node 1 of 4-GPU nodes is cuda:1.
        self.model = DDP(model, device_ids=[self.device.index] if self.on_gpu else None)
        # DDP: the GLOBAL rank picks the shard: ranks on different nodes must not share data.
        self.sampler = DistributedSampler(train_set, ddp.world_size, ddp.rank, seed=args.seed)

    def _resume(self, model):
        path = self.args.resume
        if path == "auto":
            path = os.path.join(self.args.checkpoint_dir, "last.pt")
            if not os.path.exists(path):
                path = None
        step = mine = None
        if path:
            ckpt = load_checkpoint(path, model=model, optimizer=self.optimizer)
            step = ckpt["step"]
            # Node-local files of one step may come from two runs: the weights tell them apart.
            mine = (step, digest(ckpt["model"].values()))
        found = [None] * self.ddp.world_size
        # DDP: every rank must start from the same checkpoint, or they take different steps and
        # hang. With node-local disks some ranks may not see the file: compare what each found.
        dist.all_gather_object(found, mine)
        if len(set(found)) > 1:
            why = f"ranks found different checkpoints (step, weights by rank: {found})"
            fail(f"{why}: give every node the same one, or remove them all", 1, rank0_only=True)
        if step is None:
            if self.args.resume:
                print0(f"resume: no {self.args.checkpoint_dir}/last.pt yet; starting from scratch")
            return 0
        if ckpt["global_batch"] != self.global_batch:
            fail(
                f"{path} was trained with a global batch of {ckpt['global_batch']}; this run's "
                f"is {self.ddp.world_size} x {self.args.batch_size}: resume with the same "
                "--batch-size x world size",
                rank0_only=True,
            )
        if ckpt.get("data", self.data_name) != self.data_name:
            why = f"{path} trained on data {ckpt['data']}, not this run's {self.data_name}"
            fail(f"{why}: resume with the same data, or another --checkpoint-dir", rank0_only=True)
        epoch = min(step // self.steps_per_epoch + 1, self.args.epochs)
        print0(
            f"resumed: {path} | step {step} | epoch {epoch}/{self.args.epochs} | world "
            f"{ckpt['world_size']} -> {self.ddp.world_size}"
        )
        return step

    def _run_batch(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP: the gradients are all-reduced across the ranks of ALL nodes, during backward.
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        # DDP: a new shuffle every epoch, the same on every rank.
        self.sampler.set_epoch(epoch)
        batch = self.args.batch_size
        # This rank's part of the epoch's steps; a resumed run skips the steps already taken.
        done = self.step - epoch * self.steps_per_epoch
        mine = list(self.sampler)[done * batch : self.steps_per_epoch * batch]
        loader = DataLoader(self.train_set, batch, sampler=mine, pin_memory=self.on_gpu)
        loss_sum = torch.zeros((), device=self.device)
        steps = 0
        start = time.perf_counter()
        for x, y in loader:
            loss_sum += self._run_batch(x, y)
            self.step += 1
            steps += 1
            if self.step % self.args.log_every == 0 or self.step == self.last_step:
                # DDP: every rank trained its batch: samples/s of the whole job.
                samples = steps * self.global_batch
                # .item() waits for the device: once per log line. The loss is rank 0's own
                # (a mean over all ranks costs an all-reduce: lessons 2 and 3 pay it).
                print0(
                    f"epoch {epoch + 1}/{self.args.epochs} | step {self.step}/{self.last_step}"
                    f" | loss {loss_sum.item() / steps:.4f}"
                    f" | {samples / (time.perf_counter() - start):.0f} samples/s"
                )
                loss_sum.zero_()
                steps = 0
                start = time.perf_counter()
            if self.step == self.last_step:
                break

    @torch.no_grad()
    def evaluate(self):
        # DDP: the bare model, each rank on samples rank, rank + W, ...: every sample once.
        model = self.model.module.eval()
        shard = Subset(self.test_set, range(self.ddp.rank, len(self.test_set), self.ddp.world_size))
        totals = torch.zeros(3, device=self.device)
        for x, y in DataLoader(shard, batch_size=1000):
            x, y = x.to(self.device), y.to(self.device)
            logits = model(x)
            totals[0] += F.cross_entropy(logits, y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
        # DDP: add up every rank's sums, on every node.
        dist.all_reduce(totals)
        model.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, f"{100 * correct / count:.2f}% ({correct:.0f}/{count:.0f})"

    def _save_checkpoint(self):
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "global_batch": self.global_batch,
            "world_size": self.ddp.world_size,
            "data": self.data_name,
        }
        # DDP: local rank 0 of EVERY node writes its node's copy, so each node resumes from its
        # own disk. (On a shared disk they write the same tensors, each atomically.)
        path = os.path.join(self.args.checkpoint_dir, "last.pt")
        save_checkpoint(state, path, writer=self.ddp.local_rank == 0)

    def train(self):
        loss, accuracy = None, None
        while self.step < self.last_step:
            epoch = self.step // self.steps_per_epoch
            self._run_epoch(epoch)
            loss, accuracy = self.evaluate()
            print0(
                f"epoch {epoch + 1}/{self.args.epochs} | val_loss {loss:.4f} | val_acc {accuracy}"
            )
            self._save_checkpoint()
        if loss is None:
            # Nothing left to train (a finished run resumed): the saved weights' scores.
            loss, accuracy = self.evaluate()
        return loss, accuracy


@record
def main():
    args = parse_args()
    # DDP: join the group: torchrun (or train_srun.sbatch) sets RANK, LOCAL_RANK, WORLD_SIZE.
    ddp = setup(args.backend)
    train_set, test_set, table = get_data(args, ddp)
    nodes = len({row[1] for row in table})
    trainer = Trainer(args, ddp, train_set, test_set, data_name=table[0][-1])
    print0(
        f"start: world {ddp.world_size} | nodes {nodes} | backend {ddp.backend} | device "
        f"{ddp.device.type} | batch {args.batch_size}/process, {trainer.global_batch} global | "
        f"step {trainer.step}/{trainer.last_step} | checkpoint {args.checkpoint_dir}/last.pt"
    )
    start = time.perf_counter()
    loss, accuracy = trainer.train()
    print0(
        f"done: world {ddp.world_size} | nodes {nodes} | steps {trainer.step} | val_loss "
        f"{loss:.4f} | val_acc {accuracy} | time {time.perf_counter() - start:.1f}s"
    )
    # DDP: drop the wrapper, then leave the process group.
    del trainer
    cleanup()


if __name__ == "__main__":
    main()
