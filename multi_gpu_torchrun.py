"""Lesson 3: snapshot training that survives a killed worker.

    torchrun --standalone --nproc_per_node=4 --max-restarts=3 multi_gpu_torchrun.py --epochs 10

    A snapshot (CHECKPOINT_DIR/snapshot.pt) at every epoch end, and every N optimizer steps with
    --save-every N. Try --fail-at-step 100: rank 1 kills itself with SIGKILL at step 100 (once
    per checkpoint dir), torchrun restarts the workers and they resume from the snapshot.

When one process of a DDP job dies (out of memory, a lost node, a preempted instance, kill -9)
the others cannot go on: every step all-reduces with everyone. torchrun's answer is to stop all
the workers and start new ones, up to --max-restarts times (the default is 0: no restart, the
job fails). A restarted worker is a fresh process that remembers nothing, so the script must
find its place again in a *snapshot*: the weights, the optimizer state, the position in the data
(epoch and batch) and every rank's random state. Restored from a snapshot taken between two
steps, a run continues exactly: on CPU the final weights are bit-for-bit those of a run that was
never interrupted.

In the style of pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py, but on a
task that learns (the tutorial's loss is always zero) and with the restart actually exercised.
The DDP- and restart-specific lines are marked `# DDP:`.
"""

import argparse
import datetime
import glob
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cleanup, fail, load_checkpoint, print0, save_checkpoint, set_seed, setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Lesson 3: DDP training that saves snapshots and resumes after torchrun "
        "restarts a failed worker. Launch with: torchrun --standalone "
        "--nproc_per_node=N --max-restarts=3 multi_gpu_torchrun.py --epochs 10"
    )
    p.add_argument("--epochs", type=int, default=10, help="epochs to train in all (default 10)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="samples per step PER RANK; the global batch is this x world size (default 32)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default="./checkpoints",
        help="holds snapshot.pt: resumed from whenever it exists (that is how restarted "
        "workers find their place), saved to as training goes. On several nodes it "
        "must be a file system every node sees (default ./checkpoints)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="also snapshot every N optimizer steps (0 = only at epoch ends)",
    )
    p.add_argument("--samples", type=int, default=4096, help="size of the generated training set")
    p.add_argument("--hidden", type=int, default=256, help="width of the model's hidden layers")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed for the data, the init and the shuffles"
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "nccl", "gloo"],
        help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)",
    )
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        help="demo: --fail-rank kills itself with SIGKILL after step N, once per "
        "checkpoint dir (a marker file snapshot.pt.failed remembers it); 0 = never",
    )
    p.add_argument(
        "--fail-rank", type=int, default=1, help="global rank that --fail-at-step kills (default 1)"
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="demo: sleep this many seconds after each step, to leave time to kill a worker by hand",
    )
    # Under torchrun every rank parses the arguments: only rank 0 prints the mistake, once.
    p.error = lambda message: fail(message) if os.environ.get("RANK", "0") == "0" else sys.exit(2)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "samples", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("save_every", "fail_at_step", "fail_rank", "step_delay"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    world = os.environ.get("WORLD_SIZE", "")
    if args.fail_at_step and world.isdigit() and args.fail_rank >= int(world):
        p.error(f"--fail-rank {args.fail_rank} does not exist: ranks are 0..{int(world) - 1}")
    args.snapshot = os.path.join(args.checkpoint_dir, "snapshot.pt")
    return args


def make_dataset(n, seed, dim=20):
    """A regression task worth learning: targets come from a fixed random 'teacher' network plus
    a little noise; the student must find the function. Same on every rank (own generator)."""
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.randn(n, dim, generator=g)
    w1, w2 = torch.randn(dim, 64, generator=g) / dim**0.5, torch.randn(64, 1, generator=g)
    y = torch.tanh(x @ w1) @ w2
    y = (y - y.mean()) / y.std() + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model(hidden, dim=20):
    # Dropout draws random numbers every step: the snapshot must hold each rank's RNG state.
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


class Trainer:
    """Trains from wherever the snapshot says, and snapshots where it is. Position = (epoch,
    batch): the next batch to train; a snapshot is always taken between two steps."""

    def __init__(self, args, ddp, train_set):
        self.args, self.ddp, self.train_set = args, ddp, train_set
        self.on_gpu = ddp.device.type == "cuda"
        # bf16 autocast where the GPU really has bf16 (no loss scaling needed); fp32 elsewhere.
        self.bf16 = self.on_gpu and torch.cuda.is_bf16_supported(including_emulation=False)
        set_seed(args.seed)  # the same initial weights on every rank
        model = make_model(args.hidden).to(ddp.device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=self.on_gpu)
        # DDP: the same shuffle seed on every rank and every restart; set_epoch() varies it by epoch.
        self.sampler = DistributedSampler(
            train_set, num_replicas=ddp.world_size, rank=ddp.rank, shuffle=True, seed=args.seed
        )
        self.steps_per_epoch = -(-len(self.sampler) // args.batch_size)
        self.total_steps = args.epochs * self.steps_per_epoch
        self.epoch = self.batch = 0
        self.history = {"starts": [], "losses": []}  # (restart, step) of every start; epoch losses
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # DDP: set by torchrun
        self.max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
        if ddp.is_main:  # a save killed half-way leaves its temp file behind: tidy up
            for leftover in glob.glob(glob.escape(args.snapshot) + ".tmp*"):
                os.remove(leftover)
        if os.path.exists(args.snapshot):
            self._load_snapshot(model)
        else:
            set_seed(args.seed, ddp.rank)  # per-rank randomness (dropout) from here on
        # DDP: wrap after loading; DDP broadcasts rank 0's weights to all ranks at construction.
        self.model = DDP(model, device_ids=[ddp.device.index] if self.on_gpu else None)

    @property
    def step(self):
        return self.epoch * self.steps_per_epoch + self.batch

    def _load_snapshot(self, model):
        a, ddp = self.args, self.ddp
        # To the CPU first: load_state_dict copies each tensor to its parameter's device.
        snap = load_checkpoint(a.snapshot, "cpu", model=model, optimizer=self.optimizer)
        self.epoch, self.batch, self.history = snap["epoch"], snap["batch"], snap["history"]
        if (snap["world_size"], snap["batch_size"]) == (ddp.world_size, a.batch_size):
            # DDP: each rank takes back its own RNG state (rank 1's dropout is not rank 0's).
            torch.set_rng_state(snap["rng"][ddp.rank]["cpu"].cpu())
            if self.on_gpu and "cuda" in snap["rng"][ddp.rank]:
                torch.cuda.set_rng_state(snap["rng"][ddp.rank]["cuda"].cpu(), ddp.device)
        else:  # elastic resize: shards and steps differ, so restart the epoch with fresh seeds
            print0(
                f"warning: snapshot made with world {snap['world_size']} x batch "
                f"{snap['batch_size']}, now {ddp.world_size} x {a.batch_size}: epoch "
                f"{self.epoch + 1} restarts from its first batch and the RNG is reseeded"
            )
            self.batch = 0
            set_seed(a.seed + 1000 * (self.restart + 1), ddp.rank)
        print0(
            f"resumed: {a.snapshot} | epoch {self.epoch + 1}/{a.epochs} | batch "
            f"{self.batch}/{self.steps_per_epoch} | step {self.step}/{self.total_steps} | "
            f"restart {self.restart}/{self.max_restarts}"
        )

    def _save_snapshot(self):
        # DDP: gather every rank's RNG state, so each can take its own back after a restart.
        rngs = [None] * self.ddp.world_size
        dist.all_gather_object(rngs, rng_state(self.ddp.device))
        snapshot = {
            "model": self.model.module.state_dict(),  # DDP: the bare model, no 'module.'
            "optimizer": self.optimizer.state_dict(),
            "epoch": self.epoch,
            "batch": self.batch,
            "step": self.step,
            "rng": rngs,
            "history": self.history,
            "world_size": self.ddp.world_size,
            "batch_size": self.args.batch_size,
        }
        save_checkpoint(snapshot, self.args.snapshot)  # DDP: every rank calls; rank 0 writes
        print0(
            f"saved: {self.args.snapshot} | epoch {self.epoch + 1 if self.batch else self.epoch}"
            f"/{self.args.epochs} | step {self.step}/{self.total_steps}"
        )

    def _maybe_fail(self):
        """--fail-at-step: die like a real crash would (SIGKILL: no exception, no cleanup)."""
        a = self.args
        marker = a.snapshot + ".failed"
        if self.step != a.fail_at_step or self.ddp.rank != a.fail_rank or os.path.exists(marker):
            return
        with open(marker, "w") as f:  # remember, so the restarted worker does not die again
            f.write(f"rank {a.fail_rank} killed itself at step {self.step}\n")
            f.flush()
            os.fsync(f.fileno())
        print(
            f"fail: rank {self.ddp.rank} | step {self.step} | SIGKILL (--fail-at-step)", flush=True
        )
        os.kill(os.getpid(), signal.SIGKILL)

    def _run_batch(self, x, y):
        x, y = x.to(self.ddp.device, non_blocking=True), y.to(self.ddp.device, non_blocking=True)
        with torch.autocast(self.ddp.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = self.model(x)
        loss = F.mse_loss(out.float(), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP: gradients are averaged across ranks during backward
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self):
        a, ddp = self.args, self.ddp
        self.sampler.set_epoch(self.epoch)  # DDP: this epoch's shuffle, identical after a restart
        # Resuming mid-epoch: skip the batches the snapshot already trained on.
        order = list(self.sampler)[self.batch * a.batch_size :]
        # Its own generator: each new DataLoader iterator draws a seed from the global RNG
        # otherwise, and a resumed run (new loader mid-epoch) would draw it one time too many.
        loader = DataLoader(
            self.train_set,
            batch_size=a.batch_size,
            sampler=order,
            pin_memory=self.on_gpu,
            generator=torch.Generator(),
        )
        loss_sum, n = torch.zeros((), device=ddp.device), 0
        for x, y in loader:
            loss_sum += self._run_batch(x, y)  # stays on the device: no host sync per step
            n += 1
            self.batch += 1
            self._maybe_fail()
            if a.step_delay:
                time.sleep(a.step_delay)
            if (
                a.save_every and self.step % a.save_every == 0 and self.batch < self.steps_per_epoch
            ):  # the epoch's end saves anyway
                self._save_snapshot()
        self.epoch, self.batch = self.epoch + 1, 0
        totals = torch.stack([loss_sum, torch.tensor(float(n), device=ddp.device)])
        dist.all_reduce(totals)  # DDP: the mean loss over all ranks (a host sync once per epoch)
        return (totals[0] / totals[1].clamp(min=1)).item(), n

    def train(self):
        a = self.args
        self.history["starts"].append([self.restart, self.step])
        t_start, start_step = time.perf_counter(), self.step
        while self.epoch < a.epochs:
            t0 = time.perf_counter()
            loss, n = self._run_epoch()
            self.history["losses"].append(loss)
            now = time.perf_counter()
            eta = (self.total_steps - self.step) * (now - t_start) / max(1, self.step - start_step)
            print0(
                f"epoch {self.epoch}/{a.epochs} | step {self.step}/{self.total_steps} | "
                f"loss {loss:.4f} | {n * a.batch_size * self.ddp.world_size / (now - t0):.0f} samples/s"
                f" | eta {datetime.timedelta(seconds=round(eta))}"
            )
            self._save_snapshot()  # every epoch end: a restart loses at most one epoch
        return time.perf_counter() - t_start, self.step - start_step


def lost_peer(error):
    """Did a collective fail because another rank went away? (gloo raises a plain RuntimeError
    from inside backward; newer code raises dist.DistError.)"""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text
        for s in ("Connection closed by peer", "Connection reset by peer", "remote worker", "NCCL")
    )


def main():
    args = parse_args()
    ddp = setup(args.backend)  # DDP: join the process group (a fresh one on every restart)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        print0(
            "warning: torchrun --max-restarts is 0 (its default): if a worker dies the job "
            "fails instead of resuming from the snapshot"
        )
    trainer = Trainer(args, ddp, make_dataset(args.samples, args.seed))
    print0(
        f"start: samples {args.samples} | world {ddp.world_size} | backend {ddp.backend} | device "
        f"{ddp.device.type} | batch {args.batch_size}/rank, {args.batch_size * ddp.world_size} global"
        f" | steps {trainer.step}/{trainer.total_steps} | restart {trainer.restart}/{trainer.max_restarts}"
    )
    try:
        seconds, steps = trainer.train()
    except RuntimeError as e:  # another rank died: this one cannot go on alone
        if not lost_peer(e):
            raise
        reason = re.sub(r"^\[[^]]*\] *", "", str(e)).split(". ")[0][:120]  # drop gloo's file:line
        fail(
            f"rank {ddp.rank} lost the other ranks at step {trainer.step} "
            f"({reason}). torchrun restarts all workers if restarts are left "
            f"({trainer.restart} of --max-restarts={trainer.max_restarts} used); they resume from "
            f"{args.snapshot}",
            code=1,
        )
    losses = trainer.history["losses"]
    print0(
        f"done: world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} | "
        f"epochs {trainer.epoch} | steps {trainer.step} | loss {losses[-1] if losses else float('nan'):.4f} "
        f"(first epoch {losses[0] if losses else float('nan'):.4f}) | restarts {trainer.restart} | "
        f"steps this attempt {steps} | time {seconds:.1f}s"
    )
    del trainer  # free the DDP wrapper before leaving the group (see ddp_common.cleanup)
    cleanup()


if __name__ == "__main__":
    main()
