"""Lesson 3: training that survives a killed worker, a preemption and a change of world size.

    torchrun --standalone --nproc_per_node=4 --max-restarts=3 multi_gpu_torchrun.py

When one process of a DDP job dies, the others cannot go on: every step all-reduces with all of
them. torchrun stops the survivors and starts every worker again (up to --max-restarts times),
and a restarted worker remembers nothing: it finds its place in a snapshot,
CHECKPOINT_DIR/last.pt, saved at every epoch end and every --save-every steps. A preempted job
(SIGTERM, SIGUSR1) saves one where it stops, and the same command resumes it, on as many GPUs as
it is given. It keeps lesson 1's Trainer shape; the task is a small MLP on generated data.
"""

import argparse
import contextlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
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


def probability(text):
    """argparse type: a number from 0 up to, not including, 1."""
    if not 0 <= float(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not in [0, 1)")
    return float(text)


def parse_args():
    parser = Parser(description="Lesson 3: training that survives failures, resumes anywhere.")
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--max-steps", type=positive_int, help="stop (with a snapshot) at step N")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="micro-batch per rank")
    parser.add_argument(
        "--global-batch-size",
        type=positive_int,
        help="samples per step, all ranks (default: the snapshot's, else batch x world size)",
    )
    parser.add_argument("--checkpoint-dir", default="./checkpoints/lesson3", help="resumes last.pt")
    parser.add_argument("--save-every", type=positive_int, help="also snapshot every N steps")
    parser.add_argument(
        "--log-every", type=positive_int, default=10, help="steps per log line and stop check"
    )
    parser.add_argument(
        "--fail-at-step", type=positive_int, help="demo: the last rank dies after step N, once"
    )
    parser.add_argument("--samples", type=positive_int, default=4096, help="generated samples")
    parser.add_argument("--hidden", type=positive_int, default=256, help="the MLP's width")
    parser.add_argument("--dropout", type=probability, default=0.1)
    return parser.parse_args()


def make_model(hidden, dropout, dim=20):
    """No BatchNorm: its statistics depend on the per-rank batch, so another world size would
    be another run. Dropout draws random numbers: the snapshot keeps every rank's random state."""
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def make_dataset(samples, dim=20):
    """Targets from a fixed random 'teacher' network plus noise: the same data on every rank."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, dim, generator=generator)
    teacher = torch.randn(dim, 64, generator=generator) / dim**0.5
    y = torch.tanh(x @ teacher) @ torch.randn(64, 1, generator=generator)
    y = (y - y.mean()) / y.std() + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def my_share(mine, step, global_batch, rank, world_size):
    """DDP: rank r's part of step s: positions sG .. (s+1)G - 1 of the epoch's shuffle, where
    mine[j] is position r + jW, so j runs ceil((sG - r) / W) .. ceil(((s+1)G - r) / W) - 1
    (-(-a // b) is ceil(a / b)). The same samples on any W (G 16, W 3: 6, 5 and 5 at step 0)."""
    begin = -(-(step * global_batch - rank) // world_size)
    end = -(-((step + 1) * global_batch - rank) // world_size)
    return mine[begin:end]


# The signal number of a stop request (SIGTERM, SIGUSR1) this process received; 0: none.
received_signal = 0


def note_signal(signum, frame):
    """Only note it: the ranks stop together, at a step they agree on (Trainer._agree_to_stop)."""
    global received_signal
    received_signal = signum


class Trainer:
    def __init__(self, args, ddp, train_set):
        self.args = args
        self.ddp = ddp
        self.device = ddp.device
        self.train_set = train_set
        # What the snapshot trained on (lesson 2 names its data set the same way).
        self.data_name = f"--samples {len(train_set)}"
        self.path = os.path.join(args.checkpoint_dir, "last.pt")
        # DDP: torchrun counts the attempts: 0 at launch, +1 at every restart.
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.stop_signal = 0
        # The same initial weights in every process (DDP also copies rank 0's to all).
        torch.manual_seed(0)
        model = make_model(args.hidden, args.dropout).to(self.device)
        # fused on CPUs too: load_state_dict takes the flag from the snapshot's param groups, so
        # a snapshot saved on CPUs resumes fused on a GPU.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        # DDP: each process draws a different 1/world_size of the shuffled samples.
        self.sampler = DistributedSampler(train_set, ddp.world_size, ddp.rank, shuffle=True)
        checkpoint = self._load_checkpoint(model)
        self._plan_batches(checkpoint)
        if checkpoint:
            print0(
                f"resumed: {self.path} | step {self.step} | epoch "
                f"{min(self.step // self.steps_per_epoch + 1, args.epochs)}/{args.epochs} | world "
                f"{checkpoint['world_size']} -> {ddp.world_size}"
            )
        on_gpu = self.device.type == "cuda"
        # DDP: wrap after loading: the wrapper copies rank 0's weights to every rank.
        self.model = DDP(model, device_ids=[ddp.device.index] if on_gpu else None)

    def _load_checkpoint(self, model):
        """The snapshot, loaded into the model and the optimizer, or None: a fresh start."""
        ddp = self.ddp
        checkpoint = None
        if os.path.exists(self.path):
            checkpoint = load_checkpoint(self.path, model=model, optimizer=self.optimizer)
        else:
            print0(f"resume: no {self.path} yet; starting from scratch")
        self.step = checkpoint["step"] if checkpoint else 0
        found = [None] * ddp.world_size
        # DDP: every rank must start from the same step, or they take different steps and hang.
        # With node-local disks some ranks may not see the file: compare what each found.
        dist.all_gather_object(found, self.step if checkpoint else None)
        if len(set(found)) > 1:
            why = f"ranks found different checkpoints (step by rank: {found})"
            fail(f"{why}: give every rank the same one, or remove them all", 1, rank0_only=True)
        # DDP: each rank a random stream of its own (dropout draws differ by rank), a seed per
        # (step, rank); on the same world size each rank takes back the state it saved (a run on
        # CPUs saved no CUDA state: the CUDA stream keeps this seed).
        torch.manual_seed(1000 * self.step + ddp.rank)
        if checkpoint and checkpoint["world_size"] == ddp.world_size:
            rng = checkpoint["rng"][ddp.rank]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"])
        return checkpoint

    def _plan_batches(self, checkpoint):
        """G, the samples of one step over all ranks: fixed for the whole run, so that step s
        trains the same samples on any world size. A torchrun restart or a requeued job cannot
        change the command: G comes back from the snapshot."""
        args = self.args
        world_size = self.ddp.world_size
        self.global_batch = args.global_batch_size or args.batch_size * world_size
        if checkpoint:
            if args.global_batch_size not in (None, checkpoint["global_batch"]):
                fail(
                    f"{self.path} has a global batch of {checkpoint['global_batch']}, not "
                    f"--global-batch-size {args.global_batch_size}: start another "
                    "--checkpoint-dir for another run",
                    rank0_only=True,
                )
            self.global_batch = checkpoint["global_batch"]
            # Other data: its step counts would point at other samples.
            if checkpoint.get("data", self.data_name) != self.data_name:
                why = f"{self.path} trained on {checkpoint['data']}, not {self.data_name}"
                fail(why, rank0_only=True)
        # A rank without a sample would not join the all-reduce.
        if world_size > self.global_batch:
            fail(f"{world_size} ranks share a global batch of {self.global_batch}", rank0_only=True)
        self.steps_per_epoch = len(self.train_set) // self.global_batch
        if self.steps_per_epoch == 0:
            fail(
                f"--samples {len(self.train_set)} is less than one global batch "
                f"({self.global_batch})",
                rank0_only=True,
            )
        total_steps = args.epochs * self.steps_per_epoch
        self.last_step = min(total_steps, args.max_steps or total_steps)

    def _run_batch(self, x, y):
        """One optimizer step on this rank's share of the global batch, in micro-batches."""
        self.optimizer.zero_grad(set_to_none=True)
        # Micro-batches of --batch-size bound the activations' memory; the step trains them all.
        inputs = x.to(self.device, non_blocking=True).split(self.args.batch_size)
        targets = y.to(self.device, non_blocking=True).split(self.args.batch_size)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            # DDP: no_sync keeps the gradients local; the last micro-batch's backward all-reduces
            # their sum. Sum x W/G: DDP's average over W ranks is then the mean over the G samples,
            # whatever the share of each rank.
            last = i == len(inputs) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = F.mse_loss(self.model(x), y, reduction="sum")
                (loss * self.ddp.world_size / self.global_batch).backward()
            loss_sum += loss.detach()
        self.optimizer.step()
        return loss_sum

    def _batches_left(self, epoch):
        """This rank's share of each step left in the epoch, one batch per step."""
        # DDP: the epoch's shuffle: the same on every rank and in every attempt.
        self.sampler.set_epoch(epoch)
        mine = list(self.sampler)
        steps = range(self.step - epoch * self.steps_per_epoch, self.steps_per_epoch)
        rank, world_size = self.ddp.rank, self.ddp.world_size
        shares = [my_share(mine, s, self.global_batch, rank, world_size) for s in steps]
        # Its own generator: else every new loader draws from the global stream (dropout's), and
        # a resumed run, which makes one loader more, would drift from an unbroken one.
        return DataLoader(
            self.train_set,
            batch_sampler=shares,
            pin_memory=self.device.type == "cuda",
            generator=torch.Generator(),
        )

    def _run_epoch(self, epoch):
        """Train the rest of the epoch; True when the ranks agreed to stop, or at the last step."""
        args = self.args
        # The loss summed on the device between log lines: no wait for the GPU per step.
        loss_sum = torch.zeros((), device=self.device)
        steps = 0
        start = time.perf_counter()
        for x, y in self._batches_left(epoch):
            loss_sum += self._run_batch(x, y)
            self.step += 1
            steps += 1
            stop = False
            if self.step % args.log_every == 0 or self.step == self.last_step:
                samples = steps * self.global_batch
                # DDP: add up every rank's loss: the mean over the samples since the last line or
                # the epoch's start (steps after an epoch's last line are not printed).
                dist.all_reduce(loss_sum)
                # .item() waits for the device: once per log line.
                print0(
                    f"epoch {epoch + 1}/{args.epochs} | step {self.step}/{self.last_step}"
                    f" | loss {loss_sum.item() / samples:.4f}"
                    f" | {samples / (time.perf_counter() - start):.0f} samples/s"
                )
                loss_sum.zero_()
                steps = 0
                start = time.perf_counter()
                # Preemption: here, where the loop waits for the device anyway, the ranks agree
                # whether any of them was signalled, and all stop at this same step.
                stop = self.step < self.last_step and self._agree_to_stop()
            self._maybe_fail()
            finished = stop or self.step == self.last_step
            # A snapshot at the end, at every epoch's end, and every --save-every steps.
            epoch_end = self.step % self.steps_per_epoch == 0
            if finished or epoch_end or (args.save_every and self.step % args.save_every == 0):
                self._save_checkpoint()
            if finished:
                return True
        return False

    def _maybe_fail(self):
        """--fail-at-step: die like a real crash (SIGKILL: no exception, no cleanup), in
        torchrun's first attempt only, so that the restarted workers go on."""
        ddp = self.ddp
        if (
            self.step == self.args.fail_at_step
            and ddp.rank == ddp.world_size - 1
            and not self.restart
        ):
            # One write: rank 0's log line of the same step cannot land inside it.
            print(
                f"fail: rank {ddp.rank} | step {self.step} | SIGKILL (--fail-at-step)\n",
                end="",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _agree_to_stop(self):
        """Did any rank receive a stop signal? A host sync, so only at log lines, which wait for
        the device anyway: a stop comes up to --log-every steps late."""
        flag = torch.tensor(received_signal, device=self.device)
        # DDP: every rank must stop at the same step, or the others wait forever in the next
        # all-reduce: the highest signal number any rank received, on every rank.
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stop_signal = int(flag.item())
        return self.stop_signal != 0

    def _save_checkpoint(self):
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        rngs = [None] * self.ddp.world_size
        # DDP: every rank's random state, so each takes its own back on resume
        dist.all_gather_object(rngs, rng)
        state = {
            # DDP: the bare model's weights (model.module), without DDP's "module." prefix
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "global_batch": self.global_batch,
            "world_size": self.ddp.world_size,
            "rng": rngs,
            "data": self.data_name,
        }
        # DDP: every process holds the same weights: rank 0 writes (atomically), the others wait.
        save_checkpoint(state, self.path)
        print0(f"saved: {self.path} | step {self.step}/{self.last_step}")

    def train(self):
        for epoch in range(self.step // self.steps_per_epoch, self.args.epochs):
            if self.step >= self.last_step or self._run_epoch(epoch):
                break


@record
def main():
    args = parse_args()
    # First thing: a stop signal that comes while the group forms is kept for the first check.
    for stop_signal in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop_signal, note_signal)
    # DDP: join the process group; torchrun says which process this is (rank, local rank).
    ddp = setup()
    trainer = Trainer(args, ddp, make_dataset(args.samples))
    print0(
        f"start: world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} | "
        f"global batch {trainer.global_batch} | micro-batch {args.batch_size} | step "
        f"{trainer.step}/{trainer.last_step} | restart {trainer.restart}/"
        f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', 0)}"
    )
    start = time.perf_counter()
    trainer.train()
    stop_signal = trainer.stop_signal
    if stop_signal:
        print0(
            f"preempted: signal {signal.Signals(stop_signal).name} | step "
            f"{trainer.step}/{trainer.last_step} | snapshot {trainer.path}"
        )
    else:
        print0(
            f"done: world {ddp.world_size} | steps {trainer.step}/{trainer.last_step} | "
            f"restarts {trainer.restart} | time {time.perf_counter() - start:.1f}s"
        )
    # DDP: drop the wrapper, then leave the process group.
    del trainer
    cleanup()
    if stop_signal:
        # 128 + the signal, as a shell reports a process it killed: the launcher (and Slurm)
        # see a run that did not finish, and the same command resumes it.
        sys.exit(128 + stop_signal)


if __name__ == "__main__":
    main()
