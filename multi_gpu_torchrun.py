"""Lesson 3: training that survives a killed worker, a preemption, and a change of world size.

    torchrun --standalone --nproc_per_node=4 --max-restarts=3 multi_gpu_torchrun.py --epochs 10

    A snapshot (CHECKPOINT_DIR/snapshot.pt) at every epoch end, every N optimizer steps with
    --save-every N, and when the job is told to stop (SIGTERM, SIGUSR1). Try --fail-at-step 100:
    rank 1 kills itself with SIGKILL at step 100 (once per checkpoint dir), torchrun restarts the
    workers and they resume from the snapshot.

When one process of a DDP job dies (out of memory, a lost node, a preempted instance, kill -9)
the others cannot go on: every step all-reduces with everyone. torchrun's answer is to stop all
the workers and start new ones, up to --max-restarts times (the default is 0: no restart, the
job fails). A restarted worker is a fresh process that remembers nothing, so the script must
find its place again in a *snapshot*: the weights, the optimizer state, the position in the data
and every rank's random state. Restored from a snapshot taken between two steps, a run continues
exactly: on CPU the final weights are bit-for-bit those of a run that was never interrupted.

The job may also come back on another number of GPUs (a requeued job, an elastic job that lost a
node). The global batch stays fixed and the gradient accumulation steps absorb the world size, so
every optimizer step sees the same samples on 1, 2 or 4 ranks: the same run, to float rounding.

In the style of pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py, but on a
task that learns and with the restarts actually exercised. DDP- and restart-specific lines are
marked `# DDP:`.
"""

import argparse
import contextlib
import datetime
import glob
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_checkpoint import load_checkpoint, save_checkpoint
from ddp_common import cleanup, fail, print0, set_seed, setup
from restart_demo import lost_peer, make_dataset, make_model, maybe_fail, usage_error


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Lesson 3: DDP training that saves snapshots and resumes after torchrun "
        "restarts a failed worker, after a preemption, or on another world size. Launch with: "
        "torchrun --standalone --nproc_per_node=N --max-restarts=3 multi_gpu_torchrun.py"
    )
    parser.add_argument("--epochs", type=int, default=10, help="epochs in all (default 10)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop with a snapshot at step N")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="samples per micro-batch PER RANK (default 32)"
    )
    # The accumulation steps follow: global batch / (world size x --batch-size).
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=0,
        help="samples per optimizer step (default: the snapshot's, else batch size x world size)",
    )
    # No --resume: a restarted worker gets the same command, so it looks for the snapshot.
    parser.add_argument(
        "--checkpoint-dir", default="./checkpoints", help="snapshot.pt: resumed from if there"
    )
    parser.add_argument("--save-every", type=int, default=0, help="also snapshot every N steps")
    parser.add_argument(
        "--preempt-signals",
        default="SIGTERM,SIGUSR1",
        help="signals that mean 'snapshot and stop', exit 128 + signal number; '' for none",
    )
    parser.add_argument(
        "--stop-check-every", type=int, default=10, help="steps between checks for a stop signal"
    )
    parser.add_argument("--samples", type=int, default=4096, help="generated training samples")
    parser.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="for the data, the init, the shuffles")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    # Demo: a crash (SIGKILL, once per checkpoint dir), and time to kill a worker by hand.
    parser.add_argument("--fail-at-step", type=int, default=0, help="--fail-rank dies after step N")
    parser.add_argument("--fail-rank", type=int, default=1, help="the rank --fail-at-step kills")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep S seconds per step")
    parser.error = usage_error
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "samples", "hidden", "stop_check_every"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("max_steps", "global_batch_size", "save_every", "fail_at_step", "step_delay"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.lr <= 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    args.signals = []
    for name in filter(None, args.preempt_signals.split(",")):
        if name not in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"):
            parser.error(f"--preempt-signals: {name!r} is not SIGTERM, SIGUSR1, SIGUSR2 or SIGINT")
        args.signals.append(signal.Signals[name])
    world = os.environ.get("WORLD_SIZE", "")
    if args.fail_at_step and world.isdigit() and args.fail_rank >= int(world):
        parser.error(f"--fail-rank {args.fail_rank} does not exist: ranks are 0..{int(world) - 1}")
    args.snapshot = os.path.join(args.checkpoint_dir, "snapshot.pt")
    return args


# The number of the last stop signal this process received (0: none yet).
received_signal = 0


def on_stop_signal(signum, frame):
    """Only note it: the ranks stop together, at a step they agree on (Trainer._agree_to_stop)."""
    global received_signal
    received_signal = signum


def rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def snapshot_exists(path, ddp):
    """Do all ranks see the snapshot? They must agree: with node-local disks, or a network file
    system caching 'no such file', some ranks would resume and the others start from scratch,
    and the job would hang in a collective at the first step they disagree on."""
    seen = torch.tensor([float(os.path.isfile(path))], device=ddp.device)
    # DDP: how many ranks see the file (once, at start)
    dist.all_reduce(seen)
    count = int(seen.item())
    if 0 < count < ddp.world_size:
        fail(
            f"{path} is seen by {count} of {ddp.world_size} ranks: every rank must read the "
            "snapshot (put --checkpoint-dir on a file system all nodes share)",
            rank0_only=True,
        )
    return count == ddp.world_size


class Trainer:
    """Trains from wherever the snapshot says, and snapshots where it is. The position in an
    epoch is counted in global samples: the next optimizer step trains positions
    samples .. samples + global batch of the epoch's shuffle, whatever the world size."""

    def __init__(self, args, ddp, train_set):
        self.args = args
        self.ddp = ddp
        self.train_set = train_set
        self.on_gpu = ddp.device.type == "cuda"
        # bf16 autocast where the GPU really has bf16 (no loss scaling needed); fp32 elsewhere.
        self.bf16 = self.on_gpu and torch.cuda.is_bf16_supported(including_emulation=False)
        # The same initial weights on every rank
        set_seed(args.seed)
        model = make_model(args.hidden, args.dropout).to(ddp.device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=self.on_gpu)
        # DDP: the same shuffle seed on every rank and restart; set_epoch() varies it by epoch.
        self.sampler = DistributedSampler(
            train_set, num_replicas=ddp.world_size, rank=ddp.rank, shuffle=True, seed=args.seed
        )
        self.epoch = 0
        # Global samples trained in this epoch (all attempts), and by this rank in this attempt.
        self.samples = 0
        self.carried = 0
        self.seen = 0
        self.history = {"starts": [], "losses": [], "samples": []}
        # DDP: torchrun tells each worker which attempt this is, and how many it allows.
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
        # The stop signal the ranks agreed on (0: none).
        self.stop_signal = 0
        # A save killed half-way leaves its temp file behind: tidy up
        if ddp.is_main:
            for leftover in glob.glob(glob.escape(args.snapshot) + ".*.tmp"):
                os.remove(leftover)
        self.global_batch = args.global_batch_size
        if snapshot_exists(args.snapshot, ddp):
            self._load_snapshot(model)
        else:
            # Per-rank randomness (dropout) from here on
            set_seed(args.seed, ddp.rank)
        if self.global_batch == 0:
            self.global_batch = args.batch_size * ddp.world_size
        self.accum = self.global_batch // (args.batch_size * ddp.world_size)
        if self.global_batch % (args.batch_size * ddp.world_size):
            fail(
                f"--global-batch-size {self.global_batch} is not a multiple of world size "
                f"{ddp.world_size} x --batch-size {args.batch_size}: pick a --batch-size that "
                "divides it",
                rank0_only=True,
            )
        # An epoch is whole global batches: a remainder (another one each epoch) is left out.
        self.steps_per_epoch = len(train_set) // self.global_batch
        if self.steps_per_epoch == 0:
            fail(f"--samples {len(train_set)} is less than one global batch ({self.global_batch})")
        self.total_steps = args.epochs * self.steps_per_epoch
        # DDP: wrap after loading; DDP broadcasts rank 0's weights to all ranks at construction.
        self.model = DDP(model, device_ids=[ddp.device.index] if self.on_gpu else None)

    @property
    def step(self):
        return self.epoch * self.steps_per_epoch + self.samples // self.global_batch

    def _load_snapshot(self, model):
        args = self.args
        ddp = self.ddp
        # To the CPU first: load_state_dict copies each tensor to its parameter's device.
        snapshot = load_checkpoint(args.snapshot, "cpu", model=model, optimizer=self.optimizer)
        if self.global_batch not in (0, snapshot["global_batch_size"]):
            fail(
                f"{args.snapshot} was trained with --global-batch-size "
                f"{snapshot['global_batch_size']}, not {self.global_batch}: resume with the same "
                "global batch, or start afresh in another --checkpoint-dir",
                rank0_only=True,
            )
        self.global_batch = snapshot["global_batch_size"]
        self.epoch = snapshot["epoch"]
        self.samples = snapshot["samples"]
        self.carried = snapshot["seen"]
        self.history = snapshot["history"]
        if (snapshot["world_size"], snapshot["batch_size"]) == (ddp.world_size, args.batch_size):
            # DDP: each rank takes back its own RNG state (rank 1's dropout is not rank 0's).
            torch.set_rng_state(snapshot["rng"][ddp.rank]["cpu"].cpu())
            if self.on_gpu and "cuda" in snapshot["rng"][ddp.rank]:
                torch.cuda.set_rng_state(snapshot["rng"][ddp.rank]["cuda"].cpu(), ddp.device)
        else:
            # Another world size: the same samples in the same steps, but the ranks' random
            # streams cannot be split anew. Dropout draws fresh numbers, seeded by the step.
            set_seed(args.seed + 1000 * (snapshot["step"] + 1), ddp.rank)
        print0(
            f"resumed: {args.snapshot} | epoch {self.epoch + 1}/{args.epochs} | samples "
            f"{self.samples}/{len(self.train_set)} | step {snapshot['step']} | world "
            f"{snapshot['world_size']} -> {ddp.world_size} | restart "
            f"{self.restart}/{self.max_restarts}"
        )

    def _save_snapshot(self):
        # DDP: gather every rank's RNG state (so each can take its own back after a restart) and
        # its count of samples trained, so the snapshot knows how many the epoch has seen.
        per_rank = [None] * self.ddp.world_size
        dist.all_gather_object(per_rank, (rng_state(self.ddp.device), self.seen))
        snapshot = {
            # DDP: the bare model, no 'module.'
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch": self.epoch,
            "samples": self.samples,
            "seen": self.carried + sum(seen for _, seen in per_rank),
            "step": self.step,
            "rng": [rng for rng, _ in per_rank],
            "history": self.history,
            "world_size": self.ddp.world_size,
            "batch_size": self.args.batch_size,
            "global_batch_size": self.global_batch,
        }
        # DDP: every rank calls; rank 0 writes
        save_checkpoint(snapshot, self.args.snapshot)
        print0(f"saved: {self.args.snapshot} | step {self.step}/{self.total_steps}")

    def _agree_to_stop(self):
        """Did any rank get a stop signal? Every rank must answer the same at the same step, or
        one would wait forever in the next step's all-reduce. One all-reduce of the signal number
        does it. It is a host sync (on a GPU, .item() waits for the queued work), so it runs every
        --stop-check-every steps, at step numbers all ranks share, not every step: the stop then
        comes up to that many steps late, which must fit in the launcher's grace period."""
        if self.step % self.args.stop_check_every != 0:
            return False
        flag = torch.tensor([float(received_signal)], device=self.ddp.device)
        # DDP: the same answer on every rank
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_signal = int(flag.item())
        return self.stop_signal != 0

    def _train_step(self, micro_batches):
        """One optimizer step over this rank's micro-batches; returns the mean loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.ddp.device)
        for i, (x, y) in enumerate(micro_batches):
            x = x.to(self.ddp.device, non_blocking=True)
            y = y.to(self.ddp.device, non_blocking=True)
            # DDP: no_sync() keeps the gradients local; the last micro-batch's backward
            # all-reduces the sum of them all (averaged across ranks).
            sync = contextlib.nullcontext()
            if i < len(micro_batches) - 1:
                sync = self.model.no_sync()
            with sync:
                with torch.autocast(self.ddp.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    out = self.model(x)
                # Each micro-batch weighs 1/accum: the step's gradient is the global batch's mean.
                loss = F.mse_loss(out.float(), y) / len(micro_batches)
                loss.backward()
            loss_sum += loss.detach()
            self.seen += len(x)
        self.optimizer.step()
        return loss_sum

    def _run_epoch(self):
        """Trains the rest of the epoch; returns its mean loss and the samples it trained,
        or None when the ranks agreed to stop or --max-steps was reached."""
        args = self.args
        ddp = self.ddp
        # DDP: this epoch's shuffle, identical after a restart
        self.sampler.set_epoch(self.epoch)
        # DDP: rank r holds positions r, r + world, r + 2 world, ... of the epoch's shuffle, so the
        # global positions s .. s + G are this rank's s / world .. (s + G) / world: taken in
        # order, this rank's micro-batches of a step are its share of the same global batch.
        first = self.samples // ddp.world_size
        last = self.steps_per_epoch * self.global_batch // ddp.world_size
        order = list(self.sampler)[first:last]
        # Its own generator: each new DataLoader iterator draws a seed from the global RNG
        # otherwise, and a resumed run (new loader mid-epoch) would draw it one time too many.
        loader = DataLoader(
            self.train_set,
            batch_size=args.batch_size,
            sampler=order,
            pin_memory=self.on_gpu,
            generator=torch.Generator(),
        )
        loss_sum = torch.zeros((), device=ddp.device)
        steps = 0
        micro_batches = []
        for x, y in loader:
            micro_batches.append((x, y))
            if len(micro_batches) < self.accum:
                continue
            # Stays on the device: no host sync
            loss_sum += self._train_step(micro_batches)
            micro_batches = []
            steps += 1
            self.samples += self.global_batch
            maybe_fail(args, self.step, ddp.rank)
            if args.step_delay:
                time.sleep(args.step_delay)
            if self._agree_to_stop() or self.step == args.max_steps:
                return None
            end_of_epoch = self.samples == self.steps_per_epoch * self.global_batch
            # The epoch's end saves anyway.
            if args.save_every and self.step % args.save_every == 0 and not end_of_epoch:
                self._save_snapshot()
        counts = torch.tensor([steps, self.seen], device=ddp.device, dtype=loss_sum.dtype)
        totals = torch.cat([loss_sum.reshape(1), counts])
        # DDP: loss and samples over all ranks (a host sync per epoch)
        dist.all_reduce(totals)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        samples = self.carried + int(totals[2].item())
        self.epoch += 1
        self.samples = 0
        self.carried = 0
        self.seen = 0
        return loss, samples

    def train(self):
        """Trains until the last epoch, --max-steps, or an agreed stop; returns the seconds and
        the steps of this attempt."""
        args = self.args
        self.history["starts"].append([self.restart, self.step, self.ddp.world_size])
        t_start = time.perf_counter()
        start_step = self.step
        while self.epoch < args.epochs and not (args.max_steps and self.step >= args.max_steps):
            t0 = time.perf_counter()
            result = self._run_epoch()
            if result is None:
                # Stopped mid-epoch: the snapshot is where the next launch goes on.
                self._save_snapshot()
                break
            loss, samples = result
            self.history["losses"].append(loss)
            self.history["samples"].append(samples)
            now = time.perf_counter()
            rate = (self.step - start_step) / (now - t_start)
            eta = (self.total_steps - self.step) / max(rate, 1e-9)
            print0(
                f"epoch {self.epoch}/{args.epochs} | step {self.step}/{self.total_steps} | "
                f"loss {loss:.4f} | samples {samples} | {samples / (now - t0):.0f} samples/s | "
                f"eta {datetime.timedelta(seconds=round(eta))}"
            )
            # Every epoch end: a restart loses at most one epoch
            self._save_snapshot()
        return time.perf_counter() - t_start, self.step - start_step


@record
def main(argv=None):
    args = parse_args(argv)
    # First thing: a signal that comes while the group forms is kept for the first check.
    for sig in args.signals:
        signal.signal(sig, on_stop_signal)
    # DDP: join the process group (a fresh one on every restart)
    ddp = setup(args.backend)
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) == 0:
        print0(
            "warning: torchrun --max-restarts is 0 (its default): if a worker dies the job "
            "fails instead of resuming from the snapshot"
        )
    trainer = Trainer(args, ddp, make_dataset(args.samples, args.seed))
    print0(
        f"start: samples {args.samples} | world {ddp.world_size} | backend {ddp.backend} | "
        f"device {ddp.device.type} | batch {args.batch_size}/rank | accum {trainer.accum} | "
        f"global batch {trainer.global_batch} | step {trainer.step}/{trainer.total_steps} | "
        f"restart {trainer.restart}/{trainer.max_restarts}"
    )
    try:
        seconds, steps = trainer.train()
    except RuntimeError as e:
        # Another rank died: this one cannot go on alone
        if not lost_peer(e):
            raise
        # Drop gloo's [file:line] prefix; keep the first sentence.
        reason = re.sub(r"^\[[^]]*\] *", "", str(e)).split(". ")[0][:120]
        fail(
            f"rank {ddp.rank} lost the other ranks at step {trainer.step} "
            f"({reason}). torchrun restarts all workers if restarts are left "
            f"({trainer.restart} of --max-restarts={trainer.max_restarts} used); they resume from "
            f"{args.snapshot}",
            code=1,
        )
    stop_signal = trainer.stop_signal
    if stop_signal:
        print0(
            f"preempted: signal {signal.Signals(stop_signal).name} | step "
            f"{trainer.step}/{trainer.total_steps} | snapshot {args.snapshot}"
        )
    else:
        losses = trainer.history["losses"] or [float("nan")]
        print0(
            f"done: world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} | "
            f"epochs {trainer.epoch} | steps {trainer.step} | loss {losses[-1]:.4f} (first epoch "
            f"{losses[0]:.4f}) | restarts {trainer.restart} | steps this attempt {steps} | "
            f"time {seconds:.1f}s"
        )
    # Free the DDP wrapper before leaving the group (see ddp_common.cleanup)
    del trainer
    cleanup()
    if stop_signal:
        # DDP: 128 + the signal, as a shell reports a process killed by it: the launcher (and
        # Slurm) see a run that did not finish, and the same command resumes it.
        sys.exit(128 + stop_signal)


if __name__ == "__main__":
    main()
